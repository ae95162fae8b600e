"""SmolLM3: Llama whose every ``no_rope_layer_interval``-th layer (``no_rope_layers`` 0) attends without RoPE
(NoPE), tied embeddings by default; its sliding window is off unless config.json turns it on, and refused below the
context. No TensorRT-LLM line builds it: cabin-plan names the ONNX path."""
from __future__ import annotations

from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.checkpoint import CheckpointArchitecture, ModelConfig
from cabinllm.runtime.model.families.family import Family, Reference


def fields(data: dict, source: str) -> dict:
    """The layers without RoPE, from ``no_rope_layers`` (1: RoPE, 0: none) or every ``no_rope_layer_interval``-th."""
    layers, interval = data["num_hidden_layers"], data.get("no_rope_layer_interval", 4)
    flags = data.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise CheckpointError(f"{source}: no_rope_layers has {len(flags)} entries for {layers} layers; fix the "
                              "config or use another copy of the model")
    return dict(nope_layers=[i for i, rotates in enumerate(flags) if not rotates] or None)


def reference(config: ModelConfig) -> dict:
    """SmolLM3Config's keys beyond the common ones."""
    return dict(no_rope_layers=[int(config.layer_rotates(i)) for i in range(config.num_hidden_layers)],
                use_sliding_window=False)


FAMILY = Family(
    checkpoint=CheckpointArchitecture("SmolLM3ForCausalLM"),
    model_types=("smollm3",),
    reference=Reference("SmolLM3Config", "SmolLM3ForCausalLM", reference),
    fields=fields,
    tied_by_default=True,
)
FAMILIES = (FAMILY,)
