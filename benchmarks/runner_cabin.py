"""Our reference engine as a benchmark runner, one per KV cache mode."""
from __future__ import annotations

from runtime.engine import DEFAULT_TOKENS_PER_BLOCK, Engine
from runtime.generate import generate
from runtime.kv_cache import KV_MODES
from runtime.native_kernels import matvec, native_kernels_enabled
from runtime.sampling import SamplingParams

from benchmarks.runner import KVFootprint, Runner, RunTiming

KV_DESCRIPTIONS = {
    "fp32": "fp32",
    "fp16": "fp16",
    "int8": "int8, one static scale per layer shared by K and V",
    "int8-separate": "int8, static per-layer K and V scales",
    "int8-dynamic": "int8 + fp16 scale per token and KV head",
    "int4": "int4 KIVI-style (K per channel, V per token, groups of 32) + fp16 blocks holding the newest 128 tokens",
}


def available_modes(wanted: list[str]) -> list[str]:
    """The wanted modes this runtime has (int4 only where runtime.kv_cache offers it)."""
    return [m for m in wanted if m in KV_MODES]


def cabin_runner(engine: Engine, mode: str) -> Runner:
    """Prefill and greedy decode on a fresh paged cache of ``mode``, sized to the prompt."""
    layout = engine.model.kv_layout

    def run(prompt: list[int], new_tokens: int) -> RunTiming:
        tpb = DEFAULT_TOKENS_PER_BLOCK
        blocks = -(-(len(prompt) + new_tokens) // tpb) + 1
        budget = layout.bytes_per_token(mode, tpb) * tpb * blocks
        if mode == "int4":
            budget += layout.int4_window_bytes(tpb)
        cache = engine.new_cache(mode, budget, tpb)
        params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=[])
        result = generate(engine.model, cache, 0, prompt, params, engine.tokenizer.decode_reply)
        return RunTiming(len(prompt), result.ttft_s, len(result.token_ids) - 1, result.decode_s)

    def footprint(budget: int, _prompt: list[int]) -> KVFootprint:
        stats = engine.new_cache(mode, budget).stats()
        return KVFootprint(stats.bytes_per_token, stats.window_bytes, stats.tokens_capacity,
                           f"runtime block accounting (PagedKVCache.stats), blocks of {DEFAULT_TOKENS_PER_BLOCK} "
                           "tokens")

    return Runner(f"cabin {mode}", "cabin", KV_DESCRIPTIONS[mode], weights_note(mode), run, footprint, mode=mode)


def weights_note(mode: str) -> str:
    """The weights and which code runs a decode step in this mode: native kernels or the torch fallback."""
    if not native_kernels_enabled() or matvec() is None:
        return "fp32 (the engine's checkpoint, upcast); decode steps on the torch path (native kernels off)"
    attention = "attention over natively dequantized blocks" if mode == "int4" else "attention in the blocks"
    return f"fp32 (the engine's checkpoint, upcast); decode steps on native kernels (matvec, {attention})"
