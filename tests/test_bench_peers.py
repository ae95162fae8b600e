"""cabin-bench's peers: one that cannot be imported is reported with the reason, never dropped."""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from cabinllm.benchmarks.runners import base as runner_module
from cabinllm.benchmarks.runners.base import Runner, Unavailable
from cabinllm.benchmarks.runners.llamacpp import llamacpp_runners, no_extra_buffers
from cabinllm.benchmarks.runners.transformers import SETTINGS, cache_bytes, transformers_runners


def block_imports(monkeypatch, blocked: set[str]) -> None:
    """Make importlib.import_module fail for the blocked modules, as if they were not installed."""
    real = importlib.import_module

    def fake(name: str, *args, **kwargs):
        if name in blocked:
            raise ModuleNotFoundError(f"No module named '{name}'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(runner_module.importlib, "import_module", fake)


def test_llama_cpp_not_installed_is_reported_for_both_kv_types(monkeypatch, tmp_path):
    block_imports(monkeypatch, {"llama_cpp"})
    peers = llamacpp_runners(tmp_path / "model.gguf", threads=1, n_ctx=64)
    assert [p.name for p in peers] == ["llama.cpp f16", "llama.cpp q8_0"]
    assert all(isinstance(p, Unavailable) for p in peers)
    assert "llama-cpp-python is not installed" in peers[0].reason and "[bench]" in peers[0].reason


def test_llama_cpp_keeps_its_weights_off_amx_tiles_only_where_the_cpu_has_them(tmp_path):
    """On a CPU with AMX, llama.cpp's default model parameters turn its extra buffer types off while a model is
    made (the tiles fault where the machine does not hand them out); elsewhere they are llama.cpp's own."""
    api = pytest.importorskip("llama_cpp.llama_cpp")
    with_amx, without = tmp_path / "amx", tmp_path / "avx2"
    with_amx.write_text("flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n")
    without.write_text("flags\t\t: fpu avx2 fma f16c\n")
    default = api.llama_model_default_params().use_extra_bufts
    with no_extra_buffers(with_amx):
        assert api.llama_model_default_params().use_extra_bufts is False
    with no_extra_buffers(without):
        assert api.llama_model_default_params().use_extra_bufts == default
    assert api.llama_model_default_params().use_extra_bufts == default and default is True


def test_a_missing_quantized_cache_backend_leaves_the_others(monkeypatch):
    block_imports(monkeypatch, {"hqq"})
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, head_dim=4))
    peers = {p.name: p for p in transformers_runners(model, SETTINGS)}
    assert isinstance(peers["transformers dynamic"], Runner)
    assert isinstance(peers["transformers hqq int4"], Unavailable)
    assert isinstance(peers["transformers hqq int8"], Unavailable)
    assert "hqq is not installed" in peers["transformers hqq int4"].reason
    assert isinstance(peers["transformers fp8"], Runner)  # built into transformers


def test_cache_bytes_counts_nested_and_subclassed_tensors():
    layer = SimpleNamespace(keys=torch.zeros(2, 3), _quantized=(torch.zeros(4, dtype=torch.uint8),
                                                                {"scale": torch.zeros(2, dtype=torch.float16)}))
    assert cache_bytes(SimpleNamespace(layers=[layer, layer])) == 2 * (6 * 4 + 4 + 2 * 2)
