"""Qwen3-VL on the stock `Qwen3VLForConditionalGeneration`.

Differences from Qwen2.5-VL that matter to pruning:
- Deepstack: the vision tower also emits per-layer features that are added to the visual rows of
  early decoder layers. The draft gets them pruned with the same kept indices, by handing the
  model pruned `mm_encoder_outputs` together with input_ids from which the pruned video
  placeholders are removed, so the model's own scatter and deepstack injection run unchanged.
- Each frame is preceded by `<t seconds>` timestamp text and wrapped in vision start/end tokens.
  Those are text: never scored, never pruned.
- Kept tokens keep their original interleaved M-RoPE positions (explicit position_ids).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers import Qwen3VLForConditionalGeneration
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

from hippo.adapters.hooks import adapter_hooks
from hippo.adapters.qwen2_5_vl import Qwen25VLAdapter
from hippo.interfaces import Encoded
from hippo.types import VideoClip


def _prune(out: Any, keep: torch.Tensor | None) -> BaseModelOutputWithDeepstackFeatures:
    """The vision output restricted to the kept visual tokens (all videos concatenated)."""
    pooled = torch.cat(out.pooler_output)  # [N, D]
    deep = [torch.cat(f) for f in out.deepstack_features]  # each [N, D]
    if keep is not None:
        keep = keep.to(pooled.device)
        pooled, deep = pooled[keep], [f[keep] for f in deep]
    return BaseModelOutputWithDeepstackFeatures(
        pooler_output=(pooled,), deepstack_features=[(f,) for f in deep]
    )


class Qwen3VLAdapter(Qwen25VLAdapter):
    name = "qwen3_vl"
    model_types = ("qwen3_vl",)
    model_class = Qwen3VLForConditionalGeneration

    tiny_module = "hippo.adapters.qwen3_vl_tiny"

    #: transformers' Qwen3-VL video processor defaults (pixels over all frames of the video).
    video_defaults: ClassVar[dict[str, Any]] = dict(
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        min_pixels=128 * 32 * 32,
        max_pixels=768 * 32 * 32,
    )
    pixel_budget: ClassVar[str] = "video"
    per_frame_text: ClassVar[bool] = True

    def _video_text(self, clip: VideoClip, t: int, per_frame: int, video: str, wrap: tuple[str, str]) -> str:
        """Per temporal patch: `<t seconds>` (when its frames were shown), then its wrapped video tokens."""
        temporal = self.model.config.vision_config.temporal_patch_size
        fps = clip.fps if clip.fps and clip.fps > 0 else 24.0
        idx = list(clip.indices)
        idx += [idx[-1]] * (-len(idx) % temporal)
        secs = [i / fps for i in idx]  # as transformers' Qwen3VLProcessor: mean of first and last
        stamps = [(secs[i] + secs[i + temporal - 1]) / 2 for i in range(0, len(secs), temporal)]
        if len(stamps) != t:
            raise ValueError(f"{len(stamps)} timestamps for a video grid of {t} temporal patches")
        return "".join(f"<{s:.1f} seconds>{wrap[0]}{video * per_frame}{wrap[1]}" for s in stamps)

    def _video_extras(self, clip: VideoClip) -> dict[str, Any]:
        return {}

    def _prefill_inputs(self, encoded: Encoded, mask: torch.Tensor | None) -> dict[str, Any]:
        """The token ids of the rows `mask` keeps [1, L'] and the vision encoder's outputs for the kept
        video tokens: the model embeds them itself (DeepStack also adds visual features inside the
        language model)."""
        ids = encoded.input_ids if mask is None else encoded.input_ids[mask]
        mm: dict[str, Any] = {}
        if "video" in encoded.extras:
            keep = None if mask is None else mask[encoded.visual.seq_index].nonzero().flatten()
            mm["video"] = _prune(encoded.extras["video"], keep)
        if "image" in encoded.extras:  # never pruned, but a prefill piece holds only some of them
            rows = (encoded.input_ids == self.model.config.image_token_id).nonzero().flatten()  # [I]
            keep = None if mask is None else mask[rows].nonzero().flatten()
            mm["image"] = _prune(encoded.extras["image"], keep)
        return {"input_ids": ids[None], "mm_encoder_outputs": mm or None}


hippo_register_adapters, hippo_resolve_adapter = adapter_hooks(Qwen3VLAdapter)
