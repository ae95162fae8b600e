"""The CPU side of scripts/gpu_check.sh: its model shapes load from their config files, and its table renders."""
import torch

from cabinllm.benchmarks.gpu_check import SHAPES, shape_config, table


def test_every_shape_loads():
    configs = {name: shape_config(name) for name in SHAPES}
    assert configs["default"].hidden_size == 576 and configs["default"].num_hidden_layers == 30
    assert configs["llama-3.2-3b"].num_key_value_heads == 8 and configs["qwen3-1.7b"].qk_layernorm
    assert all(isinstance(c.max_position_embeddings, int) for c in configs.values())


def test_table_has_a_row_per_measurement():
    row = {"kv_mode": "int8", "context": 4096, "graphs": True, "prefill_tok_s": 1e4, "decode_tok_s": 250.5,
           "peak_bytes": 3 << 30, "plan_bytes": 4 << 30, "weights_bytes_on_gpu": 1 << 30}
    text = table({"device": "a GPU", "torch": torch.__version__, "shapes": {"default": [row, row]}})
    assert len(text.splitlines()) == 4 and "random weights" in text and "250.5" in text
