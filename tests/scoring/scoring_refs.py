"""Naive float64 references for the scorers, written token by token straight from the paper's equations,
plus helpers to build visual tokens and multi-video prompts for the tiny Qwen2.5-VL model."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from hippo.types import VisualTokens

EPS = 1e-12


def visual_from(grids, D: int, seed: int, dtype=torch.float64) -> VisualTokens:
    n = sum(t * h * w for t, h, w in grids)
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype)
    return VisualTokens(embeds=embeds, seq_index=torch.arange(n) + 3, grids=tuple(map(tuple, grids)))


def with_embeds(visual: VisualTokens, embeds: torch.Tensor) -> VisualTokens:
    return VisualTokens(embeds=embeds, seq_index=visual.seq_index, grids=visual.grids)


grid = st.tuples(st.integers(1, 4), st.integers(1, 7), st.integers(1, 7))
grids = st.lists(grid, min_size=1, max_size=3)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / max(na * nb, EPS)


def _blocks(visual: VisualTokens):
    start = 0
    for t, h, w in visual.grids:
        x = visual.embeds[start : start + t * h * w].to(torch.float64).reshape(t, h, w, -1)
        yield start, t, h, w, x
        start += t * h * w


def temporal_ref(visual: VisualTokens) -> torch.Tensor:
    out = torch.zeros(visual.n, dtype=torch.float64)
    for start, t, h, w, x in _blocks(visual):
        for f in range(t):
            neigh = [g for g in (f - 1, f + 1) if 0 <= g < t]
            for i in range(h):
                for j in range(w):
                    k = start + (f * h + i) * w + j
                    if neigh:
                        out[k] = 1 - sum(_cos(x[f, i, j], x[g, i, j]) for g in neigh) / len(neigh)
    return out


def _variance(values: list[float]) -> float:
    m = sum(values) / len(values)
    return sum((v - m) ** 2 for v in values) / len(values)


def spatial_ref(visual: VisualTokens, crop: int, mode: str) -> torch.Tensor:
    out = torch.zeros(visual.n, dtype=torch.float64)
    lo = -(crop // 2)
    for start, t, h, w, x in _blocks(visual):
        for f in range(t):
            for i in range(h):
                for j in range(w):
                    if mode == "tile":
                        ci, cj = i // crop * crop, j // crop * crop
                        rows, cols = range(ci, min(h, ci + crop)), range(cj, min(w, cj + crop))
                    else:
                        rows = range(max(0, i + lo), min(h, i + lo + crop))
                        cols = range(max(0, j + lo), min(w, j + lo + crop))
                    sims = [_cos(x[f, i, j], x[f, a, b]) for a in rows for b in cols]
                    out[start + (f * h + i) * w + j] = _variance(sims)
    return out


def holistic_ref(visual: VisualTokens, comps: dict, weights: dict, eps: float) -> torch.Tensor:
    out = torch.zeros(visual.n, dtype=torch.float64)
    frame = visual.frame_index().tolist()
    for name, s in comps.items():
        s = s.to(torch.float64).clone()
        if name == "attention" and float(s.mean()) > 0:
            s = s / s.mean()
        for f in sorted(set(frame)):
            idx = [k for k in range(visual.n) if frame[k] == f]
            vals = [float(s[k]) for k in idx]
            m = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - m) ** 2 for v in vals) / len(vals))
            for k in idx:
                out[k] += weights[name] * (0.0 if sd <= eps else (float(s[k]) - m) / sd)
    return out


def attention_ref(
    q: torch.Tensor,  # [H, T, d] scaled post-RoPE queries
    keys: torch.Tensor,  # [H_kv, L, d]
    rows: torch.Tensor,  # [T]
    cols: torch.Tensor,  # [N]
    window: int | None = None,
    normaliser: str = "causal",
) -> torch.Tensor:  # -> [N] Σ over heads and rows, the full [H, T, L] softmax materialised
    H, T, _ = q.shape
    G = H // keys.shape[0]
    k = keys.to(torch.float64).repeat_interleave(G, dim=0)  # [H, L, d]
    s = q.to(torch.float64) @ k.transpose(1, 2)  # [H, T, L]
    pos = torch.arange(keys.shape[1])
    ok = pos[None, :] <= rows[:, None]
    if window is not None:
        ok &= pos[None, :] > rows[:, None] - window
    if normaliser == "visual":
        is_vis = torch.zeros(keys.shape[1], dtype=torch.bool)
        is_vis[cols] = True
        ok &= is_vis[None, :]
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key: all zero
    return p[:, :, cols].sum(dim=(0, 1))


def multi_video_inputs(model, videos: list[torch.Tensor], texts: list[list[int]]) -> dict:
    """Processor-shaped inputs for texts[0] <video 0> texts[1] <video 1> texts[2] ... (Qwen2.5-VL)."""
    from hippo.adapters.qwen2_5_vl import frames_to_pixel_values

    cfg = model.config
    ids, pix, thw = list(texts[0]), [], []
    for video, txt in zip(videos, texts[1:]):
        p, g = frames_to_pixel_values(video)
        n = int(g.prod()) // cfg.vision_config.spatial_merge_size**2
        ids += [cfg.vision_start_token_id, *[cfg.video_token_id] * n, cfg.vision_end_token_id, *txt]
        pix.append(p)
        thw.append(g)
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == cfg.video_token_id).long() * 2,
        "pixel_values_videos": torch.cat(pix).to(model.dtype),
        "video_grid_thw": torch.cat(thw),
        "second_per_grid_ts": torch.ones(len(videos)),
    }
