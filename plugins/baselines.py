"""Single-model pruning baselines of the paper's case study (§6.4): HIPPO-Frame, -FastVID, -DyCoke.

They use only the visual embeddings (no target signal) and return exactly budget(N, keep_ratio)
ascending indices, like every selector. Papers' algorithms carried over, with these adaptations:

- frame: whole frames at evenly spaced positions; exact budget by trimming one frame (below).
- fastvid (after FastVID, Shen et al. 2025): DySeg-style segmentation at low adjacent-frame similarity,
  then density-peak scores inside each segment. FastVID *merges* the tokens it drops into the kept
  ones; a draft must see original embeddings at their original positions, so nothing is merged here.
- dycoke (after DyCoke, Tao et al. 2025): TTM-style temporal pruning of tokens that repeat the token
  at the same position in the last frame where that position was kept; DyCoke's decode-time KV
  pruning has no counterpart (the draft's cache is not ours to prune).
"""

from __future__ import annotations

import attrs
import torch

from hippo import hookimpl
from hippo.interfaces import Selector
from hippo.types import VisualTokens
from hippo.validators import keep_ratio, number_in, positive_int
from hippo.visual import apportion, budget, compute_dtype, frame_sizes, linspace_pick, top_indices, videos

EPS = 1e-12


def _unit(x: torch.Tensor) -> torch.Tensor:  # [..., D] -> unit rows in the compute dtype
    x = x.to(compute_dtype(x.dtype))
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(EPS)


class FrameSelector(Selector):
    """Keeps whole frames at regular temporal intervals (HIPPO-Frame).

    The fewest evenly spaced frames (linspace over all frames of all videos, ends included) whose tokens
    reach K are chosen; going through them in temporal order, whole frames are kept while they fit and
    the first one that does not fit keeps only K minus what is already kept, evenly spaced inside it.
    With equal frame sizes that is the last chosen frame.
    """

    @attrs.frozen
    class Config:
        keep_ratio: float = attrs.field(default=0.1, validator=keep_ratio)

    def select(self, visual: VisualTokens, scores, generator) -> torch.Tensor:  # -> [K]
        k = budget(visual.n, self.config.keep_ratio)
        sizes = frame_sizes(visual)
        F = sizes.numel()
        if k == 0:
            return torch.zeros(0, dtype=torch.long)
        starts = torch.cumsum(sizes, 0) - sizes
        chosen = torch.arange(F)
        for m in range(1, F + 1):
            idx = linspace_pick(F, m)
            if int(sizes[idx].sum()) >= k:
                chosen = idx
                break
        kept, left = [], k
        for f in chosen.tolist():
            n, s = int(sizes[f]), int(starts[f])
            take = min(n, left)
            kept.append(s + (torch.arange(n) if take == n else linspace_pick(n, take)))
            left -= take
            if left == 0:
                break
        return torch.cat(kept).sort().values


class FastVIDSelector(Selector):
    """Segment, then keep density peaks per segment (HIPPO-FastVID, after FastVID's DySeg + STPrune).

    1. Frame feature = mean of the frame's unit token embeddings; transition similarity = cosine of
       consecutive frame features inside a video. Cuts: every video boundary, every transition below
       `threshold`, and the `segments - 1` least similar transitions (FastVID's two cut rules).
    2. K is split over segments in proportion to their token counts.
    3. Inside a segment, tokens are taken in blocks of at most `block` consecutive tokens; each token
       gets a density-peak score ρ·δ (DPC-kNN): ρ = (1 + mean cosine to its `neighbours` most similar
       tokens) / 2, δ = 1 - cosine to the most similar denser token (for the densest, 1 - the least
       similar token). The segment keeps its top scores: dense cluster centres that are far from each
       other, i.e. representative, non-redundant tokens.
    """

    @attrs.frozen
    class Config:
        keep_ratio: float = attrs.field(default=0.1, validator=keep_ratio)
        segments: int = attrs.field(default=8, validator=positive_int)
        threshold: float = attrs.field(default=0.9, validator=number_in(-1.0, 1.0))
        neighbours: int = attrs.field(default=5, validator=positive_int)
        block: int = attrs.field(default=1024, validator=positive_int)

    def select(self, visual: VisualTokens, scores, generator) -> torch.Tensor:  # -> [K]
        k = budget(visual.n, self.config.keep_ratio)
        if k == 0:
            return torch.zeros(0, dtype=torch.long)
        segs = self.segments(visual)  # list of (start, stop) token ranges
        quota = apportion(k, torch.tensor([b - a for a, b in segs]))
        kept = []
        for (a, b), q in zip(segs, quota.tolist()):
            if q:
                kept.append(top_indices(self.density_peaks(visual.embeds[a:b]), q) + a)
        return torch.cat(kept).sort().values

    @torch.inference_mode()
    def segments(self, visual: VisualTokens) -> list[tuple[int, int]]:
        feats, owner = [], []
        for vi, v in enumerate(videos(visual)):
            x = visual.embeds[v.start : v.stop].reshape(v.t, v.frame_size, -1)
            feats.append(_unit(torch.stack([_unit(f).mean(0) for f in x])))  # [t, D]
            owner += [vi] * v.t
        g = torch.cat(feats)  # [F, D]
        sizes = frame_sizes(visual)
        F = g.shape[0]
        if F == 1:
            return [(0, int(sizes[0]))]
        sim = (g[:-1] * g[1:]).sum(-1).cpu().to(torch.float64)  # [F-1], transition f -> f+1
        same = torch.tensor([owner[f] == owner[f + 1] for f in range(F - 1)])
        cut = ~same | (sim < self.config.threshold)
        inside = same.nonzero().flatten()
        lowest = inside[torch.sort(sim[inside], stable=True).indices[: self.config.segments - 1]]
        cut[lowest] = True
        ends = torch.cumsum(sizes, 0)
        bounds = [0] + [int(ends[f]) for f in cut.nonzero().flatten().tolist()] + [int(ends[-1])]
        return list(zip(bounds[:-1], bounds[1:]))

    @torch.inference_mode()
    def density_peaks(self, x: torch.Tensor) -> torch.Tensor:  # x [n, D] -> [n] float64 scores
        parts = []
        for b0 in range(0, x.shape[0], self.config.block):
            u = _unit(x[b0 : b0 + self.config.block])
            n = u.shape[0]
            if n == 1:
                parts.append(torch.ones(1, dtype=torch.float64))
                continue
            sim = u @ u.T  # [n, n]
            kn = min(self.config.neighbours, n - 1)
            off = sim.clone().fill_diagonal_(float("-inf"))
            rho = (1 + off.topk(kn, dim=-1).values.mean(-1)) / 2
            order = torch.sort(rho, descending=True, stable=True).indices
            rank = torch.empty_like(order)
            rank[order] = torch.arange(n, device=order.device)
            denser = rank[None, :] < rank[:, None]  # [i, j]: j is denser than i
            nearest = sim.masked_fill(~denser, float("-inf")).amax(-1)
            delta = 1 - nearest
            top = order[0]
            delta[top] = 1 - sim[top].min()
            parts.append((rho * delta).to("cpu", torch.float64))
        return torch.cat(parts)


class DyCokeSelector(Selector):
    """Temporal token pruning (HIPPO-DyCoke, after DyCoke's TTM), then an exact budget.

    Per video, frame by frame: the first frame is kept whole and becomes the reference; a later token
    whose cosine with the reference token at its (row, col) is >= `threshold` is redundant and dropped,
    otherwise it is kept and replaces the reference at that position ("the previous kept frame" per
    position). Novelty = 1 - that cosine (1 for first-frame tokens).
    Exact budget: survivors are ranked before dropped tokens, each group by novelty (ties: earlier
    token); the first K are kept. So with too many survivors the least novel ones go (first frames
    last), and with too few the most novel dropped tokens come back.
    """

    @attrs.frozen
    class Config:
        keep_ratio: float = attrs.field(default=0.1, validator=keep_ratio)
        threshold: float = attrs.field(default=0.9, validator=number_in(-1.0, 1.0))

    @torch.inference_mode()
    def select(self, visual: VisualTokens, scores, generator) -> torch.Tensor:  # -> [K]
        k = budget(visual.n, self.config.keep_ratio)
        survive, novelty = self.merge(visual)
        rank = novelty + 3.0 * survive.to(torch.float64)  # survivors (> 3) before dropped (<= 2)
        return top_indices(rank, k).sort().values

    def merge(self, visual: VisualTokens) -> tuple[torch.Tensor, torch.Tensor]:  # -> [N] bool, [N] float64
        survive = torch.zeros(visual.n, dtype=torch.bool)
        novelty = torch.zeros(visual.n, dtype=torch.float64)
        for v in videos(visual):
            x = visual.embeds[v.start : v.stop].reshape(v.t, v.frame_size, -1)
            ref = _unit(x[0])  # [hw, D]
            survive[v.start : v.start + v.frame_size] = True
            novelty[v.start : v.start + v.frame_size] = 1.0
            for f in range(1, v.t):  # loop over frames; each step is vectorised over positions
                u = _unit(x[f])
                cos = (u * ref).sum(-1)
                keep = cos < self.config.threshold
                ref[keep] = u[keep]
                a = v.start + f * v.frame_size
                survive[a : a + v.frame_size] = keep.cpu()
                novelty[a : a + v.frame_size] = (1 - cos).to("cpu", torch.float64)
        return survive, novelty


@hookimpl
def hippo_register_selectors():
    return {"frame": FrameSelector, "fastvid": FastVIDSelector, "dycoke": DyCokeSelector}
