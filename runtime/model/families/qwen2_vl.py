"""Qwen2-VL: a Qwen2 text model whose image tokens sit on an M-RoPE grid (time, height, width; its
``mrope_section``), fed by ``visual``; transformers 4 keeps the text config at the top level (model_type
"qwen2_vl"), transformers 5 in ``text_config`` (model_type "qwen2_vl_text")."""
from __future__ import annotations

from cabinllm.runtime.model.families.family import VisionFamily, VisionLanguage

VISION_LANGUAGE = VisionLanguage(
    "Qwen2VLForConditionalGeneration", "qwen2",
    VisionFamily("qwen2_vl", "image_token", ("pixel_values", "image_grid_thw"), ("visual.",), mrope=True),
    text_aliases={"qwen2_vl_text": "qwen2", "qwen2_vl": "qwen2"})
