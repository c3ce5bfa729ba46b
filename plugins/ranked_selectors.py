"""Selectors that rank tokens by a scorer's output: top-k (HIPPO, eq. 7 then top-k) and SpecVLM's two stages."""

from __future__ import annotations

import attrs
import torch

from hippo import hookimpl
from hippo.interfaces import Selector
from hippo.types import VisualTokens
from hippo.validators import keep_ratio, number_in
from hippo.visual import apportion, budget, check_scores, frame_sizes, linspace_pick, top_indices


class TopKSelector(Selector):
    """The K = budget(N, keep_ratio) highest-scoring tokens over all videos (ties: earlier token).

    per_frame=True splits K over frames in proportion to their size (largest remainder) and takes
    each frame's top tokens, so every frame keeps its share.
    """

    needs_scores = True

    @attrs.frozen
    class Config:
        keep_ratio: float = attrs.field(default=0.1, validator=keep_ratio)
        per_frame: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def select(self, visual: VisualTokens, scores, generator) -> torch.Tensor:  # -> [K]
        s = check_scores(visual, scores, "topk")
        k = budget(visual.n, self.config.keep_ratio)
        if not self.config.per_frame:
            return top_indices(s, k).sort().values
        sizes = frame_sizes(visual)
        quota = apportion(k, sizes)
        kept, start = [], 0
        for n, q in zip(sizes.tolist(), quota.tolist()):
            if q:
                kept.append(top_indices(s[start : start + n], q) + start)
            start += n
        return torch.cat(kept).sort().values if kept else torch.zeros(0, dtype=torch.long)


class SpecVLMSelector(Selector):
    """SpecVLM's pruning: stage I keeps the highest-attention tokens, in descending order, until their
    share of the total attention mass reaches `mass` (capped by the budget K); stage II fills the rest
    of K with tokens evenly spaced (linspace, ends included) over the tokens stage I did not keep.

    Scores are read as attention masses (the 'attention' scorer, as in SpecVLM). Scores with negative
    values (e.g. holistic z-scores) are shifted by their minimum first; a zero total mass skips stage I.
    """

    needs_scores = True

    @attrs.frozen
    class Config:
        keep_ratio: float = attrs.field(default=0.1, validator=keep_ratio)
        mass: float = attrs.field(default=0.4, validator=number_in(0.0, 1.0))

    def select(self, visual: VisualTokens, scores, generator) -> torch.Tensor:  # -> [K]
        s = check_scores(visual, scores, "specvlm")
        if bool((s < 0).any()):  # not masses (e.g. holistic z-scores): measure mass above the minimum
            s = s - s.min()
        n, k = visual.n, budget(visual.n, self.config.keep_ratio)
        if k == 0:
            return torch.zeros(0, dtype=torch.long)
        order = torch.sort(s, descending=True, stable=True).indices
        total = float(s.sum())
        k1 = 0
        if total > 0 and self.config.mass > 0:
            share = torch.cumsum(s[order], 0) / total
            reached = (share >= self.config.mass - 1e-12).nonzero()
            k1 = int(reached[0]) + 1 if reached.numel() else n
            k1 = min(k1, k)
        first = order[:k1]
        rest_mask = torch.ones(n, dtype=torch.bool)
        rest_mask[first] = False
        rest = rest_mask.nonzero().flatten()  # ascending
        second = rest[linspace_pick(rest.numel(), k - k1)]
        return torch.cat([first, second]).sort().values


@hookimpl
def hippo_register_selectors():
    return {"topk": TopKSelector, "specvlm": SpecVLMSelector}
