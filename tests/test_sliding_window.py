"""Gemma 3's local layers in the window pool (cabinllm.runtime.kv.window): a new sequence reuses a prefix longer
than the window, reuse stops where the pool no longer holds a window, forks and the server's scheduler run on it,
and what it cannot hold is one clear error. Tiny random-weight Gemma 3 (window 8, layers local and global)."""
from __future__ import annotations

import pytest
from core_helpers import generate
import torch
from test_families import write_family_folder
from test_hf_folders import cabin_build

from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import ConfigError, OutOfBlocks
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig, PagedKVCache
from cabinllm.runtime.kv.int4 import Int4KV
from cabinllm.runtime.kv.window import WindowedStorage, WindowPlan
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig

TPB = 4  # blocks smaller than the window (8), so a window spans blocks


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Engine:
    """A tiny Gemma 3 engine (fp32 weights, int8 KV scales calibrated)."""
    root = tmp_path_factory.mktemp("gemma")
    write_family_folder(root / "hf", "Gemma3", seed=3)
    return Engine.load(cabin_build(root / "hf", root / "engine"))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 15, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh_logits(engine: Engine, tokens: list[int]) -> torch.Tensor:
    return run_tokens(engine.model, tokens, "fp32", all_logits=True).logits


def cache_of(engine: Engine, max_sequences: int = 1, budget: int = 1 << 20) -> PagedKVCache:
    return engine.new_cache(KvCacheConfig("fp32", budget, TPB), max_sequences)


def test_a_new_sequence_reuses_a_prefix_longer_than_the_window(gemma):
    cache, prompt = cache_of(gemma), ids(60, 0)
    first = Sequence()
    cache.allocate(first, prompt)
    gemma.model.forward(prompt, 0, cache, first)
    cache.free(first)
    longer = prompt + ids(10, 1)
    second = Sequence()
    reused = cache.allocate(second, longer)
    assert reused == 60  # every block of the first prompt: far past the window of 8
    ours = gemma.model.forward(longer[reused:], reused, cache, second, all_logits=True)
    torch.testing.assert_close(ours, fresh_logits(gemma, longer)[reused:], atol=1e-5, rtol=0)
    plan, per_block = cache.storage.plan, cache.storage.window_bytes()[0] // cache.storage.local_blocks
    last = reused + (len(longer) - 1 - reused) // plan.step_tokens * plan.step_tokens  # the last step's first token
    pinned = -(-len(longer) // TPB) - plan.first_block(last)  # its window and new tokens, not the whole sequence
    assert cache.storage.window_bytes()[1] == pinned * per_block < cache.stats().blocks_in_use * per_block


def test_reuse_stops_where_the_pool_no_longer_holds_the_window(gemma):
    cache, prompt = cache_of(gemma), ids(60, 0)
    for tokens in (prompt, ids(60, 2)):  # the second prompt's windows take the pool's blocks over
        seq = Sequence()
        cache.allocate(seq, tokens)
        gemma.model.forward(tokens, 0, cache, seq)
        cache.free(seq)
    again = Sequence()
    assert cache.blocks.blocks_to_admit(prompt, 0)[1] == 56  # the blocks still hold the global layers' prefix
    reused = cache.allocate(again, prompt)
    assert reused == 0  # but no local layer's window of it is left
    torch.testing.assert_close(gemma.model.forward(prompt, 0, cache, again, all_logits=True),
                               fresh_logits(gemma, prompt), atol=1e-5, rtol=0)


def test_choices_fork_on_the_window_pool_through_the_scheduler(gemma):
    prompt, params = ids(40, 4), [SamplingParams(12, stop_token_ids=[]) for _ in range(2)]
    requests = [Request(prompt, p, lambda *_: None) for p in params]
    requests[0].followers = requests[1:]
    scheduler = gemma.new_core(cache_of(gemma, max_sequences=2), SchedulerConfig(max_sessions=2))
    scheduler.add_request(requests[0])
    while any(r.finish_reason is None for r in requests):
        scheduler.step()
    alone = generate(gemma, cache_of(gemma), prompt, params[0])
    assert requests[0].token_ids == requests[1].token_ids == alone.token_ids
    assert scheduler.cache.stats().blocks_in_use == 0 and scheduler.cache.storage.window_bytes()[1] == 0


def test_what_the_window_pool_cannot_hold_is_one_clear_error(gemma):
    cache, seqs = cache_of(gemma), [Sequence(), Sequence()]
    cache.allocate(seqs[0], ids(12, 5))
    with pytest.raises(OutOfBlocks, match="windows of 1 sequences and 1 are live; raise max_sequences"):
        cache.allocate(seqs[1], ids(12, 6))
    with pytest.raises(OutOfBlocks, match="raise max_sequences"):
        cache.fork(seqs[0], seqs[1])
    layout = gemma.model.kv_layout
    with pytest.raises(ConfigError, match="int4 cannot hold sliding-window layers; choose int8, fp16 or fp32"):
        WindowedStorage(Int4KV, layout, 8, WindowPlan.of(layout, TPB), 1)


def test_a_saved_session_continues_as_if_never_saved(gemma, tmp_path):
    """The session file holds every token's global layers and the local layers' window; restored into a new cache
    (no prefill), the next reply is the one the original session gives."""
    params = SamplingParams(6, stop_token_ids=[])
    session = DialogueSession(gemma, cache_of(gemma, budget=2 << 20), params, "play some jazz")
    for text in ("navigate to the nearest charging station " * 3, "play some jazz " * 4):
        session.chat(text)
    assert len(session.seq) > 3 * 8  # longer than the window
    saved = session.save(tmp_path / "s.cabin")
    restored = DialogueSession.restore(tmp_path / "s.cabin", gemma)
    assert saved == len(session.seq) and restored.fed == session.fed
    again, original = restored.chat("the nearest station"), session.chat("the nearest station")
    assert again.token_ids == original.token_ids and again.reused_tokens == original.reused_tokens


def test_calibration_reads_every_token_of_the_local_layers(gemma):
    """run_tokens (calibration's and cabin-eval's runs) keeps every layer's K/V of every token on a cache of its
    own, the local layers' too, while their attention still sees the window: the logits are the window pool's."""
    tokens = ids(300, 7)  # far more than the window pool of one sequence holds
    run = run_tokens(gemma.model, tokens, "fp32", all_logits=True)
    local = next(i for i in range(gemma.config.num_hidden_layers) if gemma.config.layer_window(i))
    assert run.kv(local)[0].shape[0] == 300
    cache, seq = cache_of(gemma), Sequence()
    cache.allocate(seq, tokens)
    torch.testing.assert_close(run.logits, gemma.model.forward(tokens, 0, cache, seq, all_logits=True), atol=1e-5,
                               rtol=0)


def test_the_openai_client_talks_to_a_gemma3_server(gemma):
    """cabin-serve on the window pool (sized by --max-sessions): two choices of one prompt, then a streamed turn
    that reuses the conversation past the window."""
    import openai

    from serve_helpers import running_server

    ask = [{"role": "user", "content": "navigate to the nearest charging station " * 4}]
    with running_server(gemma.folder, "--max-sessions", "2", "--kv-budget-mb", "4") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        first = client.chat.completions.create(model="tiny", messages=ask, max_tokens=6, n=2, temperature=0)
        assert [c.finish_reason for c in first.choices] == ["length", "length"]
        assert first.choices[0].message.content == first.choices[1].message.content  # greedy: the same reply
        ask += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "play some jazz"}]
        chunks = list(client.chat.completions.create(model="tiny", messages=ask, max_tokens=6, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 8  # more than the window reused
