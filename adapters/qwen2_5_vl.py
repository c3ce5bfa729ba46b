"""Qwen2.5-VL on the stock `Qwen2_5_VLForConditionalGeneration`, driven from the outside.

The draft receives the text embeddings plus only the kept visual embeddings; every kept token keeps
its original 3-D M-RoPE position, and decode positions continue from the full prompt's last
position + 1, exactly as `generate()` does in transformers 5.23 (not max(position) + 1, which
differs when a video's time positions run past the text after it). Positions are
always passed explicitly, so the `rope_deltas` state that transformers keeps on the model object is
never read: the target and the draft may be the very same object (self-speculation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from hippo import hookimpl
from hippo.adapters.attention_readout import AttentionReadout
from hippo.compat import cache_arg
from hippo.errors import InputError, UnsupportedError
from hippo.interfaces import Adapter, Encoded
from hippo.kvcache import slab_cache
from hippo.media.inputs import (
    chat_text,
    expand_placeholder,
    model_dir,
    processor_settings,
    resize_frames_uint8,
    sampled_fps,
    smart_resize,
    token_string,
    tokenize,
)
from hippo.session import KVSession
from hippo.types import Items, VideoClip, VisualTokens

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def frames_to_pixel_values(
    video: torch.Tensor,  # [T, H, W, 3] floats in [0, 1], or uint8; H, W multiples of 28
    patch: int = 14,
    temporal: int = 2,
    merge: int = 2,
    mean: tuple[float, float, float] = CLIP_MEAN,
    std: tuple[float, float, float] = CLIP_STD,
) -> tuple[torch.Tensor, torch.Tensor]:  # -> pixel_values_videos [t*h*w, 3*temporal*patch*patch], grid [1, 3]
    """Frames laid out exactly as transformers' Qwen2-VL video processor lays them out.

    Temporal patch 2, patch 14, 2x2 merge windows kept contiguous, normalised with `mean`/`std`.
    Used when no video processor is saved with the checkpoint: that processor needs torchvision,
    which has no CPU wheel matching this project's torch. uint8 frames are laid out as bytes and then
    normalised in place, ((x / 255) - mean) / std: the same float32 operations, so the same values as
    from `x.float() / 255`, in a quarter of the memory traffic of the float path.
    """
    T, H, W, _ = video.shape
    if T % temporal:  # the processor repeats the last frame to fill the temporal patch
        video = torch.cat([video, video[-1:].expand(temporal - T % temporal, -1, -1, -1)])
        T = video.shape[0]
    gt, gh, gw = T // temporal, H // patch, W // patch
    x = video.reshape(gt, temporal, gh // merge, merge, patch, gw // merge, merge, patch, 3)
    x = x.permute(0, 2, 5, 3, 6, 8, 1, 4, 7)  # t, h/m, w/m, m, m, C, temporal, p, p
    x = x.reshape(gt * gh * gw, 3, temporal * patch * patch)
    mean_, std_ = torch.tensor(mean)[:, None], torch.tensor(std)[:, None]  # [3, 1]
    if video.dtype == torch.uint8:  # normalised in place on the float copy of the laid-out bytes
        x = x.float().div_(255.0).sub_(mean_).div_(std_)
    else:
        x = (x.float() - mean_) / std_
    return x.reshape(gt * gh * gw, 3 * temporal * patch * patch), torch.tensor([[gt, gh, gw]])


def _batch1(inputs: dict[str, Any], key: str) -> torch.Tensor:
    x = inputs[key]
    if x.dim() != 2 or x.shape[0] != 1:
        raise InputError(f"{key} must have shape [1, L] (batch size 1), got {tuple(x.shape)}")
    return x[0]


class Qwen25VLAdapter(AttentionReadout, Adapter):
    name = "qwen2_5_vl"
    direct_steps = True  # logits = lm_head(language_model(...)) (also Qwen3-VL, video-SALMONN 2+)
    model_types = ("qwen2_5_vl",)
    model_class = Qwen2_5_VLForConditionalGeneration

    tiny_module = "hippo.adapters.qwen2_5_vl_tiny"

    # ---- inputs from a video file ------------------------------------------------------------
    #: transformers' Qwen2-VL video processor defaults (pixels per frame).
    video_defaults: ClassVar[dict[str, Any]] = dict(
        image_mean=CLIP_MEAN, image_std=CLIP_STD, min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28
    )
    #: "frame": the pixel limits are per frame (Qwen2.5-VL); "video": over all frames (Qwen3-VL).
    pixel_budget: ClassVar[str] = "frame"
    #: Whether `_video_text` wraps each frame itself (Qwen3-VL), replacing the template's start/end tokens.
    per_frame_text: ClassVar[bool] = False

    def build_inputs(
        self,
        tokenizer: Any,
        clip: VideoClip,  # frames [T, H, W, 3] uint8
        prompt: str,
        *,
        max_pixels: int | None = None,  # per frame; sides become multiples of patch x merge (28)
        video_processor: Any = None,
        audio: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """What the Qwen processor returns for a user turn [video, prompt] with the generation prompt."""
        if audio is not None:
            raise UnsupportedError(
                f"adapter {self.name!r} cannot build audio-visual inputs from a video file yet; run the "
                "model's own processor and call Pipeline.generate(inputs)"
            )
        cfg, m = self.model.config, self.spatial_merge
        pixels, grid = self.video_pixels(clip.frames, max_pixels, video_processor)  # [N_patch, D], [1, 3]
        t, h, w = (int(v) for v in grid[0])
        per_frame = h * w // m**2
        video = token_string(tokenizer, cfg.video_token_id)
        wrap = (
            token_string(tokenizer, cfg.vision_start_token_id),
            token_string(tokenizer, cfg.vision_end_token_id),
        )
        replacement = self._video_text(clip, t, per_frame, video, wrap)
        text = expand_placeholder(
            chat_text(tokenizer, prompt), video, replacement, wrap if self.per_frame_text else None
        )
        ids = tokenize(tokenizer, text, cfg.video_token_id, t * per_frame)  # [1, L]
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == cfg.video_token_id).long() * 2,
            "pixel_values_videos": pixels.to(self.model.dtype),
            "video_grid_thw": grid,
            **self._video_extras(clip),
        }

    def _video_text(self, clip: VideoClip, t: int, per_frame: int, video: str, wrap: tuple[str, str]) -> str:
        """What replaces the chat template's video placeholder (Qwen2.5-VL: the video tokens only)."""
        return video * (t * per_frame)

    def _video_extras(self, clip: VideoClip) -> dict[str, Any]:
        temporal = self.model.config.vision_config.temporal_patch_size
        return {"second_per_grid_ts": torch.tensor([temporal / sampled_fps(clip)])}

    def video_pixels(
        self,
        frames: torch.Tensor,  # [T, H, W, 3] uint8
        max_pixels: int | None = None,
        video_processor: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # -> pixel_values_videos [N_patch, D], video_grid_thw [1, 3]
        """Resize (sides multiples of patch x merge, pixels <= max_pixels) and lay out as the processor does."""
        vc = self.model.config.vision_config
        patch, merge, temporal = int(vc.patch_size), int(vc.spatial_merge_size), int(vc.temporal_patch_size)
        T, H, W = (int(v) for v in frames.shape[:3])
        video_budget = self.pixel_budget == "video"
        t_bar = max(temporal, round(T / temporal) * temporal)
        if video_processor is not None:
            kwargs: dict[str, Any] = {"do_sample_frames": False, "return_tensors": "pt"}
            if max_pixels is not None:
                budget = max_pixels * (t_bar if video_budget else 1)
                size = video_processor.size
                shortest = (size.get("shortest_edge") if isinstance(size, dict) else None) or getattr(
                    size, "shortest_edge", None
                )
                shortest = shortest or budget
                kwargs["size"] = {"shortest_edge": min(shortest, budget), "longest_edge": budget}
            out = video_processor(videos=[frames.permute(0, 3, 1, 2)], **kwargs)
            return out["pixel_values_videos"], out["video_grid_thw"].long()
        s = {**self.video_defaults, **processor_settings(model_dir(self.model))}
        lo, hi = int(s["min_pixels"]), int(s["max_pixels"])
        if max_pixels is not None:
            hi = max_pixels * (t_bar if video_budget else 1)
        if video_budget:
            h, w = smart_resize(H, W, patch * merge, lo, hi, frames=max(T, temporal), temporal=temporal)
        else:
            h, w = smart_resize(H, W, patch * merge, lo, hi)
        x = resize_frames_uint8(frames, h, w)  # [T, h, w, 3] uint8
        return frames_to_pixel_values(
            x, patch, temporal, merge, tuple(s["image_mean"]), tuple(s["image_std"])
        )

    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def context_length(self) -> int:
        return int(self.model.config.get_text_config().max_position_embeddings)

    @property
    def spatial_merge(self) -> int:
        return int(self.model.config.vision_config.spatial_merge_size)

    def batch_items(self, inputs: dict[str, Any]) -> list[Items]:
        """Videos and images: item i fills t·h·w / merge² placeholders and takes t·h·w pixel rows and
        one row of its grid (and of `second_per_grid_ts`)."""
        cfg, media = self.model.config, []
        for token, pixels, grid, extra in (
            (cfg.video_token_id, "pixel_values_videos", "video_grid_thw", ("second_per_grid_ts",)),
            (cfg.image_token_id, "pixel_values", "image_grid_thw", ()),
        ):
            if inputs.get(pixels) is None:
                continue
            if inputs.get(grid) is None:
                raise InputError(f"inputs have {pixels} but no {grid}; pass the processor's output")
            patches = [int(t * h * w) for t, h, w in inputs[grid].tolist()]
            ones = [1] * len(patches)
            extent = {pixels: patches, grid: ones, **{k: ones for k in extra}}
            media.append(Items(token, [n // self.spatial_merge**2 for n in patches], extent))
        return media

    def _check_inputs(self, inputs: dict[str, Any]) -> None:
        if "input_ids" not in inputs:
            raise InputError("inputs have no input_ids; pass the mapping the model's processor returns")
        has_visual = inputs.get("pixel_values_videos") is not None or inputs.get("pixel_values") is not None
        if has_visual and inputs.get("mm_token_type_ids") is None:
            raise InputError(
                "inputs have pixel values but no mm_token_type_ids; without them transformers silently "
                "uses 1-D positions. Pass the processor's full output (it returns mm_token_type_ids)"
            )

    @torch.inference_mode()
    def encode(self, inputs: dict[str, Any]) -> Encoded:
        self._check_inputs(inputs)
        ids = _batch1(inputs, "input_ids").to(self.device)  # [L]
        extras: dict[str, Any] = {}
        embeds = self._embed_prompt(inputs, ids, extras)  # [L, D]
        embeds, visual = self._embed_video(inputs, ids, embeds, extras)
        positions, next_pos = self.prompt_positions(inputs)  # [3, L]
        return Encoded(
            input_ids=ids,
            embeds=embeds,
            positions=positions,
            visual=visual,
            next_position=next_pos,
            extras=extras,
        )

    def _embed_prompt(
        self, inputs: dict[str, Any], ids: torch.Tensor, extras: dict[str, Any]
    ) -> torch.Tensor:  # ids [L] -> [L, D]
        """The prompt's embeddings, but for the video tokens (`_embed_video` fills them): the text, and
        the images, which are passed through and never pruned (their encoder output in extras["image"])."""
        core, dev = self.model.model, self.device
        embeds = core.get_input_embeddings()(ids)  # [L, D]
        if inputs.get("pixel_values") is not None:
            feats = core.get_image_features(inputs["pixel_values"].to(dev), inputs["image_grid_thw"].to(dev))
            extras["image"] = feats
            image_pos = (ids == self.model.config.image_token_id).nonzero().flatten()
            embeds = embeds.index_put((image_pos,), torch.cat(feats.pooler_output).to(embeds.dtype))
        return embeds

    def _embed_video(
        self,
        inputs: dict[str, Any],
        ids: torch.Tensor,  # [L]
        embeds: torch.Tensor,  # [L, D]
        extras: dict[str, Any],
    ) -> tuple[torch.Tensor, VisualTokens]:  # -> [L, D], the N video tokens
        """Encode the video and put its N tokens into `embeds` at the video placeholders; the vision
        encoder's output goes to extras["video"]."""
        dev = self.device
        video = torch.zeros(0, embeds.shape[-1], dtype=embeds.dtype, device=dev)  # [N, D]
        grids: tuple[tuple[int, int, int], ...] = ()
        video_pos = (ids == self.model.config.video_token_id).nonzero().flatten()  # [N]
        if inputs.get("pixel_values_videos") is not None:
            thw = inputs.get("video_grid_thw")
            if thw is None:
                raise InputError(
                    "inputs have pixel_values_videos but no video_grid_thw; pass the processor's output"
                )
            thw = thw.to(dev)
            extras["video"] = self.model.model.get_video_features(inputs["pixel_values_videos"].to(dev), thw)
            video = torch.cat(extras["video"].pooler_output).to(embeds.dtype)
            m = self.spatial_merge
            grids = tuple((int(t), int(h) // m, int(w) // m) for t, h, w in thw.tolist())
        if video.shape[0] != video_pos.shape[0]:
            raise InputError(
                f"the prompt has {video_pos.shape[0]} video tokens but the video encodes to {video.shape[0]}; "
                "build input_ids and pixel values with the same processor call"
            )
        visual = VisualTokens(embeds=video, seq_index=video_pos, grids=grids)
        return embeds.index_put((video_pos,), video), visual

    @torch.inference_mode()
    def prompt_positions(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, int]:  # -> [3, L], next
        """M-RoPE positions of the whole prompt (no vision encoding), and generate()'s next position."""
        core, dev = self.model.model, self.device
        ids = _batch1(inputs, "input_ids").to(dev)
        mm_types = inputs.get("mm_token_type_ids")
        if mm_types is None:  # text only: transformers uses plain 1-D positions
            return torch.arange(ids.shape[0], device=dev).expand(3, -1), ids.shape[0]
        positions, _ = core.get_rope_index(
            ids[None],
            mm_token_type_ids=mm_types.to(dev),
            image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs.get("video_grid_thw"),
            second_per_grid_ts=inputs.get("second_per_grid_ts"),
        )
        return positions[:, 0], int(positions[0, 0, -1]) + 1  # generate(): last + 1

    @staticmethod
    def keep_mask(encoded: Encoded, keep: torch.Tensor | None) -> torch.Tensor | None:  # -> [L] bool
        """Sequence rows the draft sees: every non-visual token plus the kept visual ones."""
        if keep is None:
            return None
        mask = torch.ones(encoded.length, dtype=torch.bool, device=encoded.embeds.device)
        mask[encoded.visual.seq_index] = False
        mask[encoded.visual.seq_index[keep.to(mask.device)]] = True
        return mask

    def _prefill_logits(
        self,
        encoded: Encoded,
        mask: torch.Tensor | None,  # [L] bool: the rows the model reads; None: all
        cache: Any,
    ) -> torch.Tensor:  # -> [V]
        positions = encoded.positions if mask is None else encoded.positions[:, mask]  # [3, L']
        out = self.model(
            **self._prefill_inputs(encoded, mask),
            position_ids=positions[:, None, :],
            **cache_arg(cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1]

    def _prefill_inputs(self, encoded: Encoded, mask: torch.Tensor | None) -> dict[str, Any]:
        """The model's inputs for the rows `mask` keeps: here the prompt's embeddings [1, L', D]."""
        embeds = encoded.embeds if mask is None else encoded.embeds[mask]
        return {"inputs_embeds": embeds[None]}

    @torch.inference_mode()
    def prefill(self, encoded: Encoded, keep: torch.Tensor | None) -> KVSession:
        cache = slab_cache(self.model.config)
        return self._session(
            encoded, cache, self._prefill_logits(encoded, self.keep_mask(encoded, keep), cache)
        )

    def prefill_pieces(
        self, encoded: Encoded, rows: int, around: Callable[[int, int], AbstractContextManager]
    ) -> Iterator[KVSession | None]:
        """The full prompt's prefill in pieces of `rows` rows (see `Adapter.prefill_pieces`): each piece
        is the rows [start, end) of the prompt, at their own positions, on the cache of the pieces before."""
        L = encoded.length
        cache = slab_cache(self.model.config, reserve=L)  # allocated once: no second copy
        for start in range(0, L, rows):
            end = min(start + rows, L)
            piece = None  # [L] bool: the piece's rows (None: all)
            if end - start < L:
                piece = torch.zeros(L, dtype=torch.bool, device=encoded.embeds.device)
                piece[start:end] = True
            with around(start, end), torch.inference_mode():
                logits = self._prefill_logits(encoded, piece, cache)
            if end < L:
                yield None
        yield self._session(encoded, cache, logits)

    def _session(self, encoded: Encoded, cache: Any, logits: torch.Tensor) -> KVSession:  # logits [V]
        L = encoded.length
        delta = encoded.next_position - L

        def decode_positions(start: int, k: int) -> torch.Tensor:  # -> [3, 1, k]
            return (torch.arange(start, start + k) + delta).view(1, 1, k).expand(3, 1, k)

        return KVSession(self.model, cache, logits, L, L, decode_positions, direct=self.direct_steps)


@hookimpl
def hippo_register_adapters():
    return {Qwen25VLAdapter.name: Qwen25VLAdapter}


@hookimpl
def hippo_resolve_adapter(config):
    audio = getattr(config, "audio_config", None) is not None  # video-SALMONN2+ builds on Qwen2.5-VL
    return Qwen25VLAdapter if Qwen25VLAdapter.matches(config) and not audio else None
