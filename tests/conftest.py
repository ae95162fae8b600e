"""Shared fixtures: the embedded default model, built once per test run."""
from __future__ import annotations

import pytest

from builders.engine_build import BuildRequest, build_engine
from runtime.engine import Engine


@pytest.fixture(scope="session")
def default_engine_dir(tmp_path_factory):
    """An engine folder of the default model (float32 weights, INT8 KV scales), built once."""
    folder = tmp_path_factory.mktemp("engines") / "smollm2-int8"
    build_engine(BuildRequest("default", folder, kv_cache="int8", dtype="float32"), log=lambda _msg: None)
    return folder


@pytest.fixture(scope="session")
def default_engine(default_engine_dir) -> Engine:
    """The default engine, loaded once."""
    return Engine.load(default_engine_dir)
