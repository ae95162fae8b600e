"""The ONNX Runtime backend: the exported static graphs (runtime.formats.onnx_folder) run by ONNX Runtime, while
our paged KV cache holds the dialogue.

``OrtModel`` has the reference model's ``forward`` (tokens at positions [start, start + N) of a sequence
whose slots are allocated): new tokens go through the prompt graph in chunks of ``chunk`` (the last one
padded and masked), a single token through the token graph. The graphs see a fixed window of ``context``
past tokens; the host keeps that window as one array per layer and per K/V, filled from the cache's blocks
whenever it does not hold the sequence's first ``start`` tokens (a new turn after eviction, another
sequence) and else only extended by the rows each step returns, which are also written into the cache's
blocks in its own storage form (int8 codes with the same static scales). So the dialogue machinery of the
reference engine (``cabinllm.runtime.dialogue.session.DialogueSession``: reuse of earlier turns, block hashes, budget,
overflow policies, session files) runs unchanged on it; the context it plans against is the graphs'
``context``. ``logits_over`` scores a cached sequence token by token over the K/V another backend stored, so
two backends can be compared on the same INT8 codes. Graphs of the npu profile take the embedding and RoPE rows,
which the host looks up (``HostInputs``); on the ``qnn`` provider they run on Qualcomm's HTP from their
context binaries (cabinllm.runtime.backends.qnn). onnxruntime is imported only here, only when used.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from cabinllm.runtime.backends.qnn import context_session
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import CheckpointError, ConfigError, Fix, Hint, ImageError, MissingDependency
from cabinllm.runtime.formats.onnx_folder import (EXPORT_AGAIN, INPUTS_EMBEDS, LOCAL_MASK, LOCAL_ROPE_INPUTS,
                                                  PROMPT_GRAPH, ROPE_INPUTS, TOKEN_GRAPH, OnnxFolder, new_key,
                                                  new_value, past_key, past_value)
from cabinllm.runtime.kv.blocks import MediaSpan, Sequence
from cabinllm.runtime.kv.cache import PagedKVCache
from cabinllm.runtime.kv.storage import KVLayout, gather
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.interface import MediaTable, Span

_UINT8_ZERO_POINT = 128  # int8 codes passed as uint8
# provider name (SessionRequest.ort_provider) -> ONNX Runtime execution provider
ORT_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
                 "tensorrt": "TensorrtExecutionProvider", "qnn": "QNNExecutionProvider"}


class _Graph:
    """One loaded graph: its session, its token count and the mask block of its new tokens."""

    def __init__(self, session, tokens: int, layers: int, masked: float) -> None:
        self.session, self.tokens = session, tokens
        self.outputs = ["logits"] + [name for i in range(layers) for name in (new_key(i), new_value(i))]
        self.causal = np.triu(np.full((tokens, tokens), masked, dtype=np.float32), k=1)


class HostInputs:
    """What the host looks up for graphs that gather nothing (npu profile): embedding rows, RoPE rows, the
    sliding-window layers' mask."""

    def __init__(self, folder: OnnxFolder, config) -> None:
        self.embedding = folder.host_table("embedding")
        self.multiplier = np.float32(config.embedding_multiplier)
        self.ropes = {name: folder.host_table(name) for name in ROPE_INPUTS}
        if config.rope_local_base_freq is not None:
            self.ropes.update({name: folder.host_table(name) for name in LOCAL_ROPE_INPUTS})
        self.window = config.sliding_window

    def feeds(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, context: int, masked: float) -> dict:
        """The graph inputs of token ids at positions (both [1, T]) beside the mask."""
        embeds = self.embedding[ids[0]][None]
        feeds = {INPUTS_EMBEDS: embeds * self.multiplier if self.multiplier != 1 else np.ascontiguousarray(embeds)}
        feeds.update({name: table[positions[0]][None, :, None, :] for name, table in self.ropes.items()})
        if self.window is not None:  # the window's slot j holds position j, the new tokens are at their positions
            keys = np.concatenate([np.arange(context), positions[0]])
            outside = positions[0][:, None] - keys[None, :] >= self.window
            feeds[LOCAL_MASK] = np.where(outside, mask + np.float32(masked), mask).astype(np.float32)
        return feeds


class OrtModel:
    """The prompt and token graphs of an export: a ``ModelRunner`` of one sequence at a time."""

    batched = False

    def __init__(self, folder: OnnxFolder, manifest: dict, provider: str = "cpu", threads: int | None = None,
                 htp_arch: int | None = None) -> None:
        config = folder.config(manifest)
        self.context, self.chunk = int(manifest["context"]), int(manifest["chunk"])
        self.config = replace(config, max_position_embeddings=min(config.max_position_embeddings, self.context))
        self.kv = folder.kv_graph(manifest)
        self.kv_dtype = np.dtype(self.kv.dtype)
        if self.kv.zero_point not in (None, 0, _UINT8_ZERO_POINT):
            raise CheckpointError(f"{folder.path}: KV zero point {self.kv.zero_point}; the runtime passes int8 codes as "
                                  f"int8 (zero point 0) or uint8 (zero point {_UINT8_ZERO_POINT}); {EXPORT_AGAIN}")
        layers, self.masked = config.num_hidden_layers, float(manifest["attention_mask_value"])
        self.host = HostInputs(folder, config) if manifest["host_inputs"] else None
        self.graphs = {tokens: _Graph(_session(folder, manifest, name, provider, threads, htp_arch), tokens, layers,
                                      self.masked)
                       for name, tokens in ((PROMPT_GRAPH, self.chunk), (TOKEN_GRAPH, 1))}
        heads, d = config.num_key_value_heads, config.head_size
        self.window = [np.zeros(shape, self.kv_dtype) for _ in range(layers)  # K0, V0, K1, V1, ...
                       for shape in ((1, heads, d, self.context), (1, heads, self.context, d))]
        self.window_tokens: list[int] = []  # the tokens whose K/V the window holds, from position 0
        self.window_cache: PagedKVCache | None = None
        self.prefix = folder.prefix(manifest)

    @property
    def kv_layout(self) -> KVLayout:
        """Shape of this model's KV cache."""
        return KVLayout.of(self.config)

    def step(self, spans: list[Span], cache: PagedKVCache, all_logits: bool = False,
             media: MediaTable | None = None) -> torch.Tensor:
        """``forward`` of each span in turn (the graphs hold one sequence's window): logits of each span's last
        token (spans, vocab), or of every token."""
        logits = [self.forward(s.token_ids, s.start_pos, cache, s.seq, all_logits, media) for s in spans]
        return torch.cat(logits) if all_logits else torch.stack(logits)

    def forward(self, token_ids: list[int], start_pos: int, cache: PagedKVCache, seq: Sequence,
                all_logits: bool = False, media: MediaTable | None = None) -> torch.Tensor:
        """Run tokens at positions [start_pos, start_pos + N) of a sequence whose slots are allocated (``media``:
        the rows of the pictures among them, by digest); writes their K/V into the cache and returns logits of the
        last token (vocab,) or of every token (N, vocab)."""
        end = start_pos + len(token_ids)
        if end > self.context:  # the session plans against config.max_position_embeddings = context
            raise ConfigError(f"position {end} exceeds the graphs' KV window of {self.context} tokens")
        pictures = [span for span in seq.media if span.start < end and span.end > start_pos]
        self._fill_window(cache, seq, start_pos)
        stored = self.prefix.covers(token_ids, start_pos) if self.prefix else 0
        logits = [self._put_prefix(cache, seq, stored)] if stored else []
        graph = self.graphs[1 if len(token_ids) - stored == 1 else self.chunk]
        logits += [self._run(graph, token_ids[i:i + graph.tokens], start_pos + i, cache, seq,
                             _picture_rows(pictures, media or {}, start_pos + i, graph.tokens))
                   for i in range(stored, len(token_ids), graph.tokens)]
        return torch.cat(logits) if all_logits else logits[-1][-1]

    def _put_prefix(self, cache: PagedKVCache, seq: Sequence, n: int) -> torch.Tensor:
        """The stored prefix's first ``n`` tokens into the cache (in its own form) and the window; their logits."""
        cache.storage.prepare(seq, 0, n)
        slots = cache.slots(seq, 0, n)
        for layer in range(self.config.num_hidden_layers):
            cache.storage.write(layer, slots, torch.from_numpy(self.prefix.keys[layer, :n]),
                                torch.from_numpy(self.prefix.values[layer, :n]))
        self.window_cache = None
        self._fill_window(cache, seq, n)
        return torch.from_numpy(self.prefix.logits[:n])

    def _fill_window(self, cache: PagedKVCache, seq: Sequence, start: int) -> None:
        """Make the window hold the K/V of the sequence's first ``start`` tokens, from the cache's blocks unless it
        holds them already."""
        if cache is self.window_cache and self.window_tokens[:start] == seq.token_ids[:start] \
                and len(self.window_tokens) >= start:
            return
        block_table, tpb = cache.block_table(seq), cache.tokens_per_block
        for layer in range(self.config.num_hidden_layers):
            first = cache.storage.kept_from(layer, start)  # a local layer's older K/V: masked by its graph
            table = block_table[first // tpb:]
            stored = cache.storage.stored_kv(layer, table, start - first)
            k, v = (self._to_graph(gather(pool, stored.block_table, start - first).numpy())
                    for pool in (stored.k, stored.v))
            self._set_window(layer, first, k, v)
        self.window_cache, self.window_tokens = cache, list(seq.token_ids[:start])

    def logits_over(self, cache: PagedKVCache, seq: Sequence) -> torch.Tensor:
        """Logits (N, vocab) of each of a cached sequence's N tokens, each from the token graph over the cache's
        stored K/V of the tokens before it, whoever wrote them; nothing is written back."""
        if len(seq) > self.context:
            raise ConfigError(f"{len(seq)} tokens exceed the graphs' KV window of {self.context} tokens")
        self._fill_window(cache, seq, len(seq))
        graph, stored = self.graphs[1], self.prefix.covers(seq.token_ids, 0) if self.prefix else 0
        head = [torch.from_numpy(self.prefix.logits[:stored])] if stored else []
        return torch.cat(head + [self._call(graph, [token], position)[0]
                                 for position, token in enumerate(seq.token_ids) if position >= stored])

    def _call(self, graph: _Graph, piece: list[int], start: int,
              rows: dict[int, np.ndarray] | None = None) -> tuple[torch.Tensor, list[np.ndarray]]:
        """One graph call for up to ``graph.tokens`` tokens at ``start`` over the window's first ``start`` tokens
        (``rows``: input rows by position, a picture's, in place of the embedding's); their logits (n, vocab) and
        the new K/V outputs (each for ``graph.tokens`` rows)."""
        n, tokens = len(piece), graph.tokens
        # rows past the piece repeat its last token, position and mask row: discarded, and like the rows before them
        # (a token 0 at position 0 that sees nothing before it is a conversation's first token, whose massive
        # activation would stretch every calibrated range)
        ids, positions = np.full((1, tokens), piece[-1], np.int64), np.full((1, tokens), start + n - 1, np.int64)
        ids[0, :n], positions[0, :n] = piece, np.arange(start, start + n)
        mask = np.full((1, 1, tokens, self.context + tokens), self.masked, np.float32)
        mask[0, 0, :, :start] = 0.0
        mask[0, 0, :, self.context:] = graph.causal
        mask[0, 0, n:] = mask[0, 0, n - 1]
        if self.host is None:
            feeds = {"input_ids": ids, "position_ids": positions, "attention_mask": mask}
        else:
            feeds = {**self.host.feeds(ids, positions, mask, self.context, self.masked), "attention_mask": mask}
            for position, row in (rows or {}).items():
                feeds[INPUTS_EMBEDS][0, position - start] = row
        for layer in range(self.config.num_hidden_layers):
            feeds[past_key(layer)], feeds[past_value(layer)] = self.window[2 * layer], self.window[2 * layer + 1]
        logits, *kv = graph.session.run(graph.outputs, feeds)
        return torch.from_numpy(logits[0, :n]), kv

    def _run(self, graph: _Graph, piece: list[int], start: int, cache: PagedKVCache, seq: Sequence,
             rows: dict[int, np.ndarray]) -> torch.Tensor:
        """One graph call for up to ``graph.tokens`` tokens at ``start`` (``rows``: pictures' input rows by position),
        their K/V stored in the window and the cache; their logits (n, vocab)."""
        n = len(piece)
        logits, kv = self._call(graph, piece, start, rows)
        cache.storage.prepare(seq, start, start + n)
        slots = cache.slots(seq, start, start + n)
        for layer in range(self.config.num_hidden_layers):
            k, v = kv[2 * layer][0, :n], kv[2 * layer + 1][0, :n]
            self._set_window(layer, start, k, v)
            cache.storage.write_stored(layer, slots, self._to_cache(k), self._to_cache(v))
        self.window_tokens[start:] = piece
        return logits

    def _set_window(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Put K/V rows (tokens, kv_heads, head_size) of positions from ``start`` into the layer's window."""
        end = start + len(k)
        self.window[2 * layer][0, :, :, start:end] = k.transpose(1, 2, 0)
        self.window[2 * layer + 1][0, :, start:end] = v.transpose(1, 0, 2)

    def _to_graph(self, stored: np.ndarray) -> np.ndarray:
        """Cache elements as the graphs take them: an int8 code q as the uint8 q + 128 (q's byte with its top bit
        flipped) where the graphs take uint8."""
        if self.kv.zero_point == _UINT8_ZERO_POINT:
            return (stored.view(np.uint8) ^ np.uint8(_UINT8_ZERO_POINT)).view(self.kv_dtype)
        return stored

    def _to_cache(self, rows: np.ndarray) -> torch.Tensor:
        """Graph K/V rows as the cache stores them (uint8 q + 128 back to the int8 code q)."""
        if self.kv.zero_point == _UINT8_ZERO_POINT:
            rows = (rows.view(np.uint8) ^ np.uint8(_UINT8_ZERO_POINT)).view(np.int8)
        return torch.from_numpy(np.ascontiguousarray(rows))


def _picture_rows(pictures: list[MediaSpan], media: MediaTable, start: int,
                  tokens: int) -> dict[int, np.ndarray]:
    """The input rows by position of the pictures' image tokens among positions [start, start + tokens)."""
    out = {}
    for span in pictures:
        if not (span.start < start + tokens and span.end > start):
            continue
        if span.digest not in media:
            raise ImageError(f"the tokens at [{span.start}, {span.end}) are picture {span.digest.hex()[:12]}'s and "
                             "its rows were not given; send the picture again")
        picture = media[span.digest]
        for offset, row in zip(picture.offsets.tolist(), picture.rows.numpy()):
            if start <= span.start + offset < start + tokens:
                out[span.start + offset] = row
    return out


def session_options(threads: int | None, quantized: bool):
    """ONNX Runtime session options of a graph on a CPU-side provider: ``threads`` (default: the reference engine's);
    a quantized (QDQ) graph computes what it states, at the basic optimizations: the extended ones fuse each int8
    weight's DequantizeLinear and MatMul into MatMulNBits, measured 0.36% off a QDQ MatMul's exact result (the HTP:
    0.003%)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    if quantized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return options


def _session(folder: OnnxFolder, manifest: dict, name: str, provider: str, threads: int | None,
             htp_arch: int | None):
    """An ONNX Runtime session of one graph, its metadata checked against the manifest; on ``qnn`` the HTP
    session of its compiled context binary (cabinllm.runtime.backends.qnn)."""
    try:
        import onnxruntime as ort
    except ModuleNotFoundError as err:
        raise MissingDependency(f"{folder.path}: running ONNX graphs needs onnxruntime, which is not installed; "
                                "pip install 'cabinllm[onnx]'") from err
    if provider not in ORT_PROVIDERS:
        raise ConfigError(f"unknown ONNX Runtime provider {provider!r}; choose one of {', '.join(ORT_PROVIDERS)}")
    key = "prompt" if name == PROMPT_GRAPH else "token"
    path = folder.path / manifest["graphs"][key]
    if provider == "qnn":
        if not manifest["host_inputs"]:
            raise ConfigError(f"{folder.path}: {manifest['profile']} profile graphs gather by token ids, which the HTP "
                              "cannot compile", (Hint(Fix.EXPORT_PROFILE, "npu"),))
        import onnx

        folder.check_graph(path.name, {p.key: p.value for p in onnx.load(str(path), load_external_data=False)
                                       .metadata_props}, manifest)
        return context_session(folder, manifest, key, htp_arch, threads)
    available = ort.get_available_providers()
    if ORT_PROVIDERS[provider] not in available:
        raise ConfigError(f"this ONNX Runtime has no {ORT_PROVIDERS[provider]} (it has {', '.join(available)}); "
                         "install the onnxruntime package built with it", (Hint(Fix.ORT_PROVIDER, "cpu"),))
    options = session_options(threads, quantized=manifest["precision"] != "fp16")
    # ONNX Runtime maps weights.bin, which both graphs then read in place; prepacking would give each graph its own
    # packed copy of every MatMul weight (a chat on the default model, measured: 1.34 GB of process memory with it,
    # 0.32 GB without; decode steps as fast, 64-token prefill chunks about 20% slower)
    options.add_session_config_entry("session.disable_prepacking", "1")
    try:
        session = ort.InferenceSession(str(path), options, providers=[ORT_PROVIDERS[provider]])
    except Exception as err:  # onnxruntime raises its own exception types on a bad graph
        raise CheckpointError(f"{path}: ONNX Runtime cannot load it ({str(err).splitlines()[0]}); "
                              f"{EXPORT_AGAIN}") from err
    folder.check_graph(path.name, session.get_modelmeta().custom_metadata_map, manifest)
    return session


def load_onnx_engine(folder: str | Path, provider: str = "cpu", threads: int | None = None,
                     htp_arch: int | None = None) -> Engine:
    """An exported graph folder as an ``Engine`` whose model runs on ONNX Runtime: sessions (``DialogueSession``)
    and ``run_tokens`` use it as they use the reference engine."""
    folder = OnnxFolder(Path(folder))
    manifest = folder.manifest()
    model = OrtModel(folder, manifest, provider, threads, htp_arch)
    return Engine(folder.path, model.config, model, ChatTokenizer(folder.tokenizer), manifest,
                  manifest["model"]["fingerprint"], folder.scales(manifest))
