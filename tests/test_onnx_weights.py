"""cabin-export of quantized engines: W8A16 linear layers as int8 per-channel QDQ (both profiles), W4A16-AWQ and
int4-g32 (with the int8 head) as ONNX Runtime's MatMulNBits (ort profile); the graphs compute what the reference engine computes on the same
engine, within float rounding; a weight format a profile cannot write is one clear error."""
import json
import random

import numpy as np
import onnx
import pytest
from conftest import TINY_ENGINE_SHAPE
from test_onnx_backend import SCRIPT, session

from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.builders.onnx_export import OnnxExportRequest, export_onnx
from cabinllm.builders.onnx_profiles import ONNX_PROFILES
from cabinllm.cli.export import main as export_main
from cabinllm.runtime.backends.onnxruntime import load_onnx_engine
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.formats.engine_folder import MANIFEST_FILE
from cabinllm.runtime.formats.onnx_folder import TOKEN_GRAPH
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.model.linear import unpack_g32

from fakes.tiny_model import write_tiny_llama

CONTEXT, CHUNK = 128, 16
QUIET = {"log": lambda _msg: None}
LINEAR = (".qkv", ".dense", ".fc_gate", ".proj")


@pytest.fixture(scope="module")
def quant_engines(tmp_path_factory):
    """Weight format -> engine folder of the tiny model (W8A16, W4A16-AWQ, int4-g32 with the int8 head; INT8 KV
    scales)."""
    root = tmp_path_factory.mktemp("onnx-weights")
    model = write_tiny_llama(root / "model", **TINY_ENGINE_SHAPE)
    folders = {}
    for weights in ("int8", "int4-awq", "int4-g32"):
        folders[weights] = root / weights
        build_engine(BuildRequest(str(model), folders[weights], kv_cache="int8", weights=weights,
                                  head="int8" if weights == "int4-g32" else "fp16"), **QUIET)
    return folders


@pytest.fixture(scope="module")
def quant_exports(quant_engines, tmp_path_factory):
    """(weight format, profile) -> graph folder with fp32 KV."""
    root = tmp_path_factory.mktemp("onnx-weight-exports")
    folders = {}
    for weights, profile in (("int8", "npu"), ("int8", "ort"), ("int4-awq", "ort"), ("int4-g32", "ort")):
        folders[weights, profile] = root / f"{weights}-{profile}"
        export_onnx(OnnxExportRequest(quant_engines[weights], folders[weights, profile], CONTEXT, CHUNK, "fp32",
                                      profile), **QUIET)
    return folders


@pytest.mark.parametrize("key", [("int8", "npu"), ("int8", "ort"), ("int4-awq", "ort"), ("int4-g32", "ort")])
def test_quantized_graphs_predict_and_answer_as_the_reference(quant_engines, quant_exports, key):
    reference = Engine.load(quant_engines[key[0]])
    onnx_engine = load_onnx_engine(quant_exports[key], threads=1)
    rng = random.Random(0)
    ids = [rng.randrange(reference.config.vocab_size) for _ in range(CONTEXT - 8)]
    prefilled = run_tokens(reference.model, ids, "fp32", all_logits=True)
    gap = (onnx_engine.model.logits_over(prefilled.cache, prefilled.seq) - prefilled.logits).abs().amax(-1)
    assert float(gap.max()) < 1e-3 and float(gap.median()) < 1e-4
    ours, theirs = session(onnx_engine, "fp32"), session(reference, "fp32")
    for text in SCRIPT:
        got, want = ours.chat(text), theirs.chat(text)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason


def _initializers(folder) -> dict[str, np.dtype]:
    model = onnx.load(str(folder / TOKEN_GRAPH), load_external_data=False)
    return {t.name: (onnx.helper.tensor_dtype_to_np_dtype(t.data_type), int(np.prod(t.dims))) for t in
            model.graph.initializer}


def _linear_bytes(folder) -> int:
    return sum(dtype.itemsize * count for name, (dtype, count) in _initializers(folder).items()
               if name.startswith("layers.") and any(layer in name for layer in LINEAR))


def test_int8_weights_are_int8_qdq_a_quarter_of_fp32(quant_exports, tiny_engine_dir, tmp_path):
    folder = quant_exports["int8", "npu"]
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["weight_format"]["name"] == "int8" and "Gather" not in manifest["ops"]
    model = onnx.load(str(folder / TOKEN_GRAPH), load_external_data=False)
    weights = {t.name: t for t in model.graph.initializer if t.name.endswith(".int8")}
    assert len(weights) == 4 * 3 and {t.data_type for t in weights.values()} == {onnx.TensorProto.INT8}
    dequantize = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in weights]
    assert len(dequantize) == 4 * 3 and all(onnx.helper.get_attribute_value(n.attribute[0]) == 1 for n in dequantize)
    fp32 = tmp_path / "fp32"
    export_onnx(OnnxExportRequest(tiny_engine_dir, fp32, CONTEXT, CHUNK, "fp32", "npu", "fp16"), **QUIET)
    assert _linear_bytes(folder) == pytest.approx(_linear_bytes(fp32) / 4, rel=0.05)
    assert (folder / "weights.bin").stat().st_size < (fp32 / "weights.bin").stat().st_size


def test_int4_awq_weights_are_matmulnbits_blocks(quant_exports):
    folder = quant_exports["int4-awq", "ort"]
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["weight_format"]["name"] == "int4-awq" and "com.microsoft.MatMulNBits" in manifest["ops"]
    assert "MatMul" in manifest["ops"]  # attention and lm_head stay float
    blocks = {name: info for name, info in _initializers(folder).items() if name.endswith(".uint4")}
    assert blocks and {dtype for dtype, _ in blocks.values()} == {np.dtype(np.uint8)}
    assert len(blocks) == 5 * 3  # qkv, dense, proj, and fc and gate apart (each has its prequant scale)


def test_int4_awq_on_the_npu_profile_is_one_clear_error(quant_engines, tmp_path, capsys):
    out = tmp_path / "out"
    assert export_main(["--engine", str(quant_engines["int4-awq"]), "--output", str(out), "--context", "64",
                        "--chunk", "16", "--profile", "npu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cabin-export: error: the npu profile (opset 23) cannot write int4-awq weights;")
    assert "--profile ort" in err and "--weights fp16 or int8" in err and "Traceback" not in err
    assert not out.exists()


def test_int4_g32_and_the_int8_head_are_4_and_8_bit_blocks(quant_engines, quant_exports):
    """Every linear as 4-bit MatMulNBits blocks of 32 with float zero points; the lm_head 8-bit blocks, which the
    embedding Gathers too where the model ties them (one copy of the table)."""
    folder = quant_exports["int4-g32", "ort"]
    model = Engine.load(quant_engines["int4-g32"]).model
    table = "lm_head.uint8" if model.embedding is model.lm_head else "embedding.uint8"
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["weight_format"]["name"] == "int4-g32" and manifest["head"]["name"] == "int8"
    graph = onnx.load(str(folder / TOKEN_GRAPH), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nbits]
    assert [a["bits"] for a in attrs].count(4) == 4 * 3 and [a["bits"] for a in attrs].count(8) == 1
    assert {a["block_size"] for a in attrs} == {32} and all(len(n.input) == 4 for n, a in zip(nbits, attrs)
                                                            if a["bits"] == 4)
    head = [n.input[1] for n, a in zip(nbits, attrs) if a["bits"] == 8]
    gathered = {n.input[0] for n in graph.node if n.op_type == "Gather"}
    assert head == ["lm_head.uint8"] and table in gathered and "embedding" not in _initializers(folder)


def test_the_int8_head_on_the_npu_profile_is_one_clear_error(quant_engines, tmp_path, capsys):
    out = tmp_path / "out"
    assert export_main(["--engine", str(quant_engines["int4-g32"]), "--output", str(out), "--context", "64",
                        "--chunk", "16", "--profile", "npu"]) == 2
    err = capsys.readouterr().err
    assert "the npu profile cannot write the int8 head; export with --profile ort" in err
    assert "--head fp16" in err and "Traceback" not in err and not out.exists()


def test_int4_g32_round_trips_bit_for_bit_through_the_export(quant_engines, quant_exports):
    """From each MatMulNBits' blocks, scales and zero points the engine's codes, fp16 scales and minima
    (m = -z * d) come back exactly."""
    model = Engine.load(quant_engines["int4-g32"]).model
    graph = onnx.load(str(quant_exports["int4-g32", "ort"] / TOKEN_GRAPH))
    tensors = {t.name: onnx.numpy_helper.to_array(t) for t in graph.graph.initializer}
    for index, layer in enumerate(model.layers):
        for name in ("qkv", "dense", "proj"):
            op, prefix = layer[name], f"layers.{index}.{name}"
            blocks = tensors[f"{prefix}.uint4"]
            codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(blocks.shape[0], -1)
            scale = tensors[f"{prefix}.scales"].reshape(op.scale.shape)
            minimum = (-tensors[f"{prefix}.zero_points"].reshape(op.scale.shape) * scale).astype(np.float16)
            assert np.array_equal(codes, unpack_g32(op.codes).numpy())
            assert np.array_equal(scale.astype(np.float16), op.scale.numpy())
            assert np.array_equal(minimum, op.minimum.numpy())


@pytest.mark.parametrize("profile", ["ort", "npu"])
def test_int8_activation_weights_are_refused_with_the_format_that_exports(profile):
    with pytest.raises(ConfigError, match=r"int4-g32-a8 weights cannot be exported.*accuracy_level 4.*"
                                          r"--weights int4-g32, the same blocks"):
        ONNX_PROFILES[profile].check_weights("int4-g32-a8")
