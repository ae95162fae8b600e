"""The CUDA runner (runtime/model/cuda.py) against the reference Transformer on the same steps: prefill, a later turn
over a reused prefix and batched decode give the reference's logits, in fp16, int8 and int8-dynamic KV, on the tiny
Llama engine and on a tiny Gemma 3 (local layers' windows in their own pool, extra norms, query scale).

Without a GPU the runner computes in fp32 on CPU tensors with the Triton kernels interpreted (``triton_helpers``),
which checks its math and its use of the paged cache, not its speed; a padded decode step (what a CUDA graph
replays) is checked the same way. With a GPU the same tests run it in fp16 on the device (wider tolerance), and the
graph tests run. Random weights prove mechanics, not quality.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import importlib

import pytest
import torch
from test_families import write_family_folder
from test_hf_folders import cabin_build
from triton_helpers import DEVICE, ON_GPU, triton_kernels

from cabinllm.cli.args import cli_message
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig, PagedKVCache
from cabinllm.runtime.model.cuda import CudaRunner, check_device, check_kv_mode
from cabinllm.runtime.model.cuda_graphs import StepInputs, bucket, graph_sizes, table_widths
from cabinllm.runtime.model.interface import Span
from cabinllm.runtime.model.linear import (Int4AwqLinear, Int4G32Linear, Int8Linear, Stacked, halves, pack_g32,
                                          pack_int4)

KERNELS = triton_kernels()
DTYPE = torch.float16 if ON_GPU else torch.float32
TOLERANCE = 3e-2 if ON_GPU else 2e-3  # fp16 operands on a GPU; fp32 summed in another order on the CPU
# int8-dynamic rounds each token's K/V against its own abs-max: a last-bit difference in a later layer's K (attention
# summed in another order) can move a code, or a token's fp16 scale, by one step (7 codes of 493,056 here), which
# moves these logits by up to 0.015
DYNAMIC_TOLERANCE = 3e-2
PROMPT = [(7 * i + 3) % 19 + 1 for i in range(21)]  # longer than Gemma's window of 8
NEXT_TURN = PROMPT + [(5 * i + 2) % 19 + 1 for i in range(7)]  # the first turn's blocks reused, 7 new tokens


def runner_of(engine: Engine) -> CudaRunner:
    return CudaRunner(engine.model, DEVICE, DTYPE, graphs=False, kernels=KERNELS)


def caches(engine: Engine, kv_mode: str, max_sequences: int = 2) -> tuple[PagedKVCache, PagedKVCache]:
    """A reference cache on the CPU and one for the runner on its device, same config."""
    config = engine.kv_cache_config(KvCacheConfig(kv_mode, 1 << 20, 4))
    return (PagedKVCache(engine.model.kv_layout, config, engine.scales, max_sequences=max_sequences),
            PagedKVCache(engine.model.kv_layout, config, engine.scales, max_sequences=max_sequences, device=DEVICE))


def close_within(ours: torch.Tensor, theirs: torch.Tensor, tolerance: float = TOLERANCE) -> None:
    torch.testing.assert_close(ours.float().cpu(), theirs, atol=tolerance, rtol=tolerance)


def dialogue(engine: Engine, runner: CudaRunner, kv_mode: str, decode=None) -> None:
    """A first turn, a second sequence whose prompt reuses the first's blocks, then three batched decode steps: each
    step's logits on the runner equal the reference's. ``decode(spans, cache)`` runs the runner's decode steps
    (default: ``step``)."""
    tolerance = max(TOLERANCE, DYNAMIC_TOLERANCE) if kv_mode == "int8-dynamic" else TOLERANCE
    close = functools.partial(close_within, tolerance=tolerance)
    theirs, ours = caches(engine, kv_mode)
    first = [Sequence(), Sequence()]
    second = [Sequence(), Sequence()]
    for model, cache, seq in ((engine.model, theirs, first[0]), (runner, ours, first[1])):
        cache.allocate(seq, PROMPT)
    close(runner.forward(PROMPT, 0, ours, first[1], all_logits=True),
          engine.model.forward(PROMPT, 0, theirs, first[0], all_logits=True))
    reused = [cache.allocate(seq, NEXT_TURN) for cache, seq in ((theirs, second[0]), (ours, second[1]))]
    assert reused[0] == reused[1] > 0
    start = reused[0]
    close(runner.forward(NEXT_TURN[start:], start, ours, second[1]),
          engine.model.forward(NEXT_TURN[start:], start, theirs, second[0]))
    tokens = [3, 9]
    for step in range(3):
        logits = []
        pairs = ((engine.model, theirs, (first[0], second[0])), (runner, ours, (first[1], second[1])))
        for model, cache, seqs in pairs:
            spans = [Span([token], len(seq), seq) for seq, token in zip(seqs, tokens)]
            for seq, token in zip(seqs, tokens):
                cache.append(seq, [token])
            run = decode if model is runner and decode is not None else model.step
            logits.append(run(spans, cache))
        close(logits[1], logits[0])
        tokens = [(t * 3 + step) % 19 + 1 for t in tokens]


@pytest.mark.parametrize("kv_mode", ["int8", pytest.param("fp16", marks=pytest.mark.slow),
                                     pytest.param("int8-dynamic", marks=pytest.mark.slow),
                                     pytest.param("fp8", marks=[pytest.mark.slow, pytest.mark.skipif(
                                         ON_GPU and torch.cuda.get_device_capability() < (8, 9),
                                         reason="fp8 KV needs sm_89")])])
def test_runner_equals_the_reference(tiny_engine, kv_mode):
    dialogue(tiny_engine, runner_of(tiny_engine), kv_mode)


def quantized_copy(engine: Engine) -> Engine:
    """The tiny engine with its linears quantized in every layout the runner multiplies in its Triton linears:
    int4-g32 for qkv, W4A16-AWQ (group 64, a prequant scale) for dense, W8A16 for proj, a stack of int4-g32 and
    int4-g32 on int8 activations for fc/gate."""
    def g32(w: torch.Tensor, int8_x: bool = False) -> Int4G32Linear:
        blocks = w.unflatten(-1, (-1, 32))
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        scale = ((high - low) / 15).half().float()
        q = torch.round((blocks - low.half().float()) / scale).clamp(0, 15).flatten(-2)
        return Int4G32Linear(pack_g32(q), scale.squeeze(-1).half(), low.squeeze(-1).half(), int8_x)

    def awq(w: torch.Tensor) -> Int4AwqLinear:
        prequant = 1 + torch.rand(w.shape[1], generator=torch.Generator().manual_seed(3))
        groups = (w / prequant).unflatten(-1, (-1, 64))
        scale = groups.abs().amax(-1, keepdim=True) / 7
        q = torch.round(groups / scale).clamp(-8, 7).flatten(-2)
        return Int4AwqLinear(pack_int4(q), scale.squeeze(-1), 1 / prequant, 64)

    def w8(w: torch.Tensor) -> Int8Linear:
        scale = w.abs().amax(-1) / 127
        return Int8Linear(torch.round(w / scale[:, None]).to(torch.int8), scale)

    model = copy.copy(engine.model)
    model.__dict__.pop("_step_weights", None)  # the fused decode step's view of the layers, taken again
    model.layers = [dict(layer) for layer in model.layers]
    for layer in model.layers:
        fc, gate = halves(layer["fc_gate"])
        layer.update(qkv=g32(layer["qkv"]), dense=awq(layer["dense"]), proj=w8(layer["proj"]),
                     fc_gate=Stacked((g32(fc), g32(gate, int8_x=True))))
    return dataclasses.replace(engine, model=model)


@pytest.mark.slow
def test_runner_multiplies_quantized_weights_as_stored(tiny_engine):
    """int4-g32 (also on int8 activations), W4A16-AWQ and W8A16 linears stay as stored on the device, multiplied by
    the Triton linears, and give the reference's logits with the same weights."""
    engine = quantized_copy(tiny_engine)
    runner = runner_of(engine)
    qkv, proj = runner.layers[0]["qkv"], runner.layers[0]["proj"]
    assert qkv.weight is None and qkv.int4.codes.dtype == torch.uint8
    assert proj.weight.dtype == torch.int8 and proj.scale.dtype == torch.float32
    assert runner.weight_bytes() < runner_of(tiny_engine).weight_bytes() / 2
    dialogue(engine, runner, "fp32")  # fp32 KV: no int8 code flips over one ulp, only the linears compared


def test_padded_decode_step_equals_the_reference(tiny_engine):
    """A decode step padded to a bucket of 4 rows, with tables as wide as the context and a fixed split count
    (what a captured graph replays), gives the reference's logits for its real rows and stores nothing for the
    padded ones."""
    runner = runner_of(tiny_engine)

    def padded(spans, cache):
        widths = table_widths(cache, runner.config.max_position_embeddings)
        inputs = StepInputs.of(spans, cache, runner.device, 4, widths, KERNELS.decode_splits(64))
        assert inputs.views[0].tables.shape == (4, widths[0]) and inputs.views[0].slots.tolist()[2:] == [-1, -1]
        with torch.inference_mode():
            return runner.decode(inputs)[:len(spans)]

    dialogue(tiny_engine, runner, "int8", decode=padded)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Engine:
    """A tiny Gemma 3 engine (four layers, local ones with a window of 8; int8 KV scales)."""
    root = tmp_path_factory.mktemp("gemma3-cuda")
    write_family_folder(root / "hf", "Gemma3", seed=1)
    return Engine.load(cabin_build(root / "hf", root / "engine"))


@pytest.mark.slow
@pytest.mark.parametrize("kv_mode", ["int8", "fp16"])
def test_runner_equals_the_reference_on_gemma3_windows(gemma, kv_mode):
    dialogue(gemma, runner_of(gemma), kv_mode)


def test_graph_buckets():
    """Buckets double up to the largest batch, which is one; a step takes the smallest that holds it."""
    assert graph_sizes(5) == (1, 2, 4, 5)
    assert graph_sizes(16) == (1, 2, 4, 8, 16)
    assert [bucket(graph_sizes(5), n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 5, None]


def test_graph_buckets_follow_the_servers_sessions(tiny_engine):
    """A core for 6 sessions sizes the runner's decode graphs up to 6 (nothing is captured before a step)."""
    from cabinllm.runtime.engine.scheduler import SchedulerConfig
    from cabinllm.runtime.model.cuda_graphs import DecodeGraphs

    runner = runner_of(tiny_engine)
    runner.graphs = DecodeGraphs(runner)
    engine = dataclasses.replace(tiny_engine, model=runner, device=torch.device(DEVICE))
    engine.new_core(engine.new_cache(KvCacheConfig("int8", 1 << 20, 4), 6), SchedulerConfig(max_sessions=6))
    assert runner.graphs.sizes == (1, 2, 4, 6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_refused_without_cuda(tiny_engine_dir):
    """--device cuda where torch has no CUDA: one clear line naming why and the fix; nothing loaded."""
    with pytest.raises(ConfigError, match="needs a CUDA GPU.*install torch with CUDA") as refused:
        Engine.load(tiny_engine_dir, device="cuda")
    assert "device cpu" in str(refused.value)


def test_kv_modes_the_runner_refuses():
    with pytest.raises(ConfigError, match="reference engine only"):
        check_kv_mode("int4", torch.device("cpu"))
    for stored in ("int8", "fp8", "fp16", "int8-dynamic"):
        check_kv_mode(stored, torch.device("cpu"))
    with pytest.raises(ConfigError, match="not one the CUDA runner takes"):
        check_device("mps")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_decode_equals_the_reference(tiny_engine):
    """Decode steps replayed from captured graphs (buckets of 2) give the reference's logits."""
    runner = CudaRunner(tiny_engine.model, "cuda", torch.float16, graphs=True, kernels=KERNELS)
    dialogue(tiny_engine, runner, "int8")
    assert runner.graphs._graphs, "no graph was captured"


def test_fp8_is_one_line_naming_the_capability_below_sm89(monkeypatch):
    """What a GPU below sm_89 (Orin's 8.7) is told, checked with its capability faked; 8.9 and 9.0 store fp8."""
    for capability in ((8, 7), (8, 9), (9, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        if capability < (8, 9):
            with pytest.raises(ConfigError) as refused:
                check_kv_mode("fp8", torch.device("cuda"))
            assert cli_message(refused.value) == ("fp8 KV needs a GPU of compute capability 8.9 or newer (Ada, "
                                                  "Hopper, Blackwell); this one is 8.7, and int8 KV takes the same "
                                                  "bytes; choose --kv-cache int8")
        else:
            check_kv_mode("fp8", torch.device("cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 KV's refusal depends on the GPU")
def test_fp8_refused_below_sm89():
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) >= (8, 9):
        check_kv_mode("fp8", device)
    else:
        with pytest.raises(ConfigError, match="compute capability 8.9"):
            check_kv_mode("fp8", device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", ["cabinllm.cli.chat", "cabinllm.cli.serve", "cabinllm.benchmarks.cli",
                                     "cabinllm.cli.eval"])
def test_each_command_refuses_device_cuda_in_one_line(tiny_engine_dir, tmp_path, capsys, command):
    """cabin-chat, cabin-serve, cabin-bench and cabin-eval: --device cuda without CUDA exits 2 with one line naming
    why and the fix (--device cpu)."""
    main = importlib.import_module(command).main
    folder = ["--model", str(tiny_engine_dir), "--output", str(tmp_path)] if command.endswith("eval") else \
        ["--engine", str(tiny_engine_dir)]
    assert main([*folder, "--device", "cuda"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "--device cpu" in lines[0], lines


def test_eval_moves_each_model_once_and_checks_modes_first(monkeypatch, tiny_engine):
    """cabin-eval --device cuda: each distinct model becomes one CUDA runner (modes sharing weights share it), and a
    mode the runner does not store is refused before any moves."""
    from cabinllm.calibration import evaluate
    from cabinllm.runtime.kv.modes import kv_mode

    moved = []
    monkeypatch.setattr(evaluate, "check_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(evaluate, "check_kv_mode", lambda name, device: check_kv_mode(name, torch.device("cpu")))
    monkeypatch.setattr(evaluate.CudaRunner, "of", classmethod(lambda cls, model, device: moved.append(model) or
                                                                 ("runner", id(model))))
    shared, other = tiny_engine.model, object()
    runners = {name: evaluate.ModeRunner(model, kv_mode(mode), None) for name, model, mode in (
        ("int8", shared, "int8"), ("fp16", shared, "fp16"), ("w/int8", other, "int8"))}
    assert evaluate.on_device(runners, "cuda") == torch.device("cuda")
    assert moved == [shared, other]
    assert runners["int8"].model is runners["fp16"].model == ("runner", id(shared))
    refused = {"int4": evaluate.ModeRunner(shared, kv_mode("int4"), None)}
    with pytest.raises(ConfigError, match="reference engine only"):
        evaluate.on_device(refused, "cuda")
    assert refused["int4"].model is shared


@pytest.mark.slow
def test_a_dialogue_on_the_runner_replies_as_the_reference(tiny_engine, tmp_path):
    """Turns through the engine core (DialogueSession: prefill over the reused history, greedy decode) reply with the
    reference's tokens; the session saved and restored from a file goes on the same way."""
    from cabinllm.runtime.dialogue.session import DialogueSession
    from cabinllm.runtime.generation.sampling import SamplingParams

    ours = dataclasses.replace(tiny_engine, model=runner_of(tiny_engine), device=torch.device(DEVICE))
    turns = ["Turn on the seat heating, please.", "And the steering wheel.", "Thanks."]
    replies = {}
    for name, engine in (("reference", tiny_engine), ("runner", ours)):
        params = SamplingParams(max_new_tokens=5, stop_token_ids=engine.stop_token_ids())
        session = DialogueSession(engine, engine.new_cache(KvCacheConfig("int8", 1 << 20, 4)), params, "Be brief.")
        replies[name] = [session.chat(text).token_ids for text in turns[:2]]
        session.save(tmp_path / f"{name}.json")
        restored = DialogueSession.restore(tmp_path / f"{name}.json", engine,
                                           engine.new_cache(KvCacheConfig("int8", 1 << 20, 4)))
        stats = restored.chat(turns[2])
        assert stats.reused_tokens > 0
        replies[name].append(stats.token_ids)
    assert replies["runner"] == replies["reference"]


@pytest.mark.slow
def test_a_long_dialogue_never_allocates_past_its_budget(tiny_engine):
    """A dialogue at a fixed KV budget on the runner (60 turns on a GPU; 10 here, the kernels interpreted): the
    sink-window policy keeps every turn going, the cache never holds more than its budget, and on a GPU no turn after
    the first allocates more device memory than the first did."""
    from cabinllm.runtime.dialogue.overflow import OverflowPolicy
    from cabinllm.runtime.dialogue.session import DialogueSession
    from cabinllm.runtime.generation.sampling import SamplingParams

    engine = dataclasses.replace(tiny_engine, model=runner_of(tiny_engine), device=torch.device(DEVICE))
    cache = engine.new_cache(KvCacheConfig("int8", 48 << 10, 4))  # about 120 tokens: a few turns
    budget = cache.stats().bytes_reserved
    params = SamplingParams(max_new_tokens=6, stop_token_ids=engine.stop_token_ids())
    session = DialogueSession(engine, cache, params, "Be brief.", OverflowPolicy("sink-window"))
    peaks, evicted = [], 0
    for turn in range(60 if ON_GPU else 10):
        if ON_GPU:
            torch.cuda.reset_peak_memory_stats()
        stats = session.chat(f"Turn {turn}: set the cabin to {18 + turn % 8} degrees and play the next song.")
        assert stats.finish_reason in ("stop", "length") and stats.kv_bytes_used <= budget
        evicted += stats.evicted_tokens
        if ON_GPU:
            peaks.append(torch.cuda.max_memory_allocated())
    assert evicted > 0  # the budget was reached and the policy made room
    assert all(peak <= peaks[0] for peak in peaks[1:])
