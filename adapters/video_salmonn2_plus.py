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

Detection: model_type "video_salmonn2_plus", or a "qwen2_5_vl" config with an `audio_config` (the
released config.json). The resolve hook runs `tryfirst` so that the Qwen2.5-VL adapter, which also
matches model_type "qwen2_5_vl", never claims a video-SALMONN 2+ checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

from hippo import hookimpl
from hippo.errors import ConfigError, InputError
from hippo.interfaces import Encoded
from hippo.types import VisualTokens
from hippo_adapters.qwen2_5_vl import Qwen25VLAdapter, _batch1
from hippo_adapters.video_salmonn2_plus_model import (
    VideoSalmonn2PlusConfig,
    VideoSalmonn2PlusForConditionalGeneration,
    audio_inputs,
)
from hippo_adapters.video_salmonn2_plus_positions import POSITION_MODES, mrope_positions

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
        "hippo_adapters.video_salmonn2_plus_tiny"  # synthetic_inputs(..., audio=None | False | wave)
    )

    def _check_inputs(self, inputs: dict[str, Any]) -> None:
        if "input_ids" not in inputs:
            raise InputError("inputs have no input_ids; pass the mapping the model's processor returns")
        if inputs.get("pixel_values") is not None:
            raise InputError("video-SALMONN 2+ takes videos (pixel_values_videos) and audio, not images")

    @torch.inference_mode()
    def encode(self, inputs: dict[str, Any]) -> Encoded:
        self._check_inputs(inputs)
        model, cfg, dev = self.model, self.model.config, self.device
        ids = _batch1(inputs, "input_ids").to(dev)  # [L]
        feats = inputs.get("audio_feature")
        lengths = inputs.get("audio_lengths")
        embeds, audio = model.embed_prompt(
            ids[None], None if feats is None else feats.to(dev), None if lengths is None else lengths.to(dev)
        )
        embeds = embeds[0]  # [L, D]
        extras: dict[str, Any] = {}
        video = torch.zeros(0, embeds.shape[-1], dtype=embeds.dtype, device=dev)
        grids: tuple[tuple[int, int, int], ...] = ()
        video_pos = (ids == cfg.video_token_id).nonzero().flatten()  # [N]
        thw = inputs.get("video_grid_thw")
        if inputs.get("pixel_values_videos") is not None:
            if thw is None:
                raise InputError(
                    "inputs have pixel_values_videos but no video_grid_thw; pass the processor's output"
                )
            thw = thw.to(dev)
            extras["video"] = model.model.get_video_features(inputs["pixel_values_videos"].to(dev), thw)
            video = torch.cat(extras["video"].pooler_output).to(embeds.dtype)  # [N, D]
            m = self.spatial_merge
            grids = tuple((int(t), int(h) // m, int(w) // m) for t, h, w in thw.tolist())
        if video.shape[0] != video_pos.shape[0]:
            raise InputError(
                f"the prompt has {video_pos.shape[0]} video tokens but the video encodes to {video.shape[0]}; "
                "build input_ids and pixel values with the same processor call"
            )
        embeds = embeds.index_put((video_pos,), video)
        if audio is not None:
            extras["audio"] = audio  # [A, D]
            extras["audio_index"] = (ids == cfg.audio_token_id).nonzero().flatten()  # [A]
        positions = mrope_positions(
            ids.cpu(),
            cfg,
            None if thw is None else thw.cpu(),
            inputs.get("second_per_grid_ts"),
            self.positions,
        ).to(dev)  # [3, L]
        return Encoded(
            input_ids=ids,
            embeds=embeds,
            positions=positions,
            visual=VisualTokens(embeds=video, seq_index=video_pos, grids=grids),
            next_position=int(positions[0, -1]) + 1,  # generate(): last + 1
            extras=extras,
        )


@hookimpl
def hippo_register_adapters():
    return {VideoSalmonn2PlusAdapter.name: VideoSalmonn2PlusAdapter}


@hookimpl(tryfirst=True)
def hippo_resolve_adapter(config):
    return VideoSalmonn2PlusAdapter if VideoSalmonn2PlusAdapter.matches(config) else None
