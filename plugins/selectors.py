"""Score-free selectors: keep everything, a uniform lattice, or a seeded random subset."""

from __future__ import annotations

import attrs
import torch

from hippo import hookimpl
from hippo.interfaces import Selector
from hippo.types import VisualTokens
from hippo.validators import keep_ratio, optional_seed
from hippo.visual import budget


class FullSelector(Selector):
    """Keeps every visual token: vanilla speculative decoding with the whole video."""

    def select(self, visual: VisualTokens, scores, generator) -> torch.Tensor:  # -> [N]
        return torch.arange(visual.n)


class UniformSelector(Selector):
    """K tokens evenly spaced over the whole visual sequence (centre of each of K equal bins)."""

    @attrs.frozen
    class Config:
        keep_ratio: float = attrs.field(default=0.1, validator=keep_ratio)

    def select(self, visual: VisualTokens, scores, generator) -> torch.Tensor:  # -> [K]
        n = visual.n
        k = budget(n, self.config.keep_ratio)
        return ((torch.arange(k, dtype=torch.float64) + 0.5) * n / k).floor().long().clamp_max(n - 1)


class RandomSelector(Selector):
    """K tokens drawn uniformly without replacement; seeded by `seed`, else by the run's generator."""

    @attrs.frozen
    class Config:
        keep_ratio: float = attrs.field(default=0.1, validator=keep_ratio)
        seed: int | None = attrs.field(default=None, validator=optional_seed)

    def select(self, visual: VisualTokens, scores, generator: torch.Generator) -> torch.Tensor:  # -> [K]
        if self.config.seed is not None:
            generator = torch.Generator().manual_seed(self.config.seed)
        k = budget(visual.n, self.config.keep_ratio)
        return torch.randperm(visual.n, generator=generator)[:k].sort().values


@hookimpl
def hippo_register_selectors():
    return {"full": FullSelector, "uniform": UniformSelector, "random": RandomSelector}
