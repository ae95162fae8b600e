"""Idefics3 (SmolVLM): a Llama text model (``text_model``) fed by a SigLIP-style vision model through ``connector``;
its processor takes a list of pictures per prompt and splits a picture into tiles unless told not to (detail
"low")."""
from __future__ import annotations

from cabinllm.runtime.model.families.family import VisionFamily, VisionLanguage

VISION_LANGUAGE = VisionLanguage(
    "Idefics3ForConditionalGeneration", "llama",
    VisionFamily("idefics3", "image_token", ("pixel_values", "pixel_attention_mask"), ("vision_model.", "connector."),
                 nested_images=True, low_detail={"do_image_splitting": False}))
