"""What pictures cost a vision-language model on a target: the tokens of a cabin camera's frame (counted by the
model's own processor, as the runtime counts them), the memory of the vision tower and of the encoder's output
cache, and per KV dtype the KV of one picture and the turns with a picture that fit beside the dialogue."""
from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from pathlib import Path

from cabinllm.builders.dialogue_turns import MediaCost
from cabinllm.runtime.model.vision import FEATURE_CACHE_BYTES, VISION_FOLDER, Vision
from cabinllm.runtime.sources.hf_vision import is_vision_folder, encoder_parameters

CAMERA_FRAME = (1280, 720)  # a cabin camera's frame, width x height
VISION_BYTES_PER_PARAMETER = 2  # the tower runs in fp16 on the board


@dataclass(frozen=True)
class ImageCost(MediaCost):
    """A picture's tokens (OpenAI detail "auto" and "low") and what the vision part holds in memory."""

    picture: tuple[int, int]
    tokens: int
    tokens_low: int
    vision_weight_bytes: int
    feature_cache_bytes: int
    request_tokens: int  # the most image rows one request may hold: pictures per message x tokens per picture caps

    @property
    def memory_bytes(self) -> int:
        """Memory the vision part takes beside the text model: its weights and the encoder's output cache."""
        return self.vision_weight_bytes + self.feature_cache_bytes

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {**asdict(self), "picture": list(self.picture), "memory_bytes": self.memory_bytes}


def camera_frame() -> tuple[bytes, str]:
    """A plain camera frame of ``CAMERA_FRAME`` as PNG bytes, and its name in messages."""
    from PIL import Image

    frame = io.BytesIO()
    Image.new("RGB", CAMERA_FRAME, (128, 128, 128)).save(frame, "PNG")
    return frame.getvalue(), f"a {CAMERA_FRAME[0]}x{CAMERA_FRAME[1]} camera frame"


def image_cost(model: str) -> ImageCost | None:
    """The picture costs of an HF vision-language folder or an engine built from one (None for any other model)."""
    folder = Path(model)
    folder = folder / VISION_FOLDER if is_vision_folder(folder / VISION_FOLDER) else folder
    if not is_vision_folder(folder):
        return None
    (frame, name), vision = camera_frame(), Vision(folder)
    return ImageCost(CAMERA_FRAME, vision.prepare(frame, name).image_tokens,
                     vision.prepare(frame, name, "low").image_tokens,
                     encoder_parameters(folder) * VISION_BYTES_PER_PARAMETER, FEATURE_CACHE_BYTES,
                     vision.limits.max_images * vision.limits.max_image_tokens)
