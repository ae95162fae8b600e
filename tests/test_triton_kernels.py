"""The Triton kernels (runtime/kernels/triton) against the reference engine's storage and attention on the same paged
cache contents: the KV write against ``KVStorage.write``, decode and prefill attention against ``grouped_attention``
over ``KVStorage.read_unscaled``, in every KV mode the CUDA runner stores (fp16, int8 with one static scale per
layer, int8 with separate K and V scales, int8-dynamic, fp8 e4m3 with one static scale per layer, fp32), with GQA,
sliding windows, split-KV and a prefix reused across turns.

Where no GPU is at hand the kernels run under Triton's interpreter on CPU tensors (``triton_helpers``). Tolerances:
fp32 pools 1e-4 (the same math in another order); fp16 and int8 pools 1e-4 on the interpreter (fp32 operands both
sides), 2e-2 on a GPU (fp16 operands of the tensor cores).
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.kv.modes import kv_mode
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.model.transformer import grouped_attention
from triton_helpers import DEVICE, ON_GPU, triton_kernels

KERNELS = triton_kernels()
MODES = ["fp16", "int8", "int8-separate", "int8-dynamic", "fp32",
         pytest.param("fp8", marks=pytest.mark.skipif(ON_GPU and torch.cuda.get_device_capability() < (8, 9),
                                                       reason="Triton converts e4m3 on sm_89 and newer"))]
HEADS, KV_HEADS, HEAD = 4, 2, 16  # GQA: two query heads per KV head
TPB = 4
NUM_BLOCKS = 12
LAYER = 1  # the second of two layers: each kernel must take the layer's own pools and scales


def make_storage(mode_name: str):
    """A storage of two layers in ``mode_name`` with distinct K and V scales per layer."""
    layout = KVLayout(2, KV_HEADS, HEAD)
    scales = KVScales([0.05, 0.04], [0.03, 0.02])
    storage = kv_mode(mode_name)(layout, NUM_BLOCKS, TPB, scales)
    for name, pool in storage.token_tensors().items():
        pool.data = pool.to(DEVICE)
        setattr(storage, name, pool.data)
    return storage


def slots_of(table: list[int], start: int, end: int) -> torch.Tensor:
    """Flat slots of positions [start, end) of a sequence on blocks ``table``."""
    pos = torch.arange(start, end)
    return torch.tensor(table)[pos // TPB] * TPB + pos % TPB


def fill(storage, table: list[int], tokens: int, seed: int) -> None:
    """Write ``tokens`` random K/V rows of a sequence on ``table`` with the reference's write, in every layer."""
    gen = torch.Generator().manual_seed(seed)
    for layer in range(2):
        k = torch.randn(tokens, KV_HEADS, HEAD, generator=gen) * 2
        v = torch.randn(tokens, KV_HEADS, HEAD, generator=gen)
        storage.write(layer, slots_of(table, 0, tokens).to(DEVICE), k.to(DEVICE), v.to(DEVICE))


def reference(storage, q: torch.Tensor, table: list[int], tokens: int, start_pos: int,
              window: int | None = None) -> torch.Tensor:
    """The reference engine's attention (n, heads, head) of queries at [start_pos, tokens) of one sequence."""
    keys, values, k_scale, v_scale = storage.read_unscaled(LAYER, torch.tensor(table, device=DEVICE), tokens)
    out = grouped_attention(q.float().cpu() * k_scale, keys.cpu(), values.cpu(), start_pos, window=window)
    return (out * v_scale).reshape(q.shape[0], HEADS, HEAD)


def tolerance(mode_name: str) -> float:
    return 2e-2 if ON_GPU and mode_name != "fp32" else 1e-4


def query_dtype(mode_name: str) -> torch.dtype:
    return torch.float16 if ON_GPU and mode_name != "fp32" else torch.float32


@pytest.mark.parametrize("mode_name", MODES)
def test_write_kv_stores_what_the_reference_stores(mode_name):
    """The KV write kernel leaves the pools exactly as ``KVStorage.write`` does (codes, token scales, halves), and
    a negative slot stores nothing."""
    ours, theirs = make_storage(mode_name), make_storage(mode_name)
    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(7, KV_HEADS, HEAD, generator=gen) * 2).to(DEVICE)
    v = torch.randn(7, KV_HEADS, HEAD, generator=gen).to(DEVICE)
    k[0, 0, :4] = torch.tensor([0.025, -0.075, 0.125, 0.0])  # halves of the int8 scale: ties round to even
    # fp8's scale times e4m3 ties (1.0625 -> 1, 1.1875 -> 1.25, 1.5 * 2^-9 -> 2^-8 below the smallest normal,
    # -5.5 -> -6), past 448 (saturates) and a subnormal
    fp8 = torch.tensor([1.0625, 1.1875, 1.5 * 2 ** -9, -5.5, 500.0, -3 * 2 ** -9])
    k[1, 0, :6] = fp8 * ours.stored_kv(LAYER, torch.zeros(1), 0).k_scale if mode_name == "fp8" else k[1, 0, :6]
    slots = torch.tensor([5, 9, 10, 11, 30, 2, 47], device=DEVICE)
    theirs.write(LAYER, slots[:6], k[:6], v[:6])
    padded = slots.clone()
    padded[6] = -1  # a padded row: stored nowhere
    KERNELS.write_kv(k, v, padded, ours.stored_kv(LAYER, torch.zeros(1), 0))
    for name, pool in theirs.token_tensors().items():
        assert torch.equal(ours.token_tensors()[name], pool), name


def _decode_case(mode_name: str, window: int | None, splits: int | None):
    storage = make_storage(mode_name)
    tables = [[7, 2, 9, 0], [4], [11, 1, 5]]  # shuffled blocks: a wrong block index reads another sequence's keys
    lengths = [15, 3, 10]
    for i, (table, n) in enumerate(zip(tables, lengths)):
        fill(storage, table, n, seed=i)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(len(tables), HEADS, HEAD, generator=gen).to(DEVICE, query_dtype(mode_name))
    pools = storage.stored_kv(LAYER, torch.zeros(1), 0)
    out = KERNELS.decode_attention(q, pools, KERNELS.block_tables(tables, DEVICE),
                                   torch.tensor(lengths, dtype=torch.int32, device=DEVICE), 1 / math.sqrt(HEAD),
                                   window=window or 0, splits=splits)
    for i, (table, n) in enumerate(zip(tables, lengths)):
        expected = reference(storage, q[i:i + 1], table, n, n - 1, window)
        torch.testing.assert_close(out[i:i + 1].float().cpu(), expected, atol=tolerance(mode_name),
                                   rtol=tolerance(mode_name))


@pytest.mark.parametrize("mode_name", MODES)
def test_decode_attention_matches_the_reference(mode_name):
    """One query per sequence over its shuffled blocks, GQA, split four ways (some splits hold no key)."""
    _decode_case(mode_name, window=None, splits=4)


@pytest.mark.parametrize("mode_name", ["int8", "fp16"])
def test_decode_attention_window_and_one_split(mode_name):
    """A sliding window (Gemma 3's local layers) of 6 keys; one split and the reduce over it."""
    _decode_case(mode_name, window=6, splits=1)


def test_decode_attention_padded_row_gives_zeros():
    """A sequence of length 0 (a padded row of a fixed-size step) reads nothing and gives zeros, not NaN."""
    storage = make_storage("int8")
    fill(storage, [3, 4], 6, seed=1)
    q = torch.randn(2, HEADS, HEAD).to(DEVICE)
    pools = storage.stored_kv(LAYER, torch.zeros(1), 0)
    out = KERNELS.decode_attention(q, pools, KERNELS.block_tables([[3, 4], [0]], DEVICE),
                                   torch.tensor([6, 0], dtype=torch.int32, device=DEVICE), 0.25, splits=2)
    assert torch.equal(out[1].cpu(), torch.zeros(HEADS, HEAD))
    assert torch.isfinite(out[0]).all()


def _prefill_case(mode_name: str, window: int | None) -> None:
    """Two sequences: one whose first turn (9 tokens) is cached and whose next turn adds 6, one new of 5 tokens."""
    storage = make_storage(mode_name)
    tables = [[6, 1, 10, 3], [8, 0]]
    prefix = [9, 0]
    lengths = [15, 5]
    for i, (table, n) in enumerate(zip(tables, lengths)):
        fill(storage, table, n, seed=20 + i)  # the new tokens' K/V are written before attention, as the runner does
    gen = torch.Generator().manual_seed(5)
    q_lens = [n - p for n, p in zip(lengths, prefix)]
    q = torch.randn(sum(q_lens), HEADS, HEAD, generator=gen).to(DEVICE, query_dtype(mode_name))
    pools = storage.stored_kv(LAYER, torch.zeros(1), 0)
    out = KERNELS.prefill_attention(q, pools, KERNELS.block_tables(tables, DEVICE), q_lens, lengths,
                                    1 / math.sqrt(HEAD), window=window or 0, rows=16)
    first = 0
    for table, n, p, count in zip(tables, lengths, prefix, q_lens):
        expected = reference(storage, q[first:first + count], table, n, p, window)
        torch.testing.assert_close(out[first:first + count].float().cpu(), expected, atol=tolerance(mode_name),
                                   rtol=tolerance(mode_name))
        first += count


@pytest.mark.parametrize("mode_name", MODES)
def test_prefill_attention_over_a_cached_prefix(mode_name):
    """New tokens of a later turn attend to the cached turn's blocks and causally among themselves."""
    _prefill_case(mode_name, window=None)


def test_prefill_attention_window():
    """Prefill of a local layer: each query over its last 4 positions."""
    _prefill_case("int8", window=4)


def test_decode_splits_bounds():
    """Splits grow with the longest sequence, in powers of two, up to the cap."""
    assert KERNELS.decode_splits(1) == 1
    assert KERNELS.decode_splits(KERNELS.SPLIT_TOKENS + 1) == 2
    assert KERNELS.decode_splits(10 ** 6) == KERNELS.MAX_SPLITS


@pytest.mark.parametrize("mode_name", ["int8", MODES[-1]])
def test_a_wrong_scale_or_block_is_caught(mode_name):
    """The comparison these tests make fails where the kernel would read without the scales or from another
    sequence's block: the reference differs from such a read by over ten times the tolerance (int8: 57.8 and
    1.25)."""
    storage = make_storage(mode_name)
    table = [7, 2, 9]
    fill(storage, table, 11, seed=4)
    q = torch.randn(1, HEADS, HEAD, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    pools = storage.stored_kv(LAYER, torch.zeros(1), 0)
    expected = reference(storage, q, table, 11, 10)

    def decode(pools, table):
        return KERNELS.decode_attention(q, pools, KERNELS.block_tables([table], DEVICE),
                                        torch.tensor([11], dtype=torch.int32, device=DEVICE), 1 / math.sqrt(HEAD))

    torch.testing.assert_close(decode(pools, table).float().cpu(), expected, atol=1e-4, rtol=1e-4)
    unscaled = replace(pools, k_scale=1.0, v_scale=1.0)  # codes read as values
    fill(storage, [5], 4, seed=5)  # another sequence's block
    for wrong in (decode(unscaled, table), decode(pools, [7, 2, 5])):
        assert (wrong.float().cpu() - expected).abs().max() > 10 * tolerance("int8")


@pytest.mark.parametrize("tokens", [1, 20])
def test_quantized_linears_equal_the_dequantized_product(tokens):
    """The W8A16 and int4 linears (a decode step's one token, a prefill's 20) equal x @ W.T with W dequantized as the
    reference does, on output counts that are not a multiple of the tile (W8A16: nor the inputs)."""
    from cabinllm.runtime.formats.weight_formats import GGUF_GROUP
    from cabinllm.runtime.kernels.triton import LINEAR_MODULE, load
    from cabinllm.runtime.model.linear import Int4AwqLinear, Int4G32Linear, Int8Linear, pack_g32, pack_int4

    linears = load(LINEAR_MODULE)
    assert linears.G32_GROUP == GGUF_GROUP
    gen = torch.Generator().manual_seed(tokens)
    out, inputs = 70, 128
    g32 = Int4G32Linear(pack_g32(torch.randint(0, 16, (out, inputs), generator=gen)),
                        (torch.rand(out, inputs // 32, generator=gen) / 10).half(),
                        (torch.rand(out, inputs // 32, generator=gen) - 0.5).half())
    awq = Int4AwqLinear(pack_int4(torch.randint(-8, 8, (out, inputs), generator=gen)),
                        torch.rand(out, inputs // 64, generator=gen) / 10, torch.ones(inputs), 64)
    x = torch.randn(tokens, inputs, generator=gen).to(DEVICE, torch.float16 if ON_GPU else torch.float32)
    on = {name: value.to(DEVICE) for name, value in vars(g32).items() if isinstance(value, torch.Tensor)}
    ours = linears.int4_g32_linear(x, on["codes"], on["scale"], on["minimum"])
    tolerance = 2e-2 if ON_GPU else 1e-4
    torch.testing.assert_close(ours.float().cpu(), x.float().cpu() @ g32.dequantize().T, atol=tolerance,
                               rtol=tolerance)
    ours = linears.int4_awq_linear(x, awq.packed.to(DEVICE), awq.scale.to(DEVICE), 64)
    torch.testing.assert_close(ours.float().cpu(), x.float().cpu() @ awq.dequantize().T, atol=tolerance,
                               rtol=tolerance)
    w8 = Int8Linear(torch.randint(-127, 128, (out, inputs + 8), generator=gen, dtype=torch.int8),
                    torch.rand(out, generator=gen) / 100)
    x = torch.randn(tokens, inputs + 8, generator=gen).to(DEVICE, x.dtype)
    ours = linears.int8_linear(x, w8.weight.to(DEVICE), w8.scale.to(DEVICE))
    torch.testing.assert_close(ours.float().cpu(), x.float().cpu() @ w8.dequantize().T, atol=tolerance,
                               rtol=tolerance)
