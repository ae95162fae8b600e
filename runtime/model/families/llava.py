"""LLaVA: a Llama or Mistral text model (its config's ``text_config``) fed by a CLIP-style vision tower through
``multi_modal_projector``; ``get_image_features`` takes the config's feature layer and selection strategy."""
from __future__ import annotations

from cabinllm.runtime.model.families.family import VisionFamily, VisionLanguage

VISION_LANGUAGE = VisionLanguage(
    "LlavaForConditionalGeneration", "llama",
    VisionFamily("llava", "image_token", ("pixel_values",), ("vision_tower.", "multi_modal_projector."),
                 feature_options=("vision_feature_layer", "vision_feature_select_strategy")))
