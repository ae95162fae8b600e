"""The vision part of a vision-language engine: images decoded and checked, preprocessed and expanded into their
placeholder tokens as the family's transformers processor does, encoded into the decoder's input rows.

An engine built from a LLaVA, Idefics3 (SmolVLM) or Qwen2-VL folder keeps, beside its text checkpoint, a
``vision/`` folder: the HF config, the vision tower's and projector's (connector's, merger's) tensors and the
processor's files. The tower runs as transformers defines it (its ``get_image_features``), on a copy of the model
whose text part is a one-layer stub: the decoder is the reference engine's. Images are identified by the digest
of their decoded pixels; encoded rows stay in an LRU of a byte budget (``FeatureCache``), so the same picture sent
again skips the encoder.
"""
from __future__ import annotations

import hashlib
import io
import json
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from cabinllm.runtime.errors import CheckpointError, ImageError
from cabinllm.runtime.model.families import VISION_FAMILIES
from cabinllm.runtime.model.interface import MediaRows
from cabinllm.runtime.model.media import FeatureCache, encoder_model, media_message, open_encoder_folder

VISION_FOLDER = "vision"
VISION_WEIGHTS = "vision.safetensors"
LOW_DETAIL_PIXELS = 448 * 448
FEATURE_CACHE_BYTES = 64 << 20  # encoded rows kept per engine (the plan counts them)


@dataclass
class ImageLimits:
    """Caps on what one request may send: decoded pixels per picture, image tokens per picture (Qwen2-VL's
    processor resizes to at most ``max_image_tokens``' worth of pixels), pictures per request."""

    max_decoded_pixels: int = field(default=40_000_000, metadata={
        "help": "largest picture decoded, in pixels (width x height); larger ones are refused before decoding"})
    max_image_tokens: int = field(default=1024, metadata={"help": "most tokens one picture may take in the dialogue"})
    max_images: int = field(default=4, metadata={"help": "most pictures in one message"})


@dataclass
class PreparedImage:
    """One picture as the decoder takes it: its digest, the tokens that stand for it in the prompt, the processor's
    tensors for the encoder, and its M-RoPE grid (t, h, w) where the model has one."""

    digest: bytes
    token_ids: list[int]
    offsets: torch.Tensor  # positions of the placeholder tokens (the encoder's rows) within token_ids
    inputs: dict[str, torch.Tensor]
    grid: tuple[int, int, int] | None
    size: tuple[int, int]  # decoded width, height
    name: str = ""  # as the user named it (a file name, a message's part); a restored session's: its digest

    @property
    def image_tokens(self) -> int:
        """Tokens the picture takes in the dialogue."""
        return len(self.token_ids)

    def to_json(self) -> dict:
        """What a session file keeps of the picture (its tokens and layout, not its pixels)."""
        return {"token_ids": self.token_ids, "offsets": self.offsets.tolist(), "grid": self.grid,
                "size": list(self.size)}

    @classmethod
    def from_json(cls, digest: str, data: dict) -> "PreparedImage":
        """A picture as a session file kept it: no pixels (encoded again only from the feature cache)."""
        grid = tuple(data["grid"]) if data.get("grid") else None
        return cls(bytes.fromhex(digest), list(data["token_ids"]), torch.tensor(data["offsets"], dtype=torch.long), {},
                   grid, tuple(data["size"]), f"picture {digest[:12]}")


def decode_image(data: bytes, name: str, limits: ImageLimits):
    """A picture's bytes as an RGB Pillow image and the digest of its decoded pixels; ImageError naming the picture
    and the fix for bytes Pillow cannot read, a truncated file, an empty or an oversized picture."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height == 0:
                raise ImageError(f"{name} is {width}x{height} pixels: an empty picture; send one with content")
            if width * height > limits.max_decoded_pixels:
                raise ImageError(f"{name} is {width}x{height} ({width * height / 1e6:.0f} MP), over the "
                                 f"{limits.max_decoded_pixels / 1e6:.0f} MP a picture may have; downscale it")
            image = image.convert("RGB")
    except UnidentifiedImageError as err:
        raise ImageError(f"{name} is not a picture Pillow can read (not PNG, JPEG, WebP or another format it knows); "
                         "send a PNG, JPEG or WebP") from err
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageError(f"{name} has too many pixels to decode safely ({err}); downscale it") from err
    except (OSError, SyntaxError, ValueError) as err:
        raise ImageError(f"{name} could not be decoded ({err}): the file may be truncated; send it again") from err
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.width}x{image.height}".encode())
    h.update(image.tobytes())
    return image, h.digest()


def read_pictures(paths: list[str | Path]) -> list[tuple[str, bytes]]:
    """(file name, bytes) of picture files; ImageError naming one that cannot be read."""
    pictures = []
    for path in map(Path, paths):
        try:
            pictures.append((path.name, path.read_bytes()))
        except OSError as err:
            raise ImageError(f"{path}: cannot read the picture ({err.strerror}); check the path") from err
    return pictures


class Vision:
    """A vision-language engine's images: preprocessing, placeholder expansion and the encoder."""

    def __init__(self, folder: Path, limits: ImageLimits | None = None,
                 cache_bytes: int = FEATURE_CACHE_BYTES) -> None:
        self.folder, self.limits = folder, limits or ImageLimits()
        self.config, self.processor, self.family = open_encoder_folder(folder, VISION_FAMILIES, "vision", _processor)
        self.placeholder = getattr(self.processor, self.family.placeholder_key)
        self.image_token_id = self.processor.tokenizer.convert_tokens_to_ids(self.placeholder)
        self.features = FeatureCache(cache_bytes)

    @cached_property
    def model(self) -> torch.nn.Module:
        """The vision tower and projector, loaded when a picture is first encoded (planning needs only the
        processor); normal tensors even when first asked for in inference mode (an export traces them)."""
        import transformers

        with torch.inference_mode(False):
            return encoder_model(self.config, self.folder / VISION_WEIGHTS, self.family.prefixes,
                                 lambda config: transformers.AutoModelForImageTextToText.from_config(config).model)

    def check_count(self, count: int, where: str) -> None:
        """ImageError where ``where`` (a message) shows more pictures than the cap."""
        if count > self.limits.max_images:
            raise ImageError(f"{where} has {count} pictures, over the cap of {self.limits.max_images} per message; "
                             "send fewer")

    def image_message(self, message: dict, pictures: list[tuple[str, bytes]],
                      held: dict[str, PreparedImage]) -> dict:
        """The message with its pictures ((name, bytes)) before its text as image parts, each prepared into ``held``
        (by digest hex); ImageError naming the picture and the cap where one cannot be taken."""
        self.check_count(len(pictures), "the message")
        prepared = [self.prepare(data, name) for name, data in pictures]
        held.update({image.digest.hex(): image for image in prepared})
        return media_message(message, "image", [image.digest for image in prepared])

    def prepare(self, data: bytes, name: str, detail: str = "auto") -> PreparedImage:
        """Decode, check and preprocess one picture; its token count is known before anything is encoded.
        ``detail`` "low" (OpenAI's): Idefics3 without tiles, Qwen2-VL at most 448 x 448 pixels; LLaVA's one size."""
        image, digest = decode_image(data, name, self.limits)
        images = [[image]] if self.family.nested_images else [image]
        out = self.processor(text=[self.placeholder], images=images, return_tensors="pt", add_special_tokens=False,
                             images_kwargs=self._resize_kwargs(detail))
        ids = out["input_ids"][0].tolist()
        if len(ids) > self.limits.max_image_tokens:
            raise ImageError(f"{name} takes {len(ids)} tokens, over the cap of {self.limits.max_image_tokens} image "
                             "tokens per picture; send a smaller picture or raise the cap (max image tokens)")
        grid = None
        if self.family.mrope:
            t, h, w = out["image_grid_thw"][0].tolist()
            merge = self.config.vision_config.spatial_merge_size
            grid = (t, h // merge, w // merge)
        offsets = torch.tensor([i for i, t in enumerate(ids) if t == self.image_token_id])
        inputs = {key: out[key] for key in self.family.feature_inputs if key in out}
        return PreparedImage(digest, ids, offsets, inputs, grid, image.size, name)

    @torch.inference_mode()
    def encode(self, image: PreparedImage) -> MediaRows:
        """The decoder's input rows of a prepared picture (from the feature cache when it was encoded before)."""
        gone = ImageError(f"picture {image.digest.hex()[:12]} is needed again and its pixels are not held (a restored "
                          "session keeps none); send the picture again")
        return self.features.rows(image.digest, image.offsets, image.inputs, self._features, "vision", gone)

    def _features(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The encoder's output rows for one picture's processor tensors."""
        extra = {key: getattr(self.config, key) for key in self.family.feature_options}
        out = self.model.get_image_features(**inputs, **extra)
        rows = out.pooler_output if hasattr(out, "pooler_output") else out
        return torch.cat(list(rows)) if isinstance(rows, (list, tuple)) else rows.reshape(-1, rows.shape[-1])

    def _max_pixels(self, detail: str) -> int:
        """Qwen2-VL: the most pixels a picture is resized to: the processor's own, lowered to what makes at most
        ``max_image_tokens`` tokens (each token is merge^2 patches), and to 448 x 448 for detail "low"."""
        v = self.config.vision_config
        cap = self.limits.max_image_tokens * (v.patch_size * v.spatial_merge_size) ** 2
        cap = min(cap, LOW_DETAIL_PIXELS) if detail == "low" else cap
        size = self.processor.image_processor.size  # transformers 5: pixels as shortest / longest "edge"
        configured = size.get("longest_edge") or getattr(self.processor.image_processor, "max_pixels", None)
        return min(cap, configured) if configured else cap

    def _resize_kwargs(self, detail: str) -> dict:
        """The processor's images_kwargs for one picture: Qwen2-VL's pixel range with ``_max_pixels`` on top,
        Idefics3 without tiles for detail "low"."""
        if self.family.mrope:
            size = dict(self.processor.image_processor.size)
            if "longest_edge" in size:  # never under its least pixels: a picture over the token cap is refused
                return {"size": {**size, "longest_edge": max(self._max_pixels(detail), size.get("shortest_edge", 0))}}
            return {"max_pixels": self._max_pixels(detail)}  # transformers 4
        return dict(self.family.low_detail) if detail == "low" else {}


def _processor(folder: Path):
    """The folder's transformers processor; where its video processor needs torchvision (Qwen2-VL's) and torchvision
    is not installed, the same processor without one: pictures are all a cabin sends."""
    import transformers

    try:
        return transformers.AutoProcessor.from_pretrained(folder)
    except ImportError as err:
        missing = err
    configs = [folder / n for n in ("processor_config.json", "preprocessor_config.json") if (folder / n).is_file()]
    name = next((c["processor_class"] for c in (json.loads(p.read_text(encoding="utf-8")) for p in configs)
                 if "processor_class" in c), None)
    if name is None or not hasattr(transformers, name):
        raise CheckpointError(f"{folder}: the processor needs a library that is not installed ({missing}); install it")
    base = getattr(transformers, name)

    def check(self, attribute: str, value: object):
        return None if value is None else base.check_argument_for_proper_class(self, attribute, value)

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    images_only = type(name, (base,), {"check_argument_for_proper_class": check})
    return images_only(image_processor=transformers.AutoImageProcessor.from_pretrained(folder), tokenizer=tokenizer,
                       video_processor=None, chat_template=tokenizer.chat_template)
