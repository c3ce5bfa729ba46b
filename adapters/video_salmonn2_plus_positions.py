"""video-SALMONN 2+ prompt layout and M-RoPE positions, in the two layouts the fact sheet describes.

Layout of one audio-visual clip: `<|vision_start|>`, then for each temporal grid step j the step's
h·w video tokens followed by n_j audio tokens, then `<|vision_end|>`. With s the seconds per grid
step and r the audio tokens per second (2), f(j) = floor(r·j·s) and n_j = f(j+1) - f(j); the last
step takes the remainder (the chunk padding included).

Positions ([t, h, w] rows; `base` = the position right after `<|vision_start|>`):

- "training" (what the training data pipeline precomputes):
  video token (j, y, x) -> [base + floor(tps·j·s), base + y, base + x]  (tps = tokens_per_second, 2);
  the k-th audio token of the clip -> [base + k, base, base + k]; `<|vision_end|>` and the text after
  it continue from max(temporal row of the clip) + 1. An audio-only clip gets [base + k, base + k, base];
  a video-only clip is stock Qwen2.5-VL (text continues after the max over all rows).
- "released" (what the released inference code computes, since it drops position_ids, audio_lengths
  and second_per_grid_ts): transformers 4.51's Qwen2.5-VL rule with s = 1, blind to audio. The T·h·w
  tokens from the first `<|video_pad|>` on get [base + tps·j, base + y, base + x] in raster order
  whatever their modality; every later token (the remaining audio, `<|vision_end|>`, text) is 1-D
  from the max of that grid + 1.

Decoding continues at the last prompt position + 1 in both layouts (generate() adds 1 to each row's
last value; the prompt's last token always has three equal rows).
"""

from __future__ import annotations

from typing import Any

import torch

from hippo.errors import InputError

POSITION_MODES = ("released", "training")


def audio_split(n_audio: int, steps: int, second_per_grid: float, rate: float) -> list[int]:
    """n_j: the audio tokens placed after temporal step j (j < steps); they sum to n_audio."""
    bounds = [min(int(rate * j * second_per_grid), n_audio) for j in range(steps)] + [n_audio]
    return [bounds[j + 1] - bounds[j] for j in range(steps)]


def clip_ids(
    config: Any, steps: int, tokens_per_step: int, n_audio: int, second_per_grid: float, rate: float
) -> list[int]:
    """Token ids of one clip: vision start, per step its video then its audio tokens, vision end."""
    ids = [config.vision_start_token_id]
    for n in audio_split(n_audio, steps, second_per_grid, rate) if n_audio else [0] * steps:
        ids += [config.video_token_id] * tokens_per_step + [config.audio_token_id] * n
    if steps == 0:  # audio only
        ids += [config.audio_token_id] * n_audio
    return [*ids, config.vision_end_token_id]


def _grids(config: Any, video_grid_thw: torch.Tensor | None) -> list[tuple[int, int, int]]:
    m = int(config.vision_config.spatial_merge_size)
    if video_grid_thw is None:
        return []
    return [(int(t), int(h) // m, int(w) // m) for t, h, w in video_grid_thw.tolist()]


def _grid_positions(t: int, h: int, w: int, seconds: float, tps: float) -> torch.Tensor:  # -> [3, t·h·w]
    """Raster-order grid positions from 0; the temporal row is floor(j · seconds · tps)."""
    j = torch.arange(t).repeat_interleave(h * w)
    r = torch.arange(h * w).repeat(t)
    temporal = torch.tensor([int(x * seconds * tps) for x in range(t)], dtype=torch.long)[j]
    return torch.stack([temporal, r // w, r % w])


def mrope_positions(
    input_ids: torch.Tensor,  # [L]
    config: Any,
    video_grid_thw: torch.Tensor | None,  # [n_videos, 3] in patches
    second_per_grid_ts: torch.Tensor | None,  # [n_videos]
    mode: str,
) -> torch.Tensor:  # -> [3, L] long (CPU)
    if mode not in POSITION_MODES:
        raise InputError(f"positions must be one of {POSITION_MODES}, got {mode!r}")
    ids = input_ids.tolist()
    if config.image_token_id in ids:
        raise InputError("video-SALMONN 2+ prompts hold videos and audio, not images (<|image_pad|> found)")
    grids = _grids(config, video_grid_thw)
    tps = float(config.vision_config.tokens_per_second)
    if mode == "released":
        return _released(ids, config, grids, tps)
    spg = [1.0] * len(grids) if second_per_grid_ts is None else [float(s) for s in second_per_grid_ts]
    return _training(ids, config, grids, spg, tps)


def _released(ids: list[int], config: Any, grids: list[tuple[int, int, int]], tps: float) -> torch.Tensor:
    """transformers 4.51 Qwen2.5-VL `get_rope_index` for one unpadded row, with second_per_grid_t = 1."""
    L, video = len(ids), config.video_token_id
    n_videos = sum(1 for i in range(L - 1) if ids[i] == config.vision_start_token_id and ids[i + 1] == video)
    if n_videos > len(grids):
        raise InputError(f"the prompt has {n_videos} videos but video_grid_thw describes {len(grids)}")
    chunks: list[torch.Tensor] = []
    st = 0
    for v in range(n_videos):
        ed = ids.index(video, st)
        t, h, w = grids[v]
        st_idx = int(chunks[-1].max()) + 1 if chunks else 0
        chunks.append(torch.arange(ed - st).expand(3, -1) + st_idx)
        chunks.append(_grid_positions(t, h, w, 1.0, tps) + (ed - st) + st_idx)
        st = ed + t * h * w
    if st > L:
        raise InputError(f"video grids cover {st} tokens but the prompt has {L}")
    if st < L:
        st_idx = int(chunks[-1].max()) + 1 if chunks else 0
        chunks.append(torch.arange(L - st).expand(3, -1) + st_idx)
    return torch.cat(chunks, dim=1)


def _training(
    ids: list[int], config: Any, grids: list[tuple[int, int, int]], spg: list[float], tps: float
) -> torch.Tensor:
    L = len(ids)
    pos = torch.empty(3, L, dtype=torch.long)
    media = (config.video_token_id, config.audio_token_id)
    cur, i, v = 0, 0, 0
    while i < L:
        pos[:, i] = cur  # text, vision start/end included
        cur += 1
        i += 1
        if ids[i - 1] != config.vision_start_token_id or i == L or ids[i] not in media:
            continue
        end = i
        while end < L and ids[end] in media:
            end += 1
        block = torch.tensor(ids[i:end])
        is_video, is_audio = block == config.video_token_id, block == config.audio_token_id
        nv, na, base = int(is_video.sum()), int(is_audio.sum()), cur
        rows = torch.empty(3, end - i, dtype=torch.long)
        temporal_max = base - 1
        if nv:
            if v >= len(grids):
                raise InputError(f"the prompt has more videos than video_grid_thw describes ({len(grids)})")
            t, h, w = grids[v]
            if nv != t * h * w:
                raise InputError(
                    f"video {v} has {nv} tokens in the prompt but its grid {t}x{h}x{w} needs {t * h * w}"
                )
            grid = _grid_positions(t, h, w, spg[v], tps) + base
            rows[:, is_video] = grid
            temporal_max = int(grid[0].max())
            v += 1
        if na:
            k = torch.arange(na) + base
            flat = torch.full_like(k, base)
            rows[:, is_audio] = torch.stack([k, flat, k] if nv else [k, k, flat])
            temporal_max = max(temporal_max, base + na - 1)
        pos[:, i:end] = rows
        cur = (temporal_max if na else int(rows.max())) + 1  # video only: stock Qwen2.5-VL
        i = end
    return pos
