"""The memory plan: how a model fits a target for each KV dtype, and the engine limits that follow.

Unified memory minus the OS reserve, the co-resident models and the runtime overhead
holds the weights; what is left holds activations and the KV pool. For each KV dtype
the plan sizes ``max_seq_len`` (the model's context, or less when the pool is smaller),
``max_num_tokens`` (a 2,048-token prefill chunk, or the whole prompt when chunked
prefill is unavailable, as with INT8 KV on TensorRT) and the pool's blocks, and turns
the pool into turns of a typical in-car dialogue (``dialogue_turns.TYPICAL_TURN``).
On a GPU target planned for the CUDA runner (``Target.on_cuda``) every KV dtype keeps block reuse and chunked
prefill. On an ONNX target ``max_seq_len`` is the graphs' KV window and ``max_num_tokens`` the
prompt graph's tokens, sized by ``cabinllm.builders.graph_plan`` as cabin-export arguments.

A model with sliding-window layers (Gemma 3's local layers) counts them at their window: its bytes per token are the
global layers', and the pool adds the local layers' window per sequence.

A TensorRT engine built for beam search (``--max-beam-width``) needs a pool for the search over the longest prompt:
TensorRT-LLM reserves a request's blocks to completion, the prompt's whole blocks once, shared by the beams, and per
beam its last partial block and the reply (``KVCacheManager::getRemainingBlocksToCompletion``, see
``cabinllm.runtime.backends.trtllm``), and the pool is sized for the worst prompt up to ``max_input_len``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from cabinllm.builders.audio_plan import SPEECH_SECONDS, AudioCost, audio_cost
from cabinllm.builders.dialogue_turns import TYPICAL_TURN, TurnTokens
from cabinllm.builders.graph_plan import GraphPlan, graph_limit, npu_weight_bytes, size_graphs, tokens_held
from cabinllm.builders.image_plan import ImageCost, image_cost
from cabinllm.builders.memory_model import (activation_bytes, kv_bytes_per_token, kv_window_bytes, parameter_count,
                                            weights_bytes)
from cabinllm.builders.targets import GIB, Backend, Target, load_targets
from cabinllm.builders.trtllm import EngineShape, build_args, cannot_build, flag_set
from cabinllm.runtime.backends.trtllm import beam_kv_blocks_up_to
from cabinllm.runtime.errors import ConfigError, PlanRefused
from cabinllm.runtime.formats.checkpoint import ModelConfig, linear_shapes
from cabinllm.runtime.formats.weight_formats import WEIGHT_FORMATS
from cabinllm.runtime.kv.blocks import cdiv
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.kv.modes import kv_mode

MAX_BATCH_SIZE = 1  # one dialogue at a time in the cabin
REPLY_TOKENS = 256  # longest reply the engine is built for: max_seq_len - max_input_len
CHUNK_TOKENS = 2048  # max_num_tokens where prefill can be chunked
MIN_TURNS = 4  # a KV dtype whose pool holds fewer turns than this does not fit
MIB = 1 << 20
ONNX_INSTEAD = ("the ONNX path runs it too: cabin-build --target cpu, cabin-export --profile ort, then on the board "
                "cabin-chat --backend onnxruntime --ort-provider cuda")


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: the model as named on the command line, a target, weight storage, reserve and KV dtype."""

    model: str
    target: Target
    weights: str = "fp16"
    reserve_gb: float | None = None  # memory of co-resident models in GiB; None = the profile's
    kv_dtype: str | None = None  # one KV dtype; None = every dtype the target allows
    max_beam_width: int = 1  # beams the TensorRT engine searches (trtllm-build --max_beam_width)
    head: str = "fp16"  # embedding and lm_head storage (HEAD_FORMATS; int8 on the reference engine only)
    speech_seconds: float = SPEECH_SECONDS  # of speech per turn (an audio-language model's)


@dataclass
class KVPlan:
    """The engine limits and dialogue length for one KV dtype."""

    kv_dtype: str
    bytes_per_token: int
    paged_context_fmha: bool
    block_reuse: bool
    activation_bytes: int
    max_kv_tokens: int  # tokens the memory left after weights and activations could hold
    max_seq_len: int
    max_input_len: int
    max_num_tokens: int
    tokens_per_block: int
    num_blocks: int  # blocks of the pool the runtime should allocate (max_seq_len x batch; with beams, their search)
    kv_pool_bytes: int
    memory_left_bytes: int  # unified memory still free after the sized pool
    est_turns: int
    prefill_tokens_per_turn: dict  # mean and last over est_turns turns, and with block reuse
    trtllm_build_args: list[str] | None
    fits: bool
    graphs: GraphPlan | None = None  # the cabin-export arguments on an ONNX target, where it fits
    max_beam_width: int = 1
    window_bytes: int = 0  # of the pool: the sliding-window layers' K/V, their window per sequence
    max_multimodal_len: int = 0  # image or audio rows the engine's prompt table holds (a vision- or audio-language)

    def kv_cache_config(self) -> KvCacheConfig:
        """The runtime KV cache this plan sizes: the pool in blocks of the target's size, reuse where it works."""
        return KvCacheConfig(self.kv_dtype, self.kv_pool_bytes, self.tokens_per_block, self.block_reuse)

    @property
    def shape(self) -> EngineShape:
        """The trtllm-build limits (weights as float16)."""
        return EngineShape(self.kv_dtype, "float16", self.tokens_per_block, MAX_BATCH_SIZE, self.max_input_len,
                           self.max_seq_len, self.max_num_tokens, self.max_beam_width, self.max_multimodal_len)


@dataclass
class Plan:
    """A model on a target: memory budget, one KVPlan per KV dtype, warnings."""

    request: PlanRequest
    config: ModelConfig
    turn: TurnTokens
    co_resident_bytes: int
    weights_bytes: int
    kv: dict[str, KVPlan]
    warnings: list[str] = field(default_factory=list)
    cannot_build: str | None = None  # why the target's TensorRT-LLM cannot build this model (no trtllm-build)
    images: ImageCost | None = None  # a vision-language model's pictures
    audio: AudioCost | None = None  # an audio-language model's speech

    @property
    def target(self) -> Target:
        """The target planned for."""
        return self.request.target

    @property
    def budget_bytes(self) -> int:
        """Memory left for activations and the KV pool (negative when the weights do not fit)."""
        t = self.target
        fixed = int((t.memory_gib - t.os_reserve_gib - t.runtime_overhead_gib) * GIB) - self.co_resident_bytes
        encoders = sum(part.memory_bytes for part in (self.images, self.audio) if part)
        return fixed - self.weights_bytes - encoders

    def refusal(self) -> str | None:
        """Why this plan cannot work, or None."""
        t, req = self.target, self.request
        if why := t.weights_refusal(req.weights) or t.head_refusal(req.head):
            return why
        if req.kv_dtype is not None and req.kv_dtype not in t.kv_dtypes:
            why = t.unsupported_kv.get(req.kv_dtype, f"{t.name} takes KV dtypes {', '.join(t.kv_dtypes)}")
            return f"{req.kv_dtype} KV cache does not work on {t.name}: {why}"
        if self.budget_bytes <= 0:
            return (f"{self.weights_bytes / GIB:.2f} GiB of {req.weights} weights do not fit on {t.name}: "
                    f"{t.memory_gib} GiB less OS {t.os_reserve_gib} GiB, co-resident models "
                    f"{self.co_resident_bytes / GIB:.2f} GiB and runtime {t.runtime_overhead_gib} GiB leaves "
                    f"{(self.budget_bytes + self.weights_bytes) / GIB:.2f} GiB")
        if t.npu and (limit := graph_limit(t)) and npu_weight_bytes(self.config, req.weights) > limit:
            weights = npu_weight_bytes(self.config, req.weights)
            return (f"{weights / GIB:.2f} GiB of {req.weights} weights exceed the {t.npu.graph_memory_gib} GiB one "
                    f"graph may hold on {t.name}'s NPU (graph_memory_gib, an estimate): a model this size needs its "
                    "graphs split across NPU sessions, which cabin-export does not do; choose lighter weights or a "
                    "smaller model")
        if not any(kv.fits for kv in self.kv.values()):
            best = max(self.kv.values(), key=lambda kv: kv.max_kv_tokens)
            return (f"after {self.weights_bytes / GIB:.2f} GiB of weights the KV pool on {t.name} holds "
                    f"{best.max_kv_tokens} tokens ({best.kv_dtype}), fewer than {MIN_TURNS} dialogue turns "
                    f"({self.turn.system + MIN_TURNS * self.turn.per_turn} tokens)")
        return None

    def summary(self) -> str:
        """One line: target, weights, KV dtype(s) and their turns."""
        kvs = ", ".join(f"{kv.kv_dtype} KV {kv.est_turns} turns" for kv in self.kv.values() if kv.fits)
        weights = f" --weights {self.request.weights}" if self.request.weights != "fp16" else ""
        kv_flag = f" --kv-cache {self.request.kv_dtype}" if self.request.kv_dtype else ""
        weights += f" --head {self.request.head}" if self.request.head != "fp16" else ""
        beams = f" --max-beam-width {self.request.max_beam_width}" if self.request.max_beam_width > 1 else ""
        backend = " --backend cuda" if self.target.backend is Backend.CUDA else ""
        return f"--target {self.target.name}{backend}{weights}{kv_flag}{beams} ({kvs})"

    def to_json(self) -> dict:
        """The plan as cabin-plan --json prints it; per-dtype values are keyed by KV dtype."""
        def per(key: str) -> dict:
            return {name: getattr(kv, key) for name, kv in self.kv.items()}

        t = self.target
        plan = {
            "target": t.name,
            "target_profile": t.to_dict(),
            "model": {"source": self.request.model, "architecture": self.config.architecture,
                      "parameters": parameter_count(self.config), "layers": self.config.num_hidden_layers,
                      "kv_heads": self.config.num_key_value_heads, "head_size": self.config.head_size,
                      "context": self.config.max_position_embeddings},
            "weights": self.request.weights,
            "head": self.request.head,
            "weight_formats": weight_choices(self.config, t, self.request.head),
            "max_beam_width": self.request.max_beam_width,
            "weights_bytes": self.weights_bytes,
            "memory_bytes": {"total": int(t.memory_gib * GIB), "os_reserve": int(t.os_reserve_gib * GIB),
                             "co_resident": self.co_resident_bytes,
                             "runtime_overhead": int(t.runtime_overhead_gib * GIB), "weights": self.weights_bytes,
                             "for_activations_and_kv": self.budget_bytes},
            "kv_dtypes": list(self.kv),
            "kv_bytes_per_token": per("bytes_per_token"),
            "kv_window_bytes": per("window_bytes"),
            "activation_bytes": per("activation_bytes"),
            "max_kv_tokens": per("max_kv_tokens"),
            "max_seq_len": per("max_seq_len"),
            "max_input_len": per("max_input_len"),
            "max_num_tokens": per("max_num_tokens"),
            "tokens_per_block": t.tokens_per_block,
            "num_blocks": per("num_blocks"),
            "kv_pool_bytes": per("kv_pool_bytes"),
            "memory_left_bytes": per("memory_left_bytes"),
            "est_turns": per("est_turns"),
            "fits": per("fits"),
            "turn_tokens": self.turn.to_dict(),
            "paged_context_fmha": per("paged_context_fmha"),
            "block_reuse": per("block_reuse"),
            "kv_cache_config": {name: kv.kv_cache_config().to_dict() for name, kv in self.kv.items() if kv.fits},
            "prefill_tokens_per_turn": per("prefill_tokens_per_turn"),
            "trtllm_build_args": per("trtllm_build_args") if t.backend is Backend.TENSORRT else None,
            "warnings": self.warnings,
            "trtllm_cannot_build": self.cannot_build,
            "images": self.images and {
                **self.images.to_dict(),
                "kv_bytes_per_picture": {name: self.images.kv_bytes(kv.bytes_per_token)
                                         for name, kv in self.kv.items()},
                "turns_with_a_picture": {name: self.images.turns(kv.max_seq_len, self.turn)
                                         for name, kv in self.kv.items()}},
            "audio": self.audio and {
                **self.audio.to_dict(),
                "kv_bytes_per_turn_of_speech": {name: self.audio.kv_bytes(kv.bytes_per_token)
                                                for name, kv in self.kv.items()},
                "turns_with_speech": {name: self.audio.turns(kv.max_seq_len, self.turn)
                                      for name, kv in self.kv.items()}},
        }
        if t.backend is Backend.ONNX:
            plan["cabin_export"] = {name: kv.graphs.to_dict() if kv.graphs else None for name, kv in self.kv.items()}
        return plan


def weight_choices(config: ModelConfig, target: Target, head: str = "fp16") -> list[dict]:
    """Every weight format of the registry on this target: whether its runtime takes it (and why not), the bytes it
    would hold and what converting the model to it costs."""
    inputs = {shape[1] for shape in linear_shapes(config).values()}
    choices = []
    for name, fmt in WEIGHT_FORMATS.items():
        holds = not fmt.group_sizes or any(all(i % g == 0 for i in inputs) for g in fmt.group_sizes)
        why = target.weights_refusal(name) or (None if holds else (
            f"no group of {' or '.join(map(str, fmt.group_sizes))} divides the inputs {sorted(inputs)}"))
        choices.append({"weights": name, "taken": why is None, "conversion": fmt.conversion, "why_not": why,
                        "bytes": weights_bytes(config, name, target.weights_in_memory, head) if holds else None})
    return choices


def make_plan(request: PlanRequest, config: ModelConfig, turn: TurnTokens = TYPICAL_TURN) -> Plan:
    """The plan of a model on a target (check ``refusal()`` before building from it)."""
    t = request.target
    co_resident = int((t.co_resident_gib if request.reserve_gb is None else request.reserve_gb) * GIB)
    weights = weights_bytes(config, request.weights, t.weights_in_memory, request.head)
    plan = Plan(request, config, turn, co_resident, weights, {}, images=image_cost(request.model),
                audio=audio_cost(request.model, request.speech_seconds))
    dtypes = [request.kv_dtype] if request.kv_dtype in t.kv_dtypes else list(t.kv_dtypes)
    pictures = sum(part.request_tokens for part in (plan.images, plan.audio) if part)
    plan.kv = {dtype: size_kv(config, t, dtype, plan.budget_bytes, turn, request.weights, request.max_beam_width,
                              pictures) for dtype in dtypes}
    plan.warnings = plan_warnings(plan)
    why = cannot_build(config, t.trtllm_line) if t.backend is Backend.TENSORRT and t.trtllm_line else None
    if why:
        plan.cannot_build = (f"TensorRT-LLM {t.trtllm_line} on {t.name} cannot build {config.architecture}: {why}; "
                             f"{cuda_instead(request, config, turn)}{ONNX_INSTEAD}")
        plan.warnings.insert(0, plan.cannot_build)
        for kv in plan.kv.values():
            kv.trtllm_build_args = None
    return plan


def cuda_instead(request: PlanRequest, config: ModelConfig, turn: TurnTokens) -> str:
    """The CUDA runner's plan of the same request in a few words (``cabin-plan --backend cuda``), where the target
    has one."""
    if request.target.cuda_overhead_gib is None:
        return ""
    cuda = make_plan(replace(request, target=request.target.on_cuda(), kv_dtype=None), config, turn)
    if cuda.refusal():
        return f"the CUDA runner cannot hold it either ({cuda.refusal()}); "
    return (f"the CUDA runner runs it (cabin-plan --backend cuda, then cabin-chat --device cuda): "
            f"{cuda.request.weights} weights {cuda.weights_bytes / GIB:.2f} GiB, "
            + ", ".join(f"{kv.kv_dtype} KV pool {kv.kv_pool_bytes / MIB:,.0f} MiB for {kv.max_seq_len:,} tokens "
                        f"({kv.est_turns} turns, block reuse)" for kv in cuda.kv.values() if kv.fits) + "; ")


def working_plan(request: PlanRequest, config: ModelConfig) -> Plan:
    """The plan of a request; ConfigError for a beam width the target takes no build limit for; PlanRefused (with
    the nearest working plan) when it cannot work."""
    check_beam_width(request)
    plan = make_plan(request, config)
    reason = plan.refusal()
    if reason:
        raise PlanRefused(reason, nearest_working(request, config, load_targets()))
    return plan


def check_beam_width(request: PlanRequest) -> None:
    """ConfigError unless the beam width is >= 1, and 1 on a target that is not a TensorRT engine."""
    t, width = request.target, request.max_beam_width
    if width < 1:
        raise ConfigError(f"--max-beam-width must be >= 1, got {width}")
    if width > 1 and t.backend is not Backend.TENSORRT:
        raise ConfigError(f"--max-beam-width sizes a TensorRT engine's beam search (trtllm-build --max_beam_width); "
                          f"{t.name} runs the {t.backend.value} backend, which has no such build limit: leave "
                          "--max-beam-width out")


def size_kv(config: ModelConfig, target: Target, kv_dtype: str, budget: int, turn: TurnTokens,
            weights: str = "fp16", beams: int = 1, pictures: int = 0) -> KVPlan:
    """Engine limits for one KV dtype within ``budget`` bytes for activations and the KV pool (``weights``: the
    weight format, which an ONNX target's NPU graphs hold; ``beams``: the TensorRT engine's max_beam_width;
    ``pictures``: the most image or audio rows one request may hold, a vision- or audio-language model's)."""
    if target.backend is Backend.ONNX:
        return size_onnx(config, target, kv_dtype, budget, turn, weights)
    tpb = target.tokens_per_block
    per_token = kv_bytes_per_token(config, kv_dtype, tpb)
    paged_fmha = not (target.backend is Backend.TENSORRT and not kv_mode(kv_dtype).trtllm_paged_context_fmha)
    chunked = target.backend in (Backend.TENSORRT, Backend.CUDA) and paged_fmha
    context = config.max_position_embeddings

    def limits(seq: int) -> tuple[int, int, int]:
        """max_input_len, max_num_tokens and activation bytes (the logits of every beam) of an engine with this
        max_seq_len."""
        max_input = seq - min(REPLY_TOKENS, seq // 2)
        num_tokens = min(max_input, CHUNK_TOKENS) if chunked else max_input
        return max_input, num_tokens, activation_bytes(config, num_tokens, seq, MAX_BATCH_SIZE * beams,
                                                       target.backend)

    def pool_blocks(seq: int) -> int:
        """The pool's blocks: a sequence of max_seq_len per request, or with beams the most any search over a prompt
        of at most max_input_len reserves."""
        max_input = limits(seq)[0]
        return beam_kv_blocks_up_to(max_input, seq - max_input, beams, tpb) * MAX_BATCH_SIZE

    def window(seq: int) -> int:
        """The sliding-window layers' bytes of every sequence (each beam its own) at this max_seq_len."""
        return kv_window_bytes(config, kv_dtype, tpb, seq) * MAX_BATCH_SIZE * beams

    def fits_in_budget(seq: int) -> bool:
        return limits(seq)[2] + pool_blocks(seq) * tpb * per_token + window(seq) <= budget

    if fits_in_budget(context):
        seq = context
    else:  # the longest max_seq_len, in whole blocks, whose activations and pool fit (both grow with it)
        low, high = 0, context // tpb
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits_in_budget(middle * tpb) else (low, middle - 1)
        seq = low * tpb
    max_input, num_tokens, activations = limits(seq)
    capacity = max(budget - activations - window(seq), 0) // per_token
    num_blocks = pool_blocks(seq)
    pool = num_blocks * tpb * per_token + window(seq)
    turns = max((seq - turn.system) // turn.per_turn, 0)
    fits = turns >= MIN_TURNS
    multimodal = min(pictures, max_input) * MAX_BATCH_SIZE
    shape = EngineShape(kv_dtype, "float16", tpb, MAX_BATCH_SIZE, max_input, seq, num_tokens, beams, multimodal)
    return KVPlan(
        kv_dtype=kv_dtype, bytes_per_token=per_token, paged_context_fmha=paged_fmha, block_reuse=paged_fmha,
        activation_bytes=activations, max_kv_tokens=capacity, max_seq_len=seq, max_input_len=max_input,
        max_num_tokens=num_tokens, tokens_per_block=tpb, num_blocks=num_blocks, kv_pool_bytes=pool,
        memory_left_bytes=budget - activations - pool, est_turns=turns,
        prefill_tokens_per_turn=prefill_per_turn(turn, turns, tpb, paged_fmha),
        trtllm_build_args=build_args(shape, flag_set(target.trtllm_line)) if target.trtllm_line and fits else None,
        fits=fits, max_beam_width=beams, window_bytes=window(seq), max_multimodal_len=multimodal,
    )


def size_onnx(config: ModelConfig, target: Target, kv_dtype: str, budget: int, turn: TurnTokens,
              weights: str) -> KVPlan:
    """The graphs' window and chunk for one KV dtype on an ONNX target (cabinllm.builders.graph_plan), as KV limits."""
    tpb = target.tokens_per_block
    per_token = kv_bytes_per_token(config, kv_dtype, tpb)
    graphs = size_graphs(config, target, kv_dtype, budget, weights)
    seq, chunk = (graphs.context, graphs.chunk) if graphs else (0, 0)
    turns = max((seq - turn.system) // turn.per_turn, 0)
    fits = graphs is not None and turns >= MIN_TURNS
    return KVPlan(
        kv_dtype=kv_dtype, bytes_per_token=per_token, paged_context_fmha=True, block_reuse=True,
        activation_bytes=graphs.activation_bytes if graphs else 0,
        max_kv_tokens=tokens_held(graphs, budget, per_token) if graphs else 0, max_seq_len=seq,
        max_input_len=seq - min(REPLY_TOKENS, seq // 2), max_num_tokens=chunk, tokens_per_block=tpb,
        num_blocks=cdiv(seq, tpb), kv_pool_bytes=graphs.cache_bytes if graphs else 0,
        memory_left_bytes=budget - (graphs.total_bytes if graphs else 0), est_turns=turns,
        prefill_tokens_per_turn=prefill_per_turn(turn, turns, tpb, True), trtllm_build_args=None, fits=fits,
        graphs=graphs if fits else None,
    )


def prefill_per_turn(turn: TurnTokens, turns: int, tokens_per_block: int, reuse: bool) -> dict:
    """Tokens prefilled per turn over a dialogue of ``turns`` turns.

    With block reuse a turn prefills its new user message plus, on average, half a
    block (reuse matches whole blocks only); without it, the whole history again.
    """
    with_reuse = turn.user + tokens_per_block // 2
    history_mean = turn.system + turn.user + turn.per_turn * max(turns - 1, 0) // 2
    history_last = turn.system + turn.user + turn.per_turn * max(turns - 1, 0)
    return {"mean": with_reuse if reuse else history_mean, "last": with_reuse if reuse else history_last,
            "with_block_reuse": with_reuse}


def plan_warnings(plan: Plan) -> list[str]:
    """The known conflicts and costs of this plan, stated with numbers."""
    t, out = plan.target, []
    if t.backend is Backend.ONNX:
        return onnx_warnings(plan)
    if t.weights_in_memory:
        kept = "" if plan.request.weights == "fp16" else f" (the {plan.request.weights} linear layers stay quantized)"
        out.append(f"the {t.name} runtime holds float weights in {t.weights_in_memory}{kept}: "
                   f"{plan.weights_bytes / GIB:.2f} GiB counted")
    if plan.config.tie_word_embeddings:
        lm_head = plan.config.vocab_size * plan.config.hidden_size * (4 if t.weights_in_memory else 2)
        out.append(f"lm_head is tied to the embedding; the checkpoint keeps its own copy ({lm_head / MIB:.0f} MiB, "
                   "counted)")
    for kv in plan.kv.values():
        if not kv.fits:
            out.append(f"{kv.kv_dtype} KV: the pool holds {kv.max_kv_tokens} tokens, {kv.est_turns} turns: "
                       f"fewer than {MIN_TURNS}, not usable")
            continue
        if t.backend is Backend.TENSORRT and kv.max_beam_width > 1:
            single = cdiv(kv.max_seq_len * MAX_BATCH_SIZE, kv.tokens_per_block)
            out.append(f"{kv.kv_dtype} KV with {kv.max_beam_width} beams: the pool holds a search over any prompt of "
                       f"up to max_input_len ({kv.max_input_len}) tokens, its whole blocks once, shared by the beams, "
                       f"and each beam's own last block and {kv.max_seq_len - kv.max_input_len}-token reply: "
                       f"{kv.num_blocks} blocks instead of {single} for one sequence (TensorRT-LLM reserves a "
                       "request's blocks to completion)")
        if t.backend is Backend.TENSORRT and not kv.paged_context_fmha:
            reuse = kv.prefill_tokens_per_turn
            chunked = activation_bytes(plan.config, min(kv.max_input_len, CHUNK_TOKENS), kv.max_seq_len,
                                       MAX_BATCH_SIZE, t.backend)
            out.append(
                f"{kv.kv_dtype} KV on TensorRT-LLM cannot use paged context FMHA, so the engine has no KV block "
                f"reuse and no chunked prefill: each turn re-prefills the whole history, {reuse['mean']} tokens "
                f"per turn on average over {kv.est_turns} turns ({reuse['last']} at the last) instead of about "
                f"{reuse['with_block_reuse']} with reuse; max_num_tokens must cover the whole prompt "
                f"({kv.max_num_tokens}), {kv.activation_bytes / MIB:.0f} MiB of activations instead of "
                f"{chunked / MIB:.0f} MiB")
    capped = [kv for kv in plan.kv.values() if kv.fits and kv.max_kv_tokens > plan.config.max_position_embeddings]
    if capped:
        held = ", ".join(f"{kv.max_kv_tokens:,} ({kv.kv_dtype}, {kv.memory_left_bytes / GIB:.2f} GiB left)"
                         for kv in capped)
        out.append(f"the model's context ({plan.config.max_position_embeddings:,} tokens) caps max_seq_len, not "
                   f"memory: it could hold {held}; a longer dialogue needs the overflow policy (sliding window "
                   "+ sink tokens), and the memory left is free for other models")
    if t.backend is Backend.CUDA:
        out.append("the CUDA runner keeps the paged cache with block reuse and chunked prefill in every KV dtype, "
                   "INT8 included (TensorRT-LLM 0.12 reuses no blocks with INT8 KV); its runtime overhead is an "
                   "estimate (cuda_overhead_gib) until scripts/gpu_check.sh has measured a board")
    if t.backend is Backend.TENSORRT:
        pool = "max_seq_len" if plan.request.max_beam_width == 1 else "KV blocks x tokens_per_block"
        out.append(f"size the runtime KV pool with KvCacheConfig(max_tokens={pool}): the default "
                   "free_gpu_memory_fraction=0.9 takes 90% of free unified memory, including what the "
                   "co-resident models need")
    return out


def onnx_warnings(plan: Plan) -> list[str]:
    """What an ONNX target's plan counts and what it costs, with numbers."""
    t, config, out = plan.target, plan.config, []
    weights = plan.request.weights
    carried = "fp32 weights" if weights == "fp16" else f"{weights} linear layers and fp32 other weights"
    out.append(f"the graphs carry {carried} (weights.bin, {plan.weights_bytes / GIB:.2f} GiB, counted)"
               + (f"; {t.name}'s NPU holds its own copy, one for both graphs "
                  f"({npu_weight_bytes(config, weights) / GIB:.2f} GiB, not counted: measure it)" if t.npu.float16
                  else ""))
    out.append(f"{t.name}'s NPU is Hexagon HTP v{t.npu.htp_arch}: it runs {' or '.join(t.npu.precisions)} graphs"
               + ("" if t.npu.float16 else " only (no floating point)") + "; cabin-export quantizes A16W8 graphs "
               "with ONNX Runtime's QNN tooling and compiles both graphs into one QNN context binary for it (the "
               "weights stored once)")
    out.append("what each precision costs, measured on the HTP emulator: "
               + "; ".join(t.npu.cost(p) for p in t.npu.precisions))
    fitting = [kv for kv in plan.kv.values() if kv.graphs]
    for kv in plan.kv.values():
        if not kv.fits:
            out.append(f"{kv.kv_dtype} KV: the graphs' window holds {kv.max_seq_len} tokens, {kv.est_turns} "
                       f"turns: fewer than {MIN_TURNS}, not usable")
    if fitting:
        held = ", ".join(f"{kv.graphs.cache_bytes / MIB:,.0f} MiB ({kv.kv_dtype})" for kv in fitting)
        out.append(f"the runtime's paged cache keeps the dialogue in host memory beside the graphs' window: {held} "
                   "for the planned window, counted (cabin-chat --kv-budget-mb)")
        window = max(kv.graphs.context for kv in fitting)
        out.append(f"the token graph attends over all {window:,} window slots at every step (static shapes): "
                   "decode time follows --context, not the dialogue's length; a smaller --context decodes faster")
    capped = [kv for kv in fitting if kv.max_kv_tokens > config.max_position_embeddings]
    if capped:
        held = ", ".join(f"{kv.max_kv_tokens:,} ({kv.kv_dtype})" for kv in capped)
        out.append(f"the model's context ({config.max_position_embeddings:,} tokens) caps --context, not memory: "
                   f"it could hold {held}; a longer dialogue needs the overflow policy")
    return out


def nearest_working(request: PlanRequest, config: ModelConfig, targets: dict[str, Target],
                    weight_formats: tuple[str, ...] = tuple(WEIGHT_FORMATS),
                    turn: TurnTokens = TYPICAL_TURN) -> Plan | None:
    """The closest plan that works: the fp16 head here (where an int8 one is refused), another KV dtype here,
    lighter weights here, then larger targets.

    ``weight_formats`` limits the weights tried.
    """
    here = request.target
    lighter = [w for w in weight_formats if w in here.weight_formats]
    # lighter weights than asked; weights the target lacks: the lightest it has first
    lighter = lighter[lighter.index(request.weights) + 1:] if request.weights in lighter else lighter[::-1]
    kv_here = request.kv_dtype if request.kv_dtype in here.kv_dtypes else None
    if request.kv_dtype and kv_here is None:  # the same-size dtype this target has (fp8 <-> int8), else the smallest
        kv_here = min(here.kv_dtypes, key=lambda d: (kv_bytes_per_token(config, d, here.tokens_per_block),
                                                   d != "int8"))
    candidates = [replace(request, kv_dtype=kv_here)]
    if here.head_refusal(request.head):  # an int8 head off the reference engine: the fp16 one here first
        candidates.insert(0, replace(request, kv_dtype=kv_here, head="fp16"))
    candidates += [replace(request, weights=w, kv_dtype=kv_here) for w in lighter]
    onnx = here.backend is Backend.ONNX  # graphs for an NPU, or an engine: the nearest config stays on its side
    larger = sorted((t for t in targets.values() if t.memory_gib > here.memory_gib
                     and (t.backend is Backend.ONNX) == onnx), key=lambda t: t.memory_gib)
    if here.backend is Backend.CUDA:  # the same runner on a larger board
        larger = [t.on_cuda() for t in larger if t.cuda_overhead_gib is not None]
    for target in larger:
        for weights in dict.fromkeys([request.weights, *weight_formats]):
            kv = request.kv_dtype if request.kv_dtype in target.kv_dtypes else None
            candidates.append(replace(request, target=target, weights=weights, kv_dtype=kv))
    for candidate in candidates:
        if candidate.max_beam_width > 1 and candidate.target.backend is not Backend.TENSORRT:
            continue  # check_beam_width refuses it
        try:
            plan = make_plan(candidate, config, turn)
        except ConfigError:  # weights that cannot hold this model (no group size divides its inputs)
            continue
        if plan.refusal() is None:
            return plan
    return None

