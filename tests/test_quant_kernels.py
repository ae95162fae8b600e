"""The one-token kernels over int8, int4 and the GGUF group formats compute what the torch path computes on dequantized weights."""
from __future__ import annotations

import math
import shutil
from dataclasses import replace

import pytest
import torch
from kernel_builds import BUILDS

from cabinllm.runtime.kernels import bindings as native_kernels
from cabinllm.runtime.model.linear import (Int4AwqLinear, Int4G32Linear, Int8G32Table, Int8Linear, int8_blocks, pack_g32,
                                           pack_int4, stack)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to build the kernels")


def int8_linear(rows: int, cols: int, gen: torch.Generator) -> Int8Linear:
    return Int8Linear(torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8),
                      torch.rand(rows, generator=gen) / 100)


def int4_linear(rows: int, cols: int, group: int, gen: torch.Generator) -> Int4AwqLinear:
    q = torch.randint(-8, 8, (rows, cols), generator=gen)
    return Int4AwqLinear(pack_int4(q), torch.rand(rows, cols // group, generator=gen) / 10,
                         0.5 + torch.rand(cols, generator=gen), group)


@pytest.mark.parametrize("rows, cols, group, with_bias", [(192, 576, 64, False), (1536, 576, 64, True),
                                                          (6, 128, 128, False), (2, 64, 64, True)])
def test_quantized_matvec_equals_dequantized_linear(rows, cols, group, with_bias):
    gen = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(1, cols, generator=gen)
    bias = torch.randn(rows, generator=gen) if with_bias else None
    for op in (int8_linear(rows, cols, gen), int4_linear(rows, cols, group, gen)):
        expected = op(x, bias, native=False)  # the torch path: F.linear on the dequantized weights
        got = op(x, bias, native=True)
        assert got.shape == (1, rows)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * math.sqrt(cols) * expected.abs().max())


@pytest.mark.parametrize("build", ["AVX2 only", "generic"])
@pytest.mark.parametrize("rows, cols, group", [(192, 576, 64), (6, 36, 12), (4, 128, 128), (10, 40, 8)])
def test_wide_and_other_builds_agree(rows, cols, group, build):
    """This CPU's loops (16 lanes with AVX-512), the 8-lane AVX2 ones and the plain ones (-DGENERIC, other CPUs) give
    the same W8A16 and W4A16-AWQ sums within float rounding, rows and groups of any length included."""
    gen = torch.Generator().manual_seed(cols)
    other = native_kernels.QuantMatVec(native_kernels._load("quant_matvec", BUILDS[build]))
    x = torch.randn(1, cols, generator=gen)
    i8, i4 = int8_linear(rows, cols, gen), int4_linear(rows, cols, group, gen)
    pairs = [(native_kernels.quant_matvec().int8(x, i8.weight, i8.scale), other.int8(x, i8.weight, i8.scale)),
             (native_kernels.quant_matvec().int4(x, i4.packed, i4.scale, group),
              other.int4(x, i4.packed, i4.scale, group))]
    for wide, plain in pairs:
        assert torch.allclose(wide, plain, rtol=1e-5, atol=1e-5 * math.sqrt(cols) * plain.abs().max())


def g32_ops(rows: int, cols: int, gen: torch.Generator) -> tuple[Int4G32Linear, Int8G32Table]:
    """An int4-g32 linear (a Q4_1-like minimum of about -8 scales) and an int8 head with fp16 scales per 32."""
    scale = (torch.rand(rows, cols // 32, generator=gen) / 50).half()
    minimum = (-8 * scale.float() * (0.5 + torch.rand(rows, cols // 32, generator=gen))).half()
    q4 = Int4G32Linear(pack_g32(torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)), scale, minimum)
    return q4, Int8G32Table(torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8), scale)


@pytest.mark.parametrize("int8_x", [False, True])
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("rows, cols, tokens", [(1536, 576, 1), (7, 64, 1), (6, 96, 3), (9, 160, 6), (24, 96, 5)])
def test_group_kernels_equal_the_torch_path_on_dequantized_weights(rows, cols, tokens, build, int8_x):
    """int4-g32 and the int8 head, every build of the loops, on float or int8 activations: every block of rows and
    chunk of tokens, remainders included, within float rounding of F.linear on the dequantized weights (int8: on the
    input as int8_blocks rounds it), each token's row as it is alone."""
    gen = torch.Generator().manual_seed(rows * cols + tokens)
    kernel = native_kernels.QuantMatVec(native_kernels._load("quant_matvec", BUILDS[build]))
    x, bias = torch.randn(tokens, cols, generator=gen), torch.randn(rows, generator=gen)
    q4, head = (replace(op, int8_x=int8_x) for op in g32_ops(rows, cols, gen))
    def run_q4(rows: torch.Tensor) -> torch.Tensor:
        return kernel.q4g32(rows, q4.codes, q4.scale, q4.minimum, bias, int8_x)

    def run_head(rows: torch.Tensor) -> torch.Tensor:
        return kernel.q8g32(rows, head.codes, head.scale, bias, int8_x)

    for run, op in ((run_q4, q4), (run_head, head)):
        expected, got = op(x, bias, native=False), run(x)
        assert got.shape == (tokens, rows)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * math.sqrt(cols) * expected.abs().max())
        assert torch.equal(got, torch.cat([run(row[None]) for row in x]))
    with pytest.raises(ValueError, match="inputs a multiple of 32"):
        kernel.q8g32(torch.randn(1, 48), head.codes[:, :48].contiguous(), head.scale[:, :1].contiguous())


def test_int8_activations_round_each_block_of_32_to_int8_codes():
    """int8_blocks: per 32 inputs a scale of max |x| / 127, every value a multiple of it within [-127, 127] of
    them, the largest kept, an all-zero block zero; on real-sized inputs the rounding moves a product
    by well under 1%."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 96, generator=gen)
    x[1, 32:64] = 0
    blocks, rounded = x.view(2, 3, 32), int8_blocks(x).view(2, 3, 32)
    e = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(e > 0, rounded / e.clamp_min(1e-30), 0)
    assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.round().abs().max() == 127
    assert torch.allclose(rounded.abs().amax(-1), blocks.abs().amax(-1), rtol=1e-6) and not rounded[1, 1].any()
    assert torch.all((rounded - blocks).abs() <= e / 2 + 1e-7)
    q4, _ = g32_ops(1536, 576, gen)
    x = torch.randn(4, 576, generator=gen)
    exact, on_int8 = q4(x), replace(q4, int8_x=True)(x)
    assert 1e-4 < ((on_int8 - exact).norm() / exact.norm()).item() < 1e-2


def test_stacked_int4_runs_as_two_kernels():
    """fc and gate with their own prequant scales run as two kernels."""
    gen = torch.Generator().manual_seed(1)
    fc, gate = int4_linear(8, 128, 64, gen), int4_linear(8, 128, 64, gen)
    both = stack(fc, gate)
    x = torch.randn(1, 128, generator=gen)
    assert torch.allclose(both(x, None, True), torch.cat([fc(x), gate(x)], dim=-1), atol=1e-4)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("tokens", [2, 5, 16])
def test_a_step_of_several_tokens_gives_each_row_as_alone(tokens, build):
    """The server's batched decode: every token of the step through the same kernels, each row equal to its
    one-token call and to the torch path within float rounding."""
    gen = torch.Generator().manual_seed(tokens)
    kernel = native_kernels.QuantMatVec(native_kernels._load("quant_matvec", BUILDS[build]))
    x, bias = torch.randn(tokens, 576, generator=gen), torch.randn(192, generator=gen)
    i8, i4 = int8_linear(192, 576, gen), int4_linear(192, 576, 64, gen)
    def int8(rows: torch.Tensor) -> torch.Tensor:
        return kernel.int8(rows, i8.weight, i8.scale, bias)

    def int4(rows: torch.Tensor) -> torch.Tensor:
        return kernel.int4(rows, i4.packed, i4.scale, 64, bias)

    for run in (int8, int4):
        got = run(x)
        assert got.shape == (tokens, 192) and torch.equal(got, torch.cat([run(row[None]) for row in x]))
    for op, got in ((i8, int8(x)), (i4, int4(x * i4.prequant))):
        expected = op(x, bias, native=False)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4 * expected.abs().max())
    with pytest.raises(ValueError, match=r"1 <= n <= 16"):
        kernel.int8(torch.randn(17, 576), i8.weight, i8.scale)


def test_quantized_matvec_rejects_wrong_scales():
    gen = torch.Generator().manual_seed(2)
    op = int4_linear(4, 128, 64, gen)
    with pytest.raises(ValueError, match=r"float32 scales \[4, 1\]"):
        native_kernels.quant_matvec().int4(torch.randn(1, 128), op.packed, op.scale, 128)


@pytest.mark.parametrize("build", BUILDS)
def test_every_linear_kernel_gives_the_same_sums_on_any_thread_count(keep_threads, build):
    """The rows of a large matrix are split over torch's threads (one OpenMP runtime); each row is still summed
    by one thread in one order, so 1 and 2 threads agree exactly: fp32, fp16, int8, int4-awq, int4-g32 and the
    int8 head (float and int8 activations), every build of the loops."""
    gen = torch.Generator().manual_seed(7)
    q4, head = g32_ops(1536, 576, gen)
    i8, i4 = int8_linear(1536, 576, gen), int4_linear(1536, 576, 64, gen)
    weight = torch.randn(1536, 576, generator=gen)
    x = torch.randn(3, 576, generator=gen)
    quant = native_kernels.QuantMatVec(native_kernels._load("quant_matvec", BUILDS[build]))
    dense = native_kernels.MatVec(native_kernels._load("matvec", BUILDS[build]))
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        runs.append((quant.q4g32(x, q4.codes, q4.scale, q4.minimum), quant.q8g32(x, head.codes, head.scale),
                     quant.q4g32(x, q4.codes, q4.scale, q4.minimum, None, True),
                     quant.q8g32(x, head.codes, head.scale, None, True),
                     quant.int8(x, i8.weight, i8.scale), quant.int4(x, i4.packed, i4.scale, 64),
                     dense(x, weight), dense(x, weight.half())))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
