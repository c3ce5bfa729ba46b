"""video-SALMONN 2+ (audio-visual, on Qwen2.5-VL) for hippo.

- `Encoded.visual` holds only the video tokens: audio tokens are never scored or pruned, the draft
  always receives all of them (HIPPO, Appendix B). `extras["audio"]` [A, D] and
  `extras["audio_index"]` [A] carry the audio embeddings and their sequence rows.
- The draft's prefill gets the text, all audio and the kept video tokens, each at its original
  position; decoding continues at the full prompt's last position + 1, as the class's `generate`.
- Positions: the adapter option `positions` ("released" | "training"; default: the model config's,
  itself "released" by default because the published checkpoints were evaluated with the released
  inference code). The reference is the class's own `generate`, which reads `config.positions`:
  set both the same way when comparing.
- From a video file (`hippo generate --video`, `load_video_inputs`): `build_inputs` needs the file's
  audio track and lays out what the released data pipeline builds (`video_salmonn2_plus_inputs`).

Detection: model_type "video_salmonn2_plus", or a "qwen2_5_vl" config with an `audio_config` (the
released config.json). The resolve hook runs `tryfirst` so that the Qwen2.5-VL adapter, which also
matches model_type "qwen2_5_vl", never claims a video-SALMONN 2+ checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

from hippo import hookimpl
from hippo.adapters.qwen2_5_vl import Qwen25VLAdapter, _batch1
from hippo.adapters.video_salmonn2_plus_inputs import clip_inputs, fit_audio, token_types
from hippo.adapters.video_salmonn2_plus_model import (
    VideoSalmonn2PlusConfig,
    VideoSalmonn2PlusForConditionalGeneration,
    audio_inputs,
    tokens_per_chunk,
)
from hippo.adapters.video_salmonn2_plus_positions import POSITION_MODES, mrope_positions
from hippo.errors import ConfigError, InputError, ModelError
from hippo.media.inputs import chat_text, expand_placeholder, sampled_fps, token_string, tokenize
from hippo.types import Items, VideoClip

ARCHITECTURES = ("video_SALMONN2_plus", VideoSalmonn2PlusForConditionalGeneration.__name__)

__all__ = [
    "VideoSalmonn2PlusAdapter",
    "VideoSalmonn2PlusConfig",
    "VideoSalmonn2PlusForConditionalGeneration",
    "audio_inputs",
]


class VideoSalmonn2PlusAdapter(Qwen25VLAdapter):
    name = "video_salmonn2_plus"
    model_types = (VideoSalmonn2PlusConfig.model_type,)
    model_class = VideoSalmonn2PlusForConditionalGeneration
    needs_audio = True  # the video's audio track is part of the prompt

    def __init__(self, model: torch.nn.Module, positions: str | None = None):
        super().__init__(model)
        if positions is not None and positions not in POSITION_MODES:
            raise ConfigError(
                f"video_salmonn2_plus: positions must be one of {POSITION_MODES}, got {positions!r}"
            )
        self.positions = positions or model.config.positions

    @classmethod
    def matches(cls, config: Any) -> bool:
        model_type = getattr(config, "model_type", None)
        if model_type in cls.model_types:
            return True
        archs = getattr(config, "architectures", None) or ()
        released = model_type == "qwen2_5_vl" and getattr(config, "audio_config", None) is not None
        return released or any(a in ARCHITECTURES for a in archs)

    tiny_module = (
        "hippo.adapters.video_salmonn2_plus_tiny"  # synthetic_inputs(..., audio=None | False | wave)
    )

    def build_inputs(  # as Adapter.build_inputs; audio [S] mono 16 kHz: the video's audio track
        self,
        tokenizer: Any,
        clip: VideoClip,
        prompt: str,
        *,
        max_pixels=None,
        video_processor=None,
        audio=None,
    ) -> dict[str, Any]:
        """The released data pipeline's inputs for a user turn [video with its audio, prompt].

        Frames and pixels are Qwen2.5-VL's (`video_pixels`); s = `second_per_grid_ts` = temporal
        patch / sampled fps. `audio` (`hippo.media.inputs.read_audio_track`) is required. It is fitted to the
        clip's duration, T / sampled fps (the whole file for `decode_video` clips): a shorter track is
        zero-padded at the end, a longer one (e.g. the encoder's trailing samples) trimmed. Its Whisper
        features give ceil(max(dur, 1 s) / 30 s) · 60 audio tokens, placed after the temporal grid
        steps' video tokens as `clip_ids` splits them. Returns input_ids, attention_mask,
        mm_token_type_ids, pixel_values_videos, video_grid_thw, second_per_grid_ts, audio_feature and
        audio_lengths: what `synthetic_inputs(..., audio=wave)` lays out for the same frames.
        """
        if audio is None:
            raise InputError(
                "video-SALMONN 2+ needs the video's audio track, but no audio was given (the video file has "
                "no audio track); pass a video file with sound, or its waveform as audio= "
                "(mono 16 kHz, hippo.media.inputs.read_audio_track(path))"
            )
        cfg = self.model.config
        pixels, grid = self.video_pixels(clip.frames, max_pixels, video_processor)  # [N_patch, D], [1, 3]
        second_per_grid = float(self._video_extras(clip)["second_per_grid_ts"][0])
        wave = fit_audio(audio, len(clip.indices) / sampled_fps(clip))
        block, tensors = clip_inputs(self.model, pixels, grid, second_per_grid, wave)
        names = {
            i: token_string(tokenizer, i, what)
            for i, what in (
                (cfg.vision_start_token_id, "vision start"),
                (cfg.vision_end_token_id, "vision end"),
                (cfg.video_token_id, "video"),
                (cfg.audio_token_id, "audio"),
            )
        }
        video = names[cfg.video_token_id]
        wrap = (names[cfg.vision_start_token_id], names[cfg.vision_end_token_id])
        text = expand_placeholder(chat_text(tokenizer, prompt), video, "".join(names[i] for i in block), wrap)
        n_video = block.count(cfg.video_token_id)
        ids = tokenize(tokenizer, text, cfg.video_token_id, n_video)  # [1, L]
        row = ids[0].tolist()
        start = row.index(cfg.video_token_id) - 1
        if row[start : start + len(block)] != block:
            n_audio, got = block.count(cfg.audio_token_id), row.count(cfg.audio_token_id)
            raise ModelError(
                f"the prompt tokenizes to {got} audio tokens, not the {n_audio} the audio needs after the "
                f"video's grid steps; the tokenizer does not treat {names[cfg.audio_token_id]!r} (id "
                f"{cfg.audio_token_id}) as one token: use the checkpoint's own tokenizer"
            )
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": token_types(ids, cfg),
            **tensors,
        }

    def batch_items(self, inputs: dict[str, Any]) -> list[Items]:
        """Qwen2.5-VL's videos, and the audio: clip i fills audio_lengths[i] placeholders and takes
        audio_lengths[i] / tokens-per-chunk chunks of `audio_feature`."""
        media = super().batch_items(inputs)
        lengths = inputs.get("audio_lengths")
        if lengths is not None:
            per_chunk = tokens_per_chunk(self.model.config.audio_config)
            n = [int(x) for x in lengths.reshape(-1).tolist()]
            extent = {"audio_feature": [x // per_chunk for x in n], "audio_lengths": [1] * len(n)}
            media.append(Items(self.model.config.audio_token_id, n, extent))
        return media

    def _check_inputs(self, inputs: dict[str, Any]) -> None:
        if "input_ids" not in inputs:
            raise InputError("inputs have no input_ids; pass the mapping the model's processor returns")
        if inputs.get("pixel_values") is not None:
            raise InputError("video-SALMONN 2+ takes videos (pixel_values_videos) and audio, not images")

    def _embed_prompt(
        self, inputs: dict[str, Any], ids: torch.Tensor, extras: dict[str, Any]
    ) -> torch.Tensor:  # ids [L] -> [L, D]
        """The text and the audio tokens' embeddings (the audio tokens and their rows in extras)."""
        dev = self.device
        feats = inputs.get("audio_feature")
        lengths = inputs.get("audio_lengths")
        embeds, audio = self.model.embed_prompt(
            ids[None], None if feats is None else feats.to(dev), None if lengths is None else lengths.to(dev)
        )
        if audio is not None:
            extras["audio"] = audio  # [A, D]
            extras["audio_index"] = (ids == self.model.config.audio_token_id).nonzero().flatten()  # [A]
        return embeds[0]

    def prompt_positions(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, int]:  # -> [3, L], next
        """The prompt's M-RoPE positions in this adapter's layout (no encoding); generate(): last + 1."""
        ids = _batch1(inputs, "input_ids")
        thw = inputs.get("video_grid_thw")
        positions = mrope_positions(
            ids.cpu(),
            self.model.config,
            None if thw is None else thw.cpu(),
            inputs.get("second_per_grid_ts"),
            self.positions,
        ).to(self.device)
        return positions, int(positions[0, -1]) + 1


@hookimpl
def hippo_register_adapters():
    return {VideoSalmonn2PlusAdapter.name: VideoSalmonn2PlusAdapter}


@hookimpl(tryfirst=True)
def hippo_resolve_adapter(config):
    return VideoSalmonn2PlusAdapter if VideoSalmonn2PlusAdapter.matches(config) else None
