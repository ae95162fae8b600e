"""A transformers ``LlamaForCausalLM`` holding a checkpoint folder's weights: the reference our engine is checked
against (cabinllm.calibration.hf_model)."""
from __future__ import annotations

from pathlib import Path

from cabinllm.calibration.hf_model import transformers_model
from cabinllm.runtime.formats.checkpoint import load_checkpoint


def to_transformers(folder: str | Path):
    """Load a Llama/Mistral checkpoint folder (any weight format) into transformers' LlamaForCausalLM, in fp32."""
    config, weights = load_checkpoint(folder)
    try:
        return transformers_model(config, weights)
    except ValueError as err:
        raise ValueError(f"{folder}: {err}") from None
