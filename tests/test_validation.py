"""Issue 13, items 3-5: an engine folder whose config disagrees with its manifest, unusable config values,
non-finite weights and scales, and --scales files far outside the model's K/V range are refused with one clear
error each."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_import import write_tiny_gguf

from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.builders.scales_source import clipping_warning, scales_from_file
from cabinllm.calibration.quick_scales import quick_kv_scales
from cabinllm.cli.chat import main as chat_main
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import CheckpointError, ScalesError
from cabinllm.runtime.formats.checkpoint import ModelConfig, load_checkpoint
from cabinllm.runtime.formats.engine_folder import CHECKPOINT_DIR, MANIFEST_FILE, SCALES_FILE
from cabinllm.runtime.formats.scales_file import KVScales, LayerRanges, load_scales_file, model_fingerprint, save_scales
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.sources.gguf import open_gguf
from cabinllm.runtime.sources.model_source import import_model
from cabinllm.runtime.sources.weight_plan import iter_weights

from fakes.tiny_model import write_tiny_llama
from cli_words import raises_in_cli_words


def quiet(_msg: str) -> None:
    pass


def copy_engine(engine_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(engine_dir, tmp_path / "engine"))


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """The tiny HF model, its float32 checkpoint (config, weights, fingerprint) and its quick scales."""
    root = tmp_path_factory.mktemp("tiny")
    model = write_tiny_llama(root / "model")
    checkpoint = root / CHECKPOINT_DIR
    checkpoint.mkdir()
    import_model(model, checkpoint, dtype="float32")
    config, weights = load_checkpoint(checkpoint)
    quick = quick_kv_scales(Transformer(config, weights), ChatTokenizer(checkpoint))
    return {"root": root, "model": model, "checkpoint": checkpoint, "config": config, "weights": weights,
            "fingerprint": model_fingerprint(config, weights), "quick": quick}


# ---------------------------------------------------------------- item 3: config vs manifest, config values


@pytest.mark.parametrize("keep_scales", [True, False], ids=["with scales file", "without scales file"])
def test_config_with_fewer_layers_than_built_is_refused(tiny_engine_dir, tmp_path, keep_scales):
    folder = copy_engine(tiny_engine_dir, tmp_path)
    edit_json(folder / CHECKPOINT_DIR / "config.json", num_hidden_layers=2)
    if not keep_scales:
        (folder / SCALES_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"num_hidden_layers is 2 but this engine was built with 3 "
                                              r"\(manifest\.json\).*rebuild the engine with cabin-build"):
        Engine.load(folder)


@pytest.mark.parametrize("value", [0, -1, 2.5, "x", True], ids=repr)
def test_unusable_layer_count_is_refused(tiny_engine_dir, tmp_path, value):
    folder = copy_engine(tiny_engine_dir, tmp_path)
    edit_json(folder / CHECKPOINT_DIR / "config.json", num_hidden_layers=value)
    with pytest.raises(CheckpointError) as info:
        Engine.load(folder)
    assert f"config.json: num_hidden_layers is {json.dumps(value)}; it must be a positive integer; rebuild the " \
           "engine with cabin-build" in str(info.value)


def test_cabin_chat_on_an_edited_engine_exits_2(tiny_engine_dir, tmp_path, capsys):
    folder = copy_engine(tiny_engine_dir, tmp_path)
    edit_json(folder / CHECKPOINT_DIR / "config.json", num_hidden_layers=-1)
    script = tmp_path / "s.jsonl"
    script.write_text(json.dumps({"role": "user", "content": "play some jazz"}))
    assert chat_main(["--engine", str(folder), "--script", str(script)]) == 2
    assert "num_hidden_layers is -1; it must be a positive integer" in capsys.readouterr().err


def test_changed_manifest_fingerprint_is_refused(tiny_engine_dir, tmp_path):
    folder = copy_engine(tiny_engine_dir, tmp_path)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    built = manifest["model"]["fingerprint"]
    manifest["model"]["fingerprint"] = "0123456789abcdef"
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"holds model {built} but manifest.json says this engine was built "
                                              "from model 0123456789abcdef.*rebuild the engine with cabin-build"):
        Engine.load(folder)


def test_checkpoint_with_tensors_its_config_does_not_describe_is_refused(tiny, tmp_path):
    shutil.copytree(tiny["checkpoint"], tmp_path / "ckpt")
    edit_json(tmp_path / "ckpt" / "config.json", num_hidden_layers=2)
    with pytest.raises(CheckpointError, match=r"tensor transformer\.layers\.2\.\S+ is not part of the model the "
                                              r"config describes \(7 such tensors\)"):
        load_checkpoint(tmp_path / "ckpt")


BAD_VALUES = [
    ("vocab_size", 0, "a positive integer"),
    ("hidden_size", -128, "a positive integer"),
    ("head_size", 32.0, "a positive integer"),
    ("intermediate_size", None, "a positive integer"),
    ("max_position_embeddings", False, "a positive integer"),
    ("num_key_value_heads", 3, "a divisor of num_attention_heads (4)"),
    ("head_size", 31, "even (RoPE rotates pairs of channels)"),
    ("rotary_base", 0.0, "a finite positive number"),
    ("rotary_base", float("inf"), "a finite positive number"),
    ("norm_epsilon", "1e-5", "a finite positive number"),
    ("norm_epsilon", float("nan"), "a finite positive number"),
    ("tie_word_embeddings", "false", "true or false"),
    ("hidden_act", "relu", '"silu" or "gelu" or "gelu_pytorch_tanh"'),
    ("rotary_scaling", {"rope_type": "yarn", "factor": 4.0},
     "null or an object whose rope_type is one of default, linear, llama3, longrope, mrope"),
    ("rotary_scaling", {"rope_type": "mrope", "mrope_section": [2, 1]},
     "an object with mrope_section: 3 positive integers (pairs turned by time, height, width)"),
    ("rotary_scaling", {"rope_type": "mrope", "mrope_section": [1, 1, 1]},
     "an object whose mrope_section sums to half the rotated channels (4)"),
    ("rotary_scaling", {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 64},
     "an object with short_factor and long_factor lists (one factor per rotated pair)"),
    ("rotary_dim", 33, "null or an even positive integer up to head_size (8)"),
    ("sliding_window", 0, "null or a positive integer"),
    ("query_pre_attn_scalar", -1.0, "null or a finite positive number"),
    ("qk_layernorm", 1, "true or false"),
    ("rotary_scaling", {"rope_type": "linear", "factor": 0}, "an object with a finite positive factor"),
    ("rotary_scaling", {"rope_type": "llama3", "factor": 8.0},
     "an object with a positive integer original_max_position_embeddings"),
    ("quantization", [], "an object"),
]


@pytest.mark.parametrize("key, value, need", BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES])
def test_unusable_config_values_are_one_clear_error(tiny, key, value, need):
    data = {**tiny["config"].to_dict(), key: value}
    with pytest.raises(CheckpointError) as info:
        ModelConfig.from_dict(data, "engine/checkpoint/config.json")
    assert str(info.value) == (f"engine/checkpoint/config.json: {key} is {json.dumps(value)}; it must be {need}; "
                               "rebuild the engine with cabin-build")


def test_the_built_config_passes(tiny):
    assert ModelConfig.from_dict(tiny["config"].to_dict()) == tiny["config"]


# ---------------------------------------------------------------- item 4: non-finite weights and scales


def hf_copy_with(tiny: dict, folder: Path, name: str, change) -> Path:
    """A copy of the tiny HF model with one tensor changed in place by ``change``."""
    shutil.copytree(tiny["model"], folder)
    state = load_file(folder / "model.safetensors")
    change(state[name])
    save_file(state, folder / "model.safetensors")
    return folder


def test_hf_import_refuses_nan_weights_naming_the_tensor(tiny, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    folder = hf_copy_with(tiny, tmp_path / "hf", name, lambda t: t[3, :2].fill_(float("nan")))
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match=rf"hf: tensor {name} has 2 NaN and 0 infinite values \(of 512\); a "
                                              "model with NaN or infinite weights cannot run"):
        import_model(folder, tmp_path / "out")


def test_gguf_import_refuses_infinite_weights_naming_the_tensor(tmp_path):
    attn_v = np.random.default_rng(1).standard_normal((32, 64))
    attn_v[0, 0] = np.inf
    path = tmp_path / "inf.gguf"
    write_tiny_gguf(path, extra={"blk.0.attn_v.weight": attn_v})
    with pytest.raises(CheckpointError, match=r"inf\.gguf: tensor blk\.0\.attn_v\.weight has 0 NaN and 1 infinite "
                                              r"values \(of 2048\)"):
        dict(iter_weights(open_gguf(path), str(path)))  # what import_model converts, after the tokenizer


def test_build_refuses_nan_weights_and_leaves_nothing(tiny, tmp_path):
    folder = hf_copy_with(tiny, tmp_path / "hf", "model.embed_tokens.weight", lambda t: t[5].fill_(float("nan")))
    with pytest.raises(CheckpointError, match=r"tensor model\.embed_tokens\.weight has 32 NaN"):
        build_engine(BuildRequest(str(folder), tmp_path / "e"), log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_weights_beyond_float16_are_refused_for_a_float16_import(tiny, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    folder = hf_copy_with(tiny, tmp_path / "hf", name, lambda t: t[0, 0].fill_(1e6))
    (tmp_path / "fp16").mkdir()
    (tmp_path / "fp32").mkdir()
    with raises_in_cli_words(CheckpointError, match=r"tensor transformer\.layers\.0\.mlp\.proj\.weight holds a "
                                                   r"value of magnitude 1e\+06, beyond float16's range; import it as "
                                                   r"float32 \(cabin-build --dtype float32\)"):
        import_model(folder, tmp_path / "fp16", dtype="float16")
    import_model(folder, tmp_path / "fp32", dtype="float32")


def quick_scales_of(tiny: dict, change) -> KVScales:
    """Quick scales of the tiny model with its weights changed by ``change``."""
    weights = {name: tensor.clone() for name, tensor in tiny["weights"].items()}
    change(weights)
    return quick_kv_scales(Transformer(tiny["config"], weights), ChatTokenizer(tiny["checkpoint"]))


def k_rows(weights: dict, layer: int) -> torch.Tensor:
    q_rows = 4 * 8  # heads x head size of the tiny model
    return weights[f"transformer.layers.{layer}.attention.qkv.weight"][q_rows:q_rows + 2 * 8]


def test_quick_scales_refuse_a_layer_whose_k_is_zero(tiny):
    with pytest.raises(ScalesError, match=r"layer 1 K is 0 for every token of the sample exchanges .*a scale of 0 "
                                          "would turn every stored value into NaN"):
        quick_scales_of(tiny, lambda w: k_rows(w, 1).zero_())


def test_quick_scales_refuse_overflowing_activations(tiny):
    with pytest.raises(ScalesError, match=r"layer 2 K reaches (inf|nan) on the sample exchanges: the model's "
                                          "activations overflow"):
        quick_scales_of(tiny, lambda w: k_rows(w, 2).fill_(1e38))


@pytest.mark.parametrize("bad", [0.0, -0.01, float("nan"), float("inf")], ids=repr)
def test_zero_or_non_finite_scales_are_never_written(tmp_path, bad):
    path = tmp_path / "kv_scales.json"
    with pytest.raises(ScalesError, match=rf"layer 1 v scale {bad} is not a finite positive number; not written"):
        save_scales(path, KVScales(k=[0.1, 0.1], v=[0.1, bad]), "0123456789abcdef", "test", {})
    assert not path.exists()


@pytest.mark.parametrize("rate", [1.5, -0.1, "x"], ids=repr)
def test_clip_rates_outside_0_1_are_refused(tiny, tmp_path, rate):
    path = tmp_path / "kv_scales.json"
    save_scales(path, tiny["quick"], tiny["fingerprint"], "test", {}, ranges_of(tiny))
    doc = json.loads(path.read_text())
    doc["layers"][1]["v_clip_rate"] = rate
    path.write_text(json.dumps(doc))
    with pytest.raises(ScalesError, match=rf"layer 1 v_clip_rate is {rate!r}, not a share between 0 and 1"):
        load_scales_file(path, tiny["fingerprint"], 3, (2, 8))


# ---------------------------------------------------------------- item 5: absurd --scales files


def ranges_of(tiny: dict, k_clip: dict[int, float] | None = None) -> list[LayerRanges]:
    """Per-channel ranges consistent with the quick scales, with the given K clip rate per layer."""
    return [LayerRanges([[k * 127] * 8] * 2, [[v * 127] * 8] * 2, k_clip_rate=(k_clip or {}).get(layer, 0.0))
            for layer, (k, v) in enumerate(zip(tiny["quick"].k, tiny["quick"].v))]


def scales_file(tiny: dict, path: Path, k: list[float], v: list[float]) -> Path:
    save_scales(path, KVScales(k=k, v=v), tiny["fingerprint"], "test", {})
    return path


@pytest.mark.parametrize("scale, how", [(1e-30, "too small"), (1e30, "too large")])
def test_absurd_scales_are_refused_naming_each_layer(tiny, tmp_path, scale, how):
    path = scales_file(tiny, tmp_path / "absurd.json", [scale] * 3, [scale] * 3)
    with pytest.raises(ScalesError) as info:
        build_engine(BuildRequest(str(tiny["model"]), tmp_path / "e", scales=path), log=quiet)
    message = str(info.value)
    assert "absurd.json: scales far outside this model's K/V range (more than 100x above or below" in message
    for layer in range(3):
        for name in "KV":
            assert f"layer {layer} {name}: range {scale * 127:.3g} where the model reaches" in message
    assert message.count(how) == 6 and "calibrate this model with cabin-calibrate" in message
    assert not (tmp_path / "e").exists()


def test_only_the_layer_far_off_is_named(tiny, tmp_path):
    quick = tiny["quick"]
    v = list(quick.v)
    v[1] *= 1000
    path = scales_file(tiny, tmp_path / "one_off.json", list(quick.k), v)
    with pytest.raises(ScalesError, match=r"\n  layer 1 V: range [\d.e+-]+ where the model reaches [\d.e+-]+, "
                                          r"1e\+03x too large\n[^\n]*$"):
        build_engine(BuildRequest(str(tiny["model"]), tmp_path / "e", scales=path), log=quiet)


def test_the_quick_scales_and_scales_10x_off_pass(tiny, tmp_path):
    quick = tiny["quick"]
    for factor in (1, 10, 0.1):
        path = scales_file(tiny, tmp_path / f"x{factor}.json", [k * factor for k in quick.k],
                           [v * factor for v in quick.v])
        out = build_engine(BuildRequest(str(tiny["model"]), tmp_path / f"e{factor}", scales=path), log=quiet)
        assert (out / SCALES_FILE).read_bytes() == path.read_bytes()


def test_layers_that_clip_much_calibration_data_are_warned_about(tiny, tmp_path):
    path = tmp_path / "clipping.json"
    save_scales(path, tiny["quick"], tiny["fingerprint"], "mse", {}, ranges_of(tiny, {0: 0.005, 2: 0.05}))
    logged: list[str] = []
    scales_from_file(path, tiny["config"], tiny["weights"], tiny["fingerprint"], False,
                     tiny["root"] / SCALES_FILE, logged.append)
    assert logged == [f"warning: {path}: the scales of layer 2 K (5.00%) clip more than 1% of the calibration data's "
                      "values, which are cut to the scale's range and cost accuracy; calibrating with --method max "
                      "(or a higher --percentile) clips less"]
    assert clipping_warning(path, ranges_of(tiny, {0: 0.01})) is None and clipping_warning(path, None) is None
