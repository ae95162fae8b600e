"""The audio part of an audio-language engine (Qwen2-Audio): clips turned into the processor's features, expanded
into their placeholder tokens as the family's transformers processor does, encoded into the decoder's input rows.

An engine built from a Qwen2-Audio folder keeps, beside its text checkpoint, an ``audio/`` folder: the HF config,
the encoder's and projector's tensors and the processor's files (a ``WhisperFeatureExtractor``). Features are the
processor's (log-mel frames, 100 a second, padded to its 30 s window); the encoder runs as transformers' model does
(``Qwen2AudioEncoder`` over the valid frames, then ``multi_modal_projector``) on a copy of the model whose text part
is a one-layer stub. A clip is identified by ``Clip.digest`` (of its decoded 16 kHz samples); encoded rows stay in
the engine's ``FeatureCache``, so the same speech sent again skips the encoder.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from cabinllm.runtime.errors import AudioError, Fix, Hint
from cabinllm.runtime.model.families import AUDIO_FAMILIES
from cabinllm.runtime.model.interface import MediaRows
from cabinllm.runtime.model.media import FeatureCache, encoder_model, media_message, open_encoder_folder
from cabinllm.runtime.speech.audio import SAMPLE_RATE, AudioLimits, Clip

AUDIO_FOLDER = "audio"
AUDIO_WEIGHTS = "audio.safetensors"
FEATURE_CACHE_BYTES = 16 << 20  # encoded rows kept per engine: 8 MiB is 30 s of rows at a 3584 hidden size
TRANSCRIPTS_KEPT = 256  # transcripts kept per engine by clip digest, so that speech sent again is heard once


@dataclass
class PreparedClip:
    """One clip as the decoder takes it: its digest, the tokens that stand for it in the prompt (the processor's
    expansion of the placeholder), the processor's tensors for the encoder and its length."""

    digest: bytes
    token_ids: list[int]
    offsets: torch.Tensor  # positions of the placeholder tokens (the encoder's rows) within token_ids
    inputs: dict[str, torch.Tensor]
    seconds: float
    name: str = ""  # as the user named it; a restored session's: its digest
    grid = None  # audio takes plain positions (no M-RoPE grid)

    @property
    def tokens(self) -> int:
        """Tokens the clip takes in the dialogue."""
        return len(self.token_ids)

    def to_json(self) -> dict:
        """What a session file keeps of the clip (its tokens and length, not its samples)."""
        return {"token_ids": self.token_ids, "offsets": self.offsets.tolist(), "seconds": self.seconds}

    @classmethod
    def from_json(cls, digest: str, data: dict) -> "PreparedClip":
        """A clip as a session file kept it: no samples (encoded again only from the feature cache)."""
        return cls(bytes.fromhex(digest), list(data["token_ids"]), torch.tensor(data["offsets"], dtype=torch.long),
                   {}, float(data["seconds"]), f"clip {digest[:12]}")


class AudioEncoder:
    """An audio-language engine's clips: features, placeholder expansion and the encoder."""

    def __init__(self, folder: Path, limits: AudioLimits | None = None,
                 cache_bytes: int = FEATURE_CACHE_BYTES) -> None:
        import transformers

        self.folder, self.limits = folder, limits or AudioLimits()
        self.config, self.processor, self.family = open_encoder_folder(folder, AUDIO_FAMILIES, "audio",
                                                                       transformers.AutoProcessor.from_pretrained)
        self.placeholder = getattr(self.processor, self.family.placeholder_key)
        self.audio_token_id = self.processor.tokenizer.convert_tokens_to_ids(self.placeholder)
        extractor = self.processor.feature_extractor
        self.window_seconds = extractor.n_samples / extractor.sampling_rate  # what one encoder pass hears
        self.features = FeatureCache(cache_bytes)
        self.transcripts: OrderedDict[bytes, str] = OrderedDict()  # by clip digest, as sessions had them heard

    @cached_property
    def model(self) -> torch.nn.Module:
        """The encoder and projector, loaded when a clip is first encoded (planning needs only the processor)."""
        import transformers

        with torch.inference_mode(False):
            return encoder_model(self.config, self.folder / AUDIO_WEIGHTS, self.family.prefixes,
                                 transformers.AutoModel.from_config)

    def check_count(self, count: int, where: str) -> None:
        """AudioError where ``where`` (a message) holds more clips than the cap."""
        if count > self.limits.max_clips:
            raise AudioError(f"{where} has {count} audio clips, over the cap of {self.limits.max_clips} per message; "
                             "send fewer")

    def audio_message(self, message: dict, clips: list[Clip], held: dict[str, PreparedClip]) -> dict:
        """The message with its clips before its text as audio parts (``{"type": "audio", "digest": hex}``), each
        prepared into ``held`` (by digest hex); AudioError naming the clip and the cap where one cannot be taken."""
        self.check_count(len(clips), "the message")
        prepared = [self.prepare(clip) for clip in clips]
        held.update({clip.digest.hex(): clip for clip in prepared})
        return media_message(message, "audio", [clip.digest for clip in prepared])

    def prepare(self, clip: Clip) -> PreparedClip:
        """The processor's features and placeholder expansion of one clip; its token count is known before anything
        is encoded. A clip longer than the encoder's window is refused (the processor would cut it)."""
        if clip.seconds > self.window_seconds:
            raise AudioError(f"{clip.name}: {clip.seconds:.1f} s of audio is over the {self.window_seconds:g} s the "
                             "model's audio encoder hears at once; cut it into shorter clips",
                             (Hint(Fix.SHORTER_AUDIO, f"{self.window_seconds:g} s"),))
        out = self.processor(text=[self.placeholder], audio=[clip.pcm], sampling_rate=SAMPLE_RATE,
                             return_tensors="pt", add_special_tokens=False)
        ids = out["input_ids"][0].tolist()
        offsets = torch.tensor([i for i, t in enumerate(ids) if t == self.audio_token_id])
        inputs = {key: out[key] for key in self.family.feature_inputs}
        return PreparedClip(clip.digest, ids, offsets, inputs, clip.seconds, clip.name)

    @torch.inference_mode()
    def encode(self, clip: PreparedClip) -> MediaRows:
        """The decoder's input rows of a prepared clip (from the feature cache when it was encoded before)."""
        gone = AudioError(f"audio clip {clip.digest.hex()[:12]} is needed again and its samples are not held (a "
                          "restored session keeps none); send the clip again")
        return self.features.rows(clip.digest, clip.offsets, clip.inputs, self._features, "audio", gone)

    def _features(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The encoder's output rows for one clip's processor tensors, as ``Qwen2AudioModel.forward`` computes them
        (transformers 5.25, models/qwen2_audio/modeling_qwen2_audio.py, its step 2 "Merge text and audios"): the
        encoder attends bidirectionally over the valid frames' conv outputs, the projector maps its pooled rows,
        the rows of the valid frames are kept."""
        from transformers.masking_utils import create_bidirectional_mask

        model, features, mask = self.model, inputs["input_features"], inputs["feature_attention_mask"]
        tower = model.audio_tower
        conv_lengths, lengths = tower._get_feat_extract_output_lengths(mask.sum(-1))
        positions = (features.shape[-1] - 2) // 2 + 1
        valid = (torch.arange(positions)[None, :] < conv_lengths[:, None]).long()
        attention = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(1, positions, 1),
                                              attention_mask=valid)
        hidden = tower(features.to(tower.conv1.weight.dtype), attention_mask=attention).last_hidden_state
        return model.multi_modal_projector(hidden)[0, :int(lengths[0])]
