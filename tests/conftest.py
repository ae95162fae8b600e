"""Shared fixtures: a tiny random-weight engine for unit tests, and the embedded default model (135M),
each built once per test run. Every test that uses the default model is marked ``slow``:
``scripts/test.sh -m "not slow"`` is the quick developer loop. Tests of mechanics (cache, sessions,
overflow, session files, kernels) take ``engine`` / ``engine_dir`` and run on both models."""
from __future__ import annotations

import pytest
import torch

from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.builders.qnn_quantize import CalibrationData
from cabinllm.calibration.hf_model import transformers_model
from cabinllm.runtime.formats.checkpoint import load_checkpoint
from cabinllm.runtime.formats.engine_folder import CHECKPOINT_DIR
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.sources.import_cache import CACHE_ENV

from fakes.tiny_model import write_tiny_llama

# A16W8 calibration for tiny test models: the 4 builtin dialogues (the export's default, 16 ShareGPT ones, is for real
# models)
QUICK_CALIBRATION = CalibrationData("builtin", 4)

DEFAULT_MODEL_FIXTURES = {"default_engine", "default_engine_dir"}
# head size 32: every KV mode works (int4 needs head sizes divisible by its value groups of 32)
TINY_ENGINE_SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs the default model as slow."""
    for item in items:
        if DEFAULT_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def import_cache(tmp_path_factory):
    """A user cache of this test run's own, so tests neither read nor fill the user's (imports once per run)."""
    folder = tmp_path_factory.mktemp("cabin-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(folder))
        yield folder


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


@pytest.fixture(scope="session")
def default_hf_model(default_engine_dir):
    """transformers' model of the default engine's checkpoint (fp32, eval mode), built once: the reference of the
    tests that compare the default model's forward, greedy and beam search with transformers'."""
    return transformers_model(*load_checkpoint(default_engine_dir / CHECKPOINT_DIR))


@pytest.fixture(scope="session")
def tiny_engine_dir(tmp_path_factory):
    """An engine folder of a tiny random Llama (3 layers, head size 32; float32 weights, INT8 KV scales)."""
    root = tmp_path_factory.mktemp("tiny-engine")
    model = write_tiny_llama(root / "model", **TINY_ENGINE_SHAPE)
    folder = root / "tiny-int8"
    build_engine(BuildRequest(str(model), folder, kv_cache="int8", dtype="float32"), log=lambda _msg: None)
    return folder


@pytest.fixture(scope="session")
def tiny_engine(tiny_engine_dir) -> Engine:
    """The tiny engine, loaded once."""
    return Engine.load(tiny_engine_dir)


@pytest.fixture(scope="session")
def calm_engine(tmp_path_factory):
    """An int8-KV engine of a tiny random Llama with small layer weights."""
    root = tmp_path_factory.mktemp("calm")
    model = write_tiny_llama(root / "model", layer_std=0.1, **TINY_ENGINE_SHAPE)
    build_engine(BuildRequest(str(model), root / "engine", kv_cache="int8", dtype="float32"), log=lambda _m: None)
    return root / "engine"


@pytest.fixture(scope="session")
def bytes_engine_dir(tmp_path_factory):
    """The tiny engine with a tokenizer of every byte (it can write JSON, so constrained replies can be tested)."""
    root = tmp_path_factory.mktemp("bytes-engine")
    model = write_tiny_llama(root / "model", byte_tokens=True, **TINY_ENGINE_SHAPE, max_position_embeddings=4096)
    folder = root / "bytes-int8"
    build_engine(BuildRequest(str(model), folder, kv_cache="int8", dtype="float32"), log=lambda _msg: None)
    return folder


@pytest.fixture(scope="session")
def bytes_engine(bytes_engine_dir) -> Engine:
    """The byte-tokenizer tiny engine, loaded once."""
    return Engine.load(bytes_engine_dir)


ENGINES = ["tiny", pytest.param("default", marks=pytest.mark.slow)]


@pytest.fixture(scope="session", params=ENGINES)
def model_name(request) -> str:
    """Each model a mechanics test runs on: the tiny one always, the default one as slow."""
    return request.param


@pytest.fixture(scope="session")
def engine_dir(request, model_name):
    """The engine folder of ``model_name``."""
    return request.getfixturevalue(f"{model_name}_engine_dir")


@pytest.fixture(scope="session")
def engine(request, model_name) -> Engine:
    """The loaded engine of ``model_name``."""
    return request.getfixturevalue(f"{model_name}_engine")


@pytest.fixture
def keep_threads():
    """Restore torch's thread count after a test that sets it (cabin-bench --threads, the kernels' threads)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
