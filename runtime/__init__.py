"""CabinLLM's runtime: a dialogue on a paged, quantized KV cache under a fixed budget, on any backend.

The face of the package; the rooms below it, in import order: ``errors``, ``kernels`` (C decode kernels),
``formats`` (what is on disk), ``kv`` (modes, storage, blocks, the paged cache), ``model`` (the model-runner
interface, the reference forward pass, its linear ops, RoPE, tokenizer), ``generation`` (sampling, stop rules,
grammars, beam search state), ``sources`` (where a model comes from), ``engine`` (the loaded engine and the engine
core: requests, scheduler, step), ``dialogue`` (sessions, overflow, session files) and ``backends``.

    from cabinllm.runtime import KvCacheConfig, SessionRequest, open_session
    session = open_session(SessionRequest(Path("engines/smollm2-135m-int8-eq"), KvCacheConfig(max_bytes=32 << 20)))
    print(session.chat("Where is the nearest charging station?").reply)
"""
from cabinllm.runtime.backends.select import SessionRequest, open_session
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import CabinError
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.model import families  # noqa: F401 (registers each family's checkpoint architecture)

__all__ = ["CabinError", "DialogueSession", "Engine", "KvCacheConfig", "OverflowPolicy", "SamplingParams",
           "SessionRequest", "open_session"]
