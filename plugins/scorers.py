"""Vision-side scorers (paper §5.1): temporal redundancy (eqs. 3-4), spatial redundancy (eqs. 5-6),
and the holistic fusion (eq. 7) of those with the attention score.

All three work video by video (temporal neighbours never cross a video boundary) and stream over
frames in chunks of about `chunk_tokens` tokens, so their extra memory stays a small multiple of one
chunk, whatever the video length. Cosines are computed in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import torch

from hippo import hookimpl
from hippo.errors import ConfigError
from hippo.interfaces import Adapter, Encoded, Scorer, ScoringContext
from hippo.plugins.attention import QUERY_MODES, SOFTMAX_MODES, AttentionScorer
from hippo.types import VisualTokens
from hippo.validators import layer_indices, one_of, optional_int_tuple, positive_int, positive_number
from hippo.visual import Video, compute_dtype, frames_per_chunk, videos

EPS = 1e-12  # norm floor: a zero embedding has cosine 0 with everything


def _frames(visual: VisualTokens, video: Video, f0: int, f1: int) -> torch.Tensor:  # -> [f1-f0, h*w, D]
    x = visual.embeds[video.start + f0 * video.frame_size : video.start + f1 * video.frame_size]
    return x.to(compute_dtype(x.dtype)).reshape(f1 - f0, video.frame_size, -1)


class _MemoizedScorer(Scorer):
    """A scorer whose score depends on the visual tokens only (`_score`): kept in the context's
    per-video memo, so a video context computes it once."""

    def score(self, visual: VisualTokens, context: ScoringContext | None = None) -> torch.Tensor:  # -> [N]
        memo = None if context is None else context.memo
        if memo is None:
            return self._score(visual)
        key = (type(self).__qualname__, self.config, id(visual))
        if key not in memo:
            memo[key] = self._score(visual)
        return memo[key]

    def _score(self, visual: VisualTokens) -> torch.Tensor:  # -> [N]
        raise NotImplementedError


# ---- temporal (eqs. 3-4) --------------------------------------------------------------------


class TemporalScorer(_MemoizedScorer):
    """s_temp = 1 - mean cosine with the same (row, col) token in the adjacent frames of the same video.

    First and last frames have one neighbour. A single-frame video has no temporal evidence: its
    tokens score 0 (no change), which also z-normalises to 0 in the holistic score.
    """

    @attrs.frozen
    class Config:
        #: frames are streamed in chunks of about this many tokens (bounds the extra memory)
        chunk_tokens: int = attrs.field(default=32768, validator=positive_int)

    @torch.inference_mode()
    def _score(self, visual: VisualTokens) -> torch.Tensor:  # -> [N]
        dtype = compute_dtype(visual.embeds.dtype)
        out = torch.zeros(visual.n, dtype=dtype, device=visual.embeds.device)
        for v in videos(visual):
            if v.t < 2:
                continue  # single frame: 0 by definition
            sim = self._adjacent_cosines(visual, v)  # [t-1, hw]
            total = torch.zeros(v.t, v.frame_size, dtype=dtype, device=out.device)
            count = torch.zeros(v.t, 1, dtype=dtype, device=out.device)
            total[:-1] += sim  # neighbour f+1
            total[1:] += sim  # neighbour f-1
            count[:-1] += 1
            count[1:] += 1
            out[v.start : v.stop] = (1 - total / count).reshape(-1)
        return out

    def _adjacent_cosines(self, visual: VisualTokens, v: Video) -> torch.Tensor:  # -> [t-1, h*w]
        step = frames_per_chunk(v.frame_size, self.config.chunk_tokens)
        parts = []
        for f0 in range(0, v.t - 1, step):
            f1 = min(f0 + step, v.t - 1)
            x = _frames(visual, v, f0, f1 + 1)  # [b+1, hw, D], one frame of overlap
            a, b = x[:-1].reshape(-1, 1, x.shape[-1]), x[1:].reshape(-1, x.shape[-1], 1)
            dot = torch.bmm(a, b).reshape(f1 - f0, v.frame_size)  # no [.., D] temporary
            norm = torch.linalg.vector_norm(x, dim=-1)  # [b+1, hw]
            parts.append(dot / (norm[:-1] * norm[1:]).clamp_min(EPS))
        return torch.cat(parts)


# ---- spatial (eqs. 5-6) ---------------------------------------------------------------------

CROP_MODES = ("tile", "window")


def _crop_variance(
    gram: torch.Tensor,  # [B, R, K] raw dot products of R query tokens with K band tokens
    nq: torch.Tensor,  # [B, R] norms of the query tokens
    nk: torch.Tensor,  # [B, K] norms of the band tokens
    idx: torch.Tensor,  # [R, P] long: band token of each crop slot of each query
    wt: torch.Tensor,  # [R, P] 1.0 where that slot is a real crop member, 0.0 for padding
) -> torch.Tensor:  # -> [B, R] variance of each query's cosine row over its crop
    g = torch.gather(gram, 2, idx.expand(gram.shape[0], -1, -1))  # [B, R, P]
    cos = g / (nq[:, :, None] * nk[:, idx]).clamp_min(EPS)
    m = wt.sum(-1)  # [R], >= 1: a token is always in its own crop
    mean = (cos * wt).sum(-1) / m
    return (((cos - mean[..., None]) ** 2) * wt).sum(-1) / m


def _tile_slots(rows: int, w: int, M: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Crop slots of each token of a band of `rows` tile rows: [rows*w, rows*M] band indices and validity.

    The token in band row i, column c belongs to the tile of columns c0 .. c0+M-1 (c0 = c // M * M):
    its slots are every band row x those columns; columns past the frame edge are padding.
    """
    slot_col = (torch.arange(w, device=dev) // M * M)[:, None] + torch.arange(M, device=dev)  # [w, M]
    ok = slot_col < w
    slot = torch.arange(rows, device=dev)[None, :, None] * w + slot_col.clamp_max(w - 1)[:, None, :]
    idx = slot.reshape(w, rows * M).repeat(rows, 1)  # query i*w + c -> the slots of column c
    wt = ok[:, None, :].expand(w, rows, M).reshape(w, rows * M).repeat(rows, 1)
    return idx, wt


class SpatialScorer(_MemoizedScorer):
    """s_spa = variance of a token's cosine-similarity row inside its M×M crop (self included, eq. 6).

    crop_mode "tile" (default, the paper's crops c): each frame is partitioned into M×M crops from the
    top-left corner; crops at the right/bottom edge are clipped to the frame and hold fewer tokens
    (their M is the number of tokens they hold; a 1-token crop has variance 0).
    crop_mode "window": each token's crop is the M×M window around it, clipped at the frame border.

    Both are computed without copying the embeddings: Gram matrices of contiguous bands of frame rows
    (a band of up to M rows against itself, or one row against the up-to-M rows around it) come from
    batched matmuls over the frames of a chunk, and a geometric mask keeps each token's crop. That
    costs about w/M times the minimal flops but streams the embeddings once, which is what matters.
    """

    @attrs.frozen
    class Config:
        crop: int = attrs.field(default=5, validator=positive_int)
        crop_mode: str = attrs.field(default="tile", validator=one_of(*CROP_MODES))
        chunk_tokens: int = attrs.field(default=16384, validator=positive_int)

    @torch.inference_mode()
    def _score(self, visual: VisualTokens) -> torch.Tensor:  # -> [N]
        dtype = compute_dtype(visual.embeds.dtype)
        out = torch.zeros(visual.n, dtype=dtype, device=visual.embeds.device)
        fn = self._tiles if self.config.crop_mode == "tile" else self._windows
        for v in videos(visual):
            step = frames_per_chunk(v.frame_size, self.config.chunk_tokens)
            for f0 in range(0, v.t, step):
                f1 = min(f0 + step, v.t)
                x = _frames(visual, v, f0, f1).contiguous()  # [b, h*w, D]
                s = fn(x, v.h, v.w)  # [b, h*w]
                a = v.start + f0 * v.frame_size
                out[a : a + s.numel()] = s.reshape(-1)
        return out

    def _tiles(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:  # [b, h*w, D] -> [b, h*w]
        M = self.config.crop
        norm = torch.linalg.vector_norm(x, dim=-1)  # [b, h*w]
        out = torch.empty_like(norm)
        for y0 in range(0, h, M):  # one band of tile rows at a time, batched over frames
            rows = min(M, h - y0)
            a, z = y0 * w, (y0 + rows) * w
            band = x[:, a:z]  # [b, rows*w, D] view
            gram = torch.bmm(band, band.transpose(1, 2))  # [b, R, R]
            idx, wt = _tile_slots(rows, w, M, x.device)
            out[:, a:z] = _crop_variance(gram, norm[:, a:z], norm[:, a:z], idx, wt.to(x.dtype))
        return out

    def _windows(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:  # [b, h*w, D] -> [b, h*w]
        M = self.config.crop
        lo = -(M // 2)
        norm = torch.linalg.vector_norm(x, dim=-1)
        dev = x.device
        rows_in_band = min(M, h)
        slot_col = torch.arange(w, device=dev)[:, None] + lo + torch.arange(M, device=dev)  # [w, M]
        col_ok = (slot_col >= 0) & (slot_col < w)
        slot_col = slot_col.clamp(0, w - 1)
        out = torch.empty_like(norm)
        for y in range(h):  # one frame row at a time against the band of rows around it
            s = min(max(0, y + lo), h - rows_in_band)
            band = x[:, s * w : (s + rows_in_band) * w]  # [b, Mb*w, D] view
            gram = torch.bmm(x[:, y * w : (y + 1) * w], band.transpose(1, 2))  # [b, w, Mb*w]
            band_row = torch.arange(s, s + rows_in_band, device=dev)
            row_ok = (band_row >= y + lo) & (band_row < y + lo + M)  # [Mb]
            idx = (band_row - s)[None, :, None] * w + slot_col[:, None, :]  # [w, Mb, M]
            wt = row_ok[None, :, None] & col_ok[:, None, :]
            nq, nk = norm[:, y * w : (y + 1) * w], norm[:, s * w : (s + rows_in_band) * w]
            out[:, y * w : (y + 1) * w] = _crop_variance(
                gram, nq, nk, idx.reshape(w, -1), wt.reshape(w, -1).to(x.dtype)
            )
        return out


# ---- holistic (eq. 7) -----------------------------------------------------------------------

COMPONENTS = ("attention", "temporal", "spatial")


def _components(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if (
        not isinstance(value, tuple)
        or not value
        or len(set(value)) != len(value)
        or any(c not in COMPONENTS for c in value)
    ):
        raise ValueError(
            f"components must be a non-empty list of distinct names from {', '.join(COMPONENTS)}, got {value!r}"
        )


def _weights(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if (
        not isinstance(value, tuple)
        or len(value) != len(instance.components)
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
    ):
        raise ValueError(
            f"weights must be None or one number per component ({len(instance.components)} for "
            f"{list(instance.components)}), got {value!r}"
        )


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def frame_zscore(
    scores: torch.Tensor,  # [N]
    frame: torch.Tensor,  # [N] long, frame number of each token (0 .. F-1)
    n_frames: int,
    eps: float,
) -> torch.Tensor:  # -> [N]
    """(s - μ_f) / σ_f within each frame (population σ); 0 where σ_f <= eps (a constant frame)."""
    s = scores.to(torch.float64)
    count = torch.zeros(n_frames, dtype=torch.float64, device=s.device).index_add_(
        0, frame, torch.ones_like(s)
    )
    count = count.clamp_min(1)
    mean = torch.zeros_like(count).index_add_(0, frame, s) / count
    dev = s - mean[frame]
    std = (torch.zeros_like(count).index_add_(0, frame, dev * dev) / count).sqrt()
    flat = std <= eps
    return torch.where(flat[frame], torch.zeros_like(s), dev / std.clamp_min(eps)[frame])


class HolisticScorer(Scorer):
    """s = Σ_c w_c · ẑ_c, each component z-normalised within each frame (eq. 7; w_c = 1 by default).

    `components` picks the terms (the paper's ablations drop one of attention/temporal/spatial). A
    frame where a component is constant (σ_f <= eps) contributes 0 for it, never NaN. The attention
    component is divided by its mean over the whole video first: that leaves its z-scores unchanged
    and makes `eps` a relative threshold for it (raw attention values are ~1/N).
    """

    @attrs.frozen
    class Config:
        components: tuple[str, ...] = attrs.field(default=COMPONENTS, converter=_tuple, validator=_components)
        weights: tuple[float, ...] | None = attrs.field(default=None, converter=_tuple, validator=_weights)
        #: spatial crop size M (M×M tokens) and edge handling (see SpatialScorer)
        crop: int = attrs.field(default=5, validator=positive_int)
        crop_mode: str = attrs.field(default="tile", validator=one_of(*CROP_MODES))
        #: attention options (see AttentionScorer)
        layers: tuple[int, ...] | None = attrs.field(
            default=None, converter=optional_int_tuple, validator=layer_indices
        )
        queries: str = attrs.field(default="after_video", validator=one_of(*QUERY_MODES))
        softmax_over: str = attrs.field(default="causal", validator=one_of(*SOFTMAX_MODES))
        chunk_size: int = attrs.field(default=4096, validator=positive_int)
        #: a frame whose σ for a component is <= eps counts as constant for it
        eps: float = attrs.field(default=1e-6, validator=positive_number)

    def __init__(self, config: Any = None):
        super().__init__(config)
        c = self.config
        makers = {
            "attention": lambda: AttentionScorer(
                AttentionScorer.Config(
                    layers=c.layers, queries=c.queries, softmax_over=c.softmax_over, chunk_size=c.chunk_size
                )
            ),
            "temporal": lambda: TemporalScorer(),
            "spatial": lambda: SpatialScorer(SpatialScorer.Config(crop=c.crop, crop_mode=c.crop_mode)),
        }
        self.parts: dict[str, Scorer] = {name: makers[name]() for name in c.components}
        self.weights = dict(zip(c.components, c.weights or (1.0,) * len(c.components)))

    def observe_target_prefill(self, adapter: Adapter, encoded: Encoded):
        if "attention" in self.parts:
            return self.parts["attention"].observe_target_prefill(adapter, encoded)
        return super().observe_target_prefill(adapter, encoded)

    def observed(self) -> Any:
        return self.parts["attention"].observed() if "attention" in self.parts else None

    def observe_target_extension(self, adapter: Adapter, encoded: Encoded, start: int, prior: Any):
        if "attention" in self.parts:
            return self.parts["attention"].observe_target_extension(adapter, encoded, start, prior)
        return contextlib.nullcontext()

    def observe_target_piece(self, adapter: Adapter, encoded: Encoded, start: int, end: int, prior: Any):
        if "attention" in self.parts:
            return self.parts["attention"].observe_target_piece(adapter, encoded, start, end, prior)
        return contextlib.nullcontext()

    def component_scores(self, visual: VisualTokens, context: ScoringContext) -> dict[str, torch.Tensor]:
        """Each component's raw score [N], before normalisation."""
        return {name: part.score(visual, context) for name, part in self.parts.items()}

    def fuse(self, visual: VisualTokens, components: dict[str, torch.Tensor]) -> torch.Tensor:  # -> [N]
        unknown = set(components) - set(COMPONENTS)
        if unknown:
            raise ConfigError(
                f"unknown holistic component(s) {sorted(unknown)}; known: {', '.join(COMPONENTS)}"
            )
        frame = visual.frame_index().to(visual.embeds.device)
        n_frames = sum(t for t, _, _ in visual.grids)
        total = torch.zeros(visual.n, dtype=torch.float64, device=visual.embeds.device)
        for name, s in components.items():
            s = s.to(device=total.device, dtype=torch.float64)
            if name == "attention":
                mean = s.mean() if s.numel() else s.new_zeros(())
                s = s / mean if mean > 0 else s
            total += self.weights.get(name, 1.0) * frame_zscore(s, frame, n_frames, self.config.eps)
        return total

    def score(self, visual: VisualTokens, context: ScoringContext) -> torch.Tensor:  # -> [N]
        if visual.n == 0:
            return torch.zeros(0, dtype=torch.float64, device=visual.embeds.device)
        return self.fuse(visual, self.component_scores(visual, context))


@hookimpl
def hippo_register_scorers():
    return {"temporal": TemporalScorer, "spatial": SpatialScorer, "holistic": HolisticScorer}
