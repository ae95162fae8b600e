"""The CPU side of scripts/gpu_check.sh: its shapes load from their config files, and every measurement it makes runs
on the CPU at the tiny engine's shape with the kernels interpreted (mechanics: the numbers are not speeds)."""
import pytest
import torch
from triton_helpers import triton_kernels

from cabinllm.benchmarks.gpu_check import PEER_CONTEXT, SHAPES, row_kinds, run, shape_config, table

triton_kernels()  # the interpreter, set before the runner loads the kernels


def test_every_shape_loads():
    configs = {name: shape_config(name) for name in SHAPES}
    assert configs["default"].hidden_size == 576 and configs["default"].num_hidden_layers == 30
    assert configs["llama-3.2-3b"].num_key_value_heads == 8
    assert configs["qwen3-4b"].qk_layernorm and configs["qwen3-4b"].hidden_size == 2560
    assert all(isinstance(c.max_position_embeddings, int) for c in configs.values())


def test_graph_rows_everywhere_and_an_eager_row_at_the_peers_context():
    cuda = torch.device("cuda")  # no GPU needed to name one
    assert [row_kinds(cuda, c) for c in (512, PEER_CONTEXT, 16384)] == [(True,), (True, False), (True,)]
    assert row_kinds(torch.device("cpu"), PEER_CONTEXT) == (False,)
    assert next(iter(SHAPES)) == "llama-3.2-3b"  # a run cut short keeps the shape the figures are taken at


@pytest.mark.slow
def test_every_measurement_runs_at_a_tiny_shape(tiny_engine, tmp_path):
    results = run({"tiny": tiny_engine.config}, torch.device("cpu"), torch.float32, [40], ["int8"], 2, ["static"],
                  tmp_path, turn=2)
    shape = results["shapes"]["tiny"]
    assert shape["logits"]["top1_agreement"] == 1.0 and shape["logits"]["max_abs_diff"] < 1e-3
    assert [row["context"] for row in shape["rows"]] == [40] and shape["rows"][0]["decode_tok_s"] > 0
    assert shape["turn_ttft"][0]["history_tokens"] == 70 + 60 and shape["turn_ttft"][0]["with_reuse_s"] > 0
    assert shape["peers"][0]["decode_tok_s"] > 0 and shape["decode_vs_peer"] > 0
    text = table(results)
    assert "logits vs transformers" in text and "turn 2 TTFT" in text and "transformers generate" in text
    assert (tmp_path / "gpu_check.json").exists() and (tmp_path / "gpu_check.txt").read_text() == text + "\n"
