"""LLaVA-OneVision on the stock `LlavaOnevisionForConditionalGeneration`.

Each video frame is pooled to a ceil(h/2) x ceil(w/2) patch grid (14x14 = 196 tokens at the released
resolution), and one learned newline token closes each video. Frame tokens are the visual tokens
that are scored and pruned; the newline is kept like text. Positions are 1-D:
- `positions="original"` (default): kept tokens keep their original positions, leaving gaps, and
  decoding continues at the full prompt's length;
- `positions="compact"`: the draft's kept tokens are renumbered 0..L'-1 and decoding continues at L'.

"original" is the default because it gives the higher acceptance, measured on a trained tiny pair
(`python -m hippo.benchmarks.llava_pair --measure`: 64 held-out videos of 128 frame tokens + newline,
serial SD with gamma 5, the draft trained on full inputs only, every output equal to
`target.generate`). MAT (tokens per verification), original vs compact: uniform 10% 3.24 vs 2.69
(compact lower by 0.55 +- 0.10 s.e.), holistic top-k 10% 2.55 vs 2.22 (0.32 +- 0.08), uniform 25%
3.17 vs 2.79, holistic top-k 25% 3.73 vs 3.18; the same (4.46) on the full video. With gaps every
kept pair of tokens stays at the distance it had in training (RoPE sees only distances);
renumbering shrinks the distances between the text and the kept frame tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from transformers import LlavaOnevisionForConditionalGeneration

from hippo.adapters.attention_readout import AttentionReadout
from hippo.adapters.hooks import adapter_hooks
from hippo.compat import cache_arg
from hippo.errors import ConfigError, InputError, UnsupportedError
from hippo.interfaces import Adapter, Encoded
from hippo.kvcache import slab_cache
from hippo.media.inputs import (
    chat_text,
    expand_placeholder,
    model_dir,
    processor_settings,
    resize_frames,
    token_string,
    tokenize,
)
from hippo.session import KVSession
from hippo.types import Items, VideoClip, VisualTokens

POSITIONS = ("original", "compact")


class LlavaOnevisionAdapter(AttentionReadout, Adapter):
    name = "llava_onevision"
    direct_steps = True  # logits = lm_head(language_model(...)) (also Qwen3-VL, video-SALMONN 2+)
    model_types = ("llava_onevision",)
    model_class = LlavaOnevisionForConditionalGeneration

    def __init__(self, model: torch.nn.Module, positions: str = "original"):
        super().__init__(model)
        if positions not in POSITIONS:
            raise ConfigError(f"positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
        self.positions = positions

    tiny_module = "hippo.adapters.llava_onevision_tiny"

    #: transformers' LLaVA-OneVision video processor normalisation (OpenAI CLIP).
    video_defaults: ClassVar[dict[str, Any]] = dict(
        image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711)
    )

    def build_inputs(
        self,
        tokenizer: Any,
        clip: VideoClip,  # frames [T, H, W, 3] uint8
        prompt: str,
        *,
        max_pixels: int | None = None,  # unused: frames are resized to the vision tower's square input
        video_processor: Any = None,
        audio: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """What the LLaVA-OneVision processor returns for a user turn [video, prompt]."""
        if audio is not None:
            raise UnsupportedError(f"adapter {self.name!r} takes no audio")
        cfg = self.model.config
        pixels = self.video_pixels(clip.frames, video_processor)  # [1, T, 3, S, S]
        h, w = self.frame_grid()
        n = pixels.shape[1] * h * w + 1  # + the newline token that closes the video
        video = token_string(tokenizer, cfg.video_token_id)
        text = expand_placeholder(chat_text(tokenizer, prompt), video, video * n)
        ids = tokenize(tokenizer, text, cfg.video_token_id, n)  # [1, L]
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "pixel_values_videos": pixels.to(self.model.dtype),
        }

    def video_pixels(
        self,
        frames: torch.Tensor,
        video_processor: Any = None,  # frames [T, H, W, 3] uint8
    ) -> torch.Tensor:  # -> [1, T, 3, S, S] normalised, S = the vision tower's image size
        size = int(self.model.config.vision_config.image_size)
        if video_processor is not None:
            out = video_processor(
                videos=[frames.permute(0, 3, 1, 2)], size={"height": size, "width": size}, return_tensors="pt"
            )
            return out["pixel_values_videos"]
        s = {**self.video_defaults, **processor_settings(model_dir(self.model))}
        x = resize_frames(frames, size, size)  # [T, S, S, 3] in [0, 1]
        x = (x - torch.tensor(s["image_mean"])) / torch.tensor(s["image_std"])
        return x.permute(0, 3, 1, 2)[None]

    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def context_length(self) -> int:
        return int(self.model.config.get_text_config().max_position_embeddings)

    def frame_grid(self) -> tuple[int, int]:
        side = self.model.config.vision_config.image_size // self.model.config.vision_config.patch_size
        return math.ceil(side / 2), math.ceil(side / 2)

    def batch_items(self, inputs: dict[str, Any]) -> list[Items]:
        """Videos: each fills T·h·w + 1 placeholders (its frames' pooled grids and a newline) and takes
        one entry of pixel_values_videos [videos, T, 3, H, W]."""
        pv = inputs.get("pixel_values_videos")
        if pv is None:
            return []
        h, w = self.frame_grid()
        n = int(pv.shape[0])
        return [
            Items(
                self.model.config.video_token_id,
                [pv.shape[1] * h * w + 1] * n,
                {"pixel_values_videos": [1] * n},
            )
        ]

    @torch.inference_mode()
    def encode(self, inputs: dict[str, Any]) -> Encoded:
        if "input_ids" not in inputs:
            raise InputError("inputs have no input_ids; pass the mapping the model's processor returns")
        cfg, dev = self.model.config, self.device
        ids = inputs["input_ids"][0].to(dev)
        embeds = self.model.get_input_embeddings()(ids)  # [L, D]
        slots = (ids == cfg.video_token_id).nonzero().flatten()
        visual_idx, grids = [], []
        if inputs.get("pixel_values_videos") is not None:
            pv = inputs["pixel_values_videos"].to(dev, self.model.dtype)  # [B_videos, T, 3, H, W]
            out = self.model.model.get_video_features(
                pv,
                vision_feature_layer=cfg.vision_feature_layer,
                vision_feature_select_strategy=cfg.vision_feature_select_strategy,
            ).pooler_output  # [B_videos, T*h*w + 1, D]
            if out.shape[0] * out.shape[1] != slots.shape[0]:
                raise InputError(
                    f"the prompt has {slots.shape[0]} video tokens but the videos encode to "
                    f"{out.shape[0] * out.shape[1]}; build input_ids and pixel values with the same processor call"
                )
            embeds = embeds.index_put((slots,), out.reshape(-1, out.shape[-1]).to(embeds.dtype))
            h, w = self.frame_grid()
            per_video = out.shape[1]
            for v in range(out.shape[0]):
                block = slots[v * per_video : (v + 1) * per_video]
                visual_idx.append(block[:-1])  # the trailing newline is not a visual token
                grids.append((pv.shape[1], h, w))
        seq_index = torch.cat(visual_idx) if visual_idx else torch.zeros(0, dtype=torch.long, device=dev)
        visual = VisualTokens(embeds=embeds[seq_index], seq_index=seq_index, grids=tuple(grids))
        L = ids.shape[0]
        positions = torch.arange(L, device=dev)[None]
        return Encoded(input_ids=ids, embeds=embeds, positions=positions, visual=visual, next_position=L)

    def prompt_positions(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, int]:  # -> [1, L], L
        L = int(inputs["input_ids"].shape[-1])
        return torch.arange(L, device=self.device)[None], L

    @torch.inference_mode()
    def prefill(self, encoded: Encoded, keep: torch.Tensor | None) -> KVSession:
        L = encoded.length
        embeds, positions = encoded.embeds, encoded.positions
        if keep is not None:
            mask = torch.ones(L, dtype=torch.bool, device=embeds.device)
            mask[encoded.visual.seq_index] = False
            mask[encoded.visual.seq_index[keep.to(mask.device)]] = True
            embeds, positions = embeds[mask], positions[:, mask]
            if self.positions == "compact":
                positions = torch.arange(embeds.shape[0], device=embeds.device)[None]
        cache = slab_cache(self.model.config)
        logits = self._prefill_logits(embeds, positions, cache)
        return self._session(L, int(positions[0, -1]) + 1, cache, logits)

    def prefill_pieces(
        self, encoded: Encoded, rows: int, around: Callable[[int, int], AbstractContextManager]
    ) -> Iterator[KVSession | None]:
        """The full prompt's prefill in pieces of `rows` rows (see `Adapter.prefill_pieces`)."""
        L = encoded.length
        cache = slab_cache(self.model.config, reserve=L)  # allocated once: no second copy
        for start in range(0, L, rows):
            end = min(start + rows, L)
            with around(start, end), torch.inference_mode():
                logits = self._prefill_logits(
                    encoded.embeds[start:end], encoded.positions[:, start:end], cache
                )
            if end < L:
                yield None
        yield self._session(L, int(encoded.positions[0, -1]) + 1, cache, logits)

    def _prefill_logits(self, embeds: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """The logits [V] after a forward of `embeds` [L', D] at `positions` [1, L'] on `cache`."""
        out = self.model(
            inputs_embeds=embeds[None],
            position_ids=positions,
            **cache_arg(cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1]

    def _session(self, L: int, next_position: int, cache: Any, logits: torch.Tensor) -> KVSession:
        delta = next_position - L

        def decode_positions(start: int, k: int) -> torch.Tensor:  # -> [1, k]
            return (torch.arange(start, start + k) + delta)[None]

        return KVSession(self.model, cache, logits, L, L, decode_positions, direct=self.direct_steps)


hippo_register_adapters, hippo_resolve_adapter = adapter_hooks(LlavaOnevisionAdapter)
