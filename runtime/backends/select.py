"""Which backend opens a dialogue session on a folder, and opening it: the reference engine (PyTorch), TensorRT-LLM
(an engine folder's ``trt_engine/``) or ONNX Runtime (a cabin-export graph folder), from plain settings (no argparse).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from cabinllm.runtime.backends.onnxruntime import load_onnx_engine
from cabinllm.runtime.backends.trtllm import TRTLLM_NO_GRAMMAR, TrtllmSession
from cabinllm.runtime.dialogue.interface import Session
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine, kv_cache_config
from cabinllm.runtime.errors import CheckpointError, ConfigError, Fix, Hint
from cabinllm.runtime.formats.engine_folder import EngineFolder, read_manifest
from cabinllm.runtime.formats.onnx_folder import ONNX_FORMAT
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.tools import Tool
from cabinllm.runtime.model.audio import AUDIO_FOLDER, AudioEncoder
from cabinllm.runtime.model.vision import VISION_FOLDER, ImageLimits, Vision
from cabinllm.runtime.speech.asr import AsrConfig
from cabinllm.runtime.speech.audio import AudioLimits


@dataclass(frozen=True)
class SessionRequest:
    """What a front end asks for: the folder, the backend, the KV cache, sampling, overflow and the conversation."""

    engine: Path  # engine folder (cabin-build) or graph folder (cabin-export)
    kv_cache: KvCacheConfig = KvCacheConfig()  # this conversation's; its mode and block size unset: the engine's
    params: SamplingParams = field(default_factory=SamplingParams)  # stop ids: the engine's own, always
    system: str | None = None  # system prompt (None: no system message)
    overflow: OverflowPolicy = field(default_factory=OverflowPolicy)
    backend: str = "auto"  # a key of BACKENDS, or auto: by the folder
    ort_provider: str = "cpu"  # ONNX Runtime's execution provider (backends.onnxruntime.ORT_PROVIDERS)
    htp_arch: int | None = None  # ort_provider qnn: this device's HTP architecture (None: the graphs' own)
    restore: Path | None = None  # a session file to continue (reference and onnxruntime backends)
    tools: tuple[Tool, ...] = ()  # functions the replies may call (reference and onnxruntime backends)
    tool_choice: str = "auto"  # how: auto, required, none or one tool's name
    max_sequences: int = 1  # sequences a turn runs at once (choices, beams): the windows a sliding-window model keeps
    image_limits: ImageLimits = field(default_factory=ImageLimits)  # a vision-language engine's caps on pictures
    device: str = "cpu"  # where the reference backend's model runs (cuda: the CUDA runner)
    asr: AsrConfig = AsrConfig()  # the speech front end that hears the user's clips on a text engine
    audio_limits: AudioLimits = field(default_factory=AudioLimits)  # caps on the clips one message may send

    def __post_init__(self) -> None:
        """Folders given as text become paths."""
        object.__setattr__(self, "engine", Path(self.engine))
        if self.restore is not None:
            object.__setattr__(self, "restore", Path(self.restore))


def open_session(request: SessionRequest) -> Session:
    """Load the folder and start (or restore) a session on the chosen backend."""
    backend = choose_backend(request.engine, request.backend)
    if request.device != "cpu" and backend != "reference":
        raise ConfigError(f"device {request.device} runs the reference backend's model on the CUDA runner; the "
                          f"{backend} backend chooses its own device", (Hint(Fix.BACKEND, "reference"),))
    return BACKENDS[backend](request)


def choose_backend(engine: Path, backend: str = "auto") -> str:
    """The backend to run: the one asked for, or for auto the folder's kind (an ONNX export, a TensorRT engine where
    tensorrt_llm is installed, else the reference engine)."""
    if backend != "auto":
        if backend not in BACKENDS:
            raise ConfigError(f"unknown backend {backend!r}; choose auto or one of {', '.join(BACKENDS)}")
        return backend
    if (read_manifest(engine) or {}).get("format") == ONNX_FORMAT:
        return "onnxruntime"
    trt_engine = EngineFolder(engine).trt_engine
    return "tensorrt-llm" if trt_engine.is_dir() and importlib.util.find_spec("tensorrt_llm") else "reference"


def _open_reference(request: SessionRequest) -> Session:
    engine = Engine.load(request.engine, request.device)
    if engine.vision is not None:
        engine.vision.limits = request.image_limits
    return _open_dialogue(request, engine)


def _open_onnxruntime(request: SessionRequest) -> Session:
    if request.htp_arch is not None and request.ort_provider != "qnn":
        raise ConfigError(f"htp_arch names the HTP of ort_provider qnn, not {request.ort_provider}; leave htp_arch "
                          "out", (Hint(Fix.ORT_PROVIDER, "qnn"),))
    engine = load_onnx_engine(request.engine, request.ort_provider, htp_arch=request.htp_arch)
    asked = request.kv_cache.kv_mode
    if asked not in (None, engine.default_kv_mode):
        raise ConfigError(f"kv_mode {asked}: the graphs in {request.engine} take {engine.default_kv_mode} K/V",
                          (Hint(Fix.GRAPHS_KV_MODE, asked),))
    return _open_dialogue(request, engine)


def _open_dialogue(request: SessionRequest, engine: Engine) -> DialogueSession:
    """A session on our paged cache (restored when asked) for an engine whose model runs anywhere."""
    cache = engine.new_cache(request.kv_cache, request.max_sequences)
    if request.restore:
        return DialogueSession.restore(request.restore, engine, cache, request.asr, request.audio_limits)
    params = dataclasses.replace(request.params, stop_token_ids=engine.stop_token_ids())
    return DialogueSession(engine, cache, params, request.system, request.overflow, list(request.tools),
                           request.tool_choice, request.asr, request.audio_limits)


def _open_trtllm(request: SessionRequest) -> TrtllmSession:
    if request.tools:
        raise ConfigError(*TRTLLM_NO_GRAMMAR)
    folder = EngineFolder(request.engine)
    if not folder.trt_engine.is_dir():
        raise CheckpointError(f"{folder.trt_engine}: no TensorRT engine; run the engine build on the device")
    tokenizer = ChatTokenizer(folder.checkpoint)
    config = kv_cache_config(folder.manifest(), request.kv_cache)
    params = dataclasses.replace(request.params, stop_token_ids=tokenizer.stop_token_ids)
    vision, audio, model_config = folder.path / VISION_FOLDER, folder.path / AUDIO_FOLDER, folder.config()
    return TrtllmSession(folder.path, tokenizer, KVLayout.of(model_config), config, params, request.system,
                         request.overflow, Vision(vision, request.image_limits) if vision.is_dir() else None,
                         model_config.vocab_size, AudioEncoder(audio) if audio.is_dir() else None, request.asr,
                         request.audio_limits)


BACKENDS: dict[str, Callable[[SessionRequest], Session]] = {
    "reference": _open_reference, "tensorrt-llm": _open_trtllm, "onnxruntime": _open_onnxruntime}
