"""The session-file reader under fuzzing, on the tiny engine.

A file cut short, with bytes flipped anywhere, or with its header edited is either refused with a
SessionFileError or restores into exactly the saved session (saved again, it gives the same header
and K/V): never another exception, never a silent restore of changed data. A header edited and
sealed again with a new checksum is refused or restores into a session whose next turn runs.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from cabinllm.runtime.dialogue.interface import TurnStats
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.dialogue.session_file import read_session_file, write_session_file
from cabinllm.runtime.errors import SessionFileError
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig

FUZZ = settings(max_examples=200, deadline=None)
# floats below 1e-30 left out: a temperature under about 1e-36 overflows the sampler (logits / temperature)
FLOATS = st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: x == 0 or not abs(x) < 1e-30)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.sampled_from([2**31, 2**62, 2**64]), FLOATS,
                    st.text(max_size=6))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4),
                                                                                           inner, max_size=2),
                      max_leaves=4)


@pytest.fixture(scope="module")
def saved(tiny_engine, tmp_path_factory) -> dict:
    """A two-turn session saved once: the file's bytes, header and tensors, and a scratch folder."""
    params = SamplingParams(max_new_tokens=4, stop_token_ids=tiny_engine.stop_token_ids())
    session = DialogueSession(tiny_engine, tiny_engine.new_cache(KvCacheConfig("int8", 1 << 20, 16)), params,
                              "You are the in-car assistant.")
    session.chat("Where is the nearest charger?")
    session.chat("How long will it take?")
    folder = tmp_path_factory.mktemp("fuzz")
    session.save(folder / "s.cabin")
    header, tensors = read_session_file(folder / "s.cabin")
    blob = (folder / "s.cabin").read_bytes()
    return {"blob": blob, "header": header, "tensors": tensors, "folder": folder,
            "header_end": 8 + int.from_bytes(blob[:8], "little")}


def paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """The path of every value in a JSON tree, the root first."""
    found = [prefix]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        found += paths(child, prefix + (key,))
    return found


def like(value: object) -> st.SearchStrategy:
    """Values of the same JSON type as value (edits that pass a type check and test the ranges)."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(-3, 40) | st.sampled_from([2**31, 2**62, 2**64])
    return {float: FLOATS, str: st.text(max_size=6)}.get(type(value), VALUES)


@st.composite
def edited_headers(draw, header: dict) -> dict:
    """The header with one value changed, one key or item removed, one key added or one list lengthened."""
    header = copy.deepcopy(header)
    path = draw(st.sampled_from(paths(header)[1:]))
    parent = header
    for key in path[:-1]:
        parent = parent[key]
    node = parent[path[-1]]
    edits = ["set", "remove"] + (["add"] if isinstance(node, dict) else []) + (["lengthen"] if isinstance(node, list)
                                                                               else [])
    edit = draw(st.sampled_from(edits))
    if edit == "set":
        parent[path[-1]] = draw(st.one_of(VALUES, like(node)))
    elif edit == "remove":
        del parent[path[-1]]
    elif edit == "add":
        node[draw(st.text(max_size=8))] = draw(VALUES)
    else:
        node += draw(st.lists(VALUES, min_size=1, max_size=3))
    return header


def same_file(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    """Whether two (header, tensors) pairs are equal, K/V bytes and dtypes included."""
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(
        a[1][name].dtype == b[1][name].dtype and torch.equal(a[1][name], b[1][name]) for name in a[1])


def refused_or_the_original(saved: dict, engine, blob: bytes) -> None:
    """Restore blob: a SessionFileError, or a session that saves back to the original header and K/V."""
    path, again = saved["folder"] / "damaged.cabin", saved["folder"] / "again.cabin"
    path.write_bytes(blob)
    try:
        restored = DialogueSession.restore(path, engine)
    except SessionFileError:
        return
    restored.save(again)
    assert same_file(read_session_file(again), (saved["header"], saved["tensors"])), "a changed file restored"


@FUZZ
@given(data=st.data())
def test_truncated_files_are_refused(tiny_engine, saved, data):
    path = saved["folder"] / "cut.cabin"
    path.write_bytes(saved["blob"][:data.draw(st.integers(0, len(saved["blob"]) - 1))])
    with pytest.raises(SessionFileError):
        DialogueSession.restore(path, tiny_engine)


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_flipped_bytes_anywhere_are_refused_or_change_nothing(tiny_engine, saved, data):
    blob = bytearray(saved["blob"])
    anywhere, in_header = st.integers(0, len(blob) - 1), st.integers(0, saved["header_end"] - 1)
    for at, bits in data.draw(st.lists(st.tuples(st.one_of(anywhere, in_header), st.integers(1, 255)),
                                       min_size=1, max_size=3)):
        blob[at] ^= bits
    refused_or_the_original(saved, tiny_engine, bytes(blob))


@FUZZ
@given(data=st.data())
def test_edited_headers_under_the_old_checksum_are_refused_or_change_nothing(tiny_engine, saved, data):
    header = data.draw(edited_headers(saved["header"]))
    blob = save(saved["tensors"], metadata={"session": json.dumps(header, ensure_ascii=False)})
    refused_or_the_original(saved, tiny_engine, blob)


@FUZZ
@given(data=st.data())
def test_edited_headers_sealed_again_are_refused_or_restore_a_session_that_works(tiny_engine, saved, data):
    header = data.draw(edited_headers(saved["header"]))
    path = saved["folder"] / "resealed.cabin"
    write_session_file(path, header, saved["tensors"])
    try:
        restored = DialogueSession.restore(path, tiny_engine)
    except SessionFileError:
        return
    assert isinstance(restored.chat("One more thing."), TurnStats)

