"""Score-free selectors: keep everything, a uniform lattice, a seeded random subset, a StreamingLLM-style
sink and window, or given indices (an oracle that knows which tokens matter)."""

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


def _lattice(k: int, n: int) -> torch.Tensor:  # -> [k] the centres of k equal bins of range(n), ascending
    return ((torch.arange(k, dtype=torch.float64) + 0.5) * n / k).floor().long().clamp_max(n - 1)


class UniformSelector(Selector):
    """K tokens evenly spaced over the whole visual sequence (centre of each of K equal bins)."""

    @attrs.frozen
    class Config:
        keep_ratio: float = attrs.field(default=0.1, validator=keep_ratio)

    def select(self, visual: VisualTokens, scores, generator) -> torch.Tensor:  # -> [K]
        return _lattice(budget(visual.n, self.config.keep_ratio), visual.n)


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


def _share(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be a number in [0, 1], got {value!r}")


def _indices(value) -> tuple[int, ...]:
    return tuple(int(i) for i in (value.tolist() if isinstance(value, torch.Tensor) else value))


def _non_negative(instance, attribute, value: tuple[int, ...]) -> None:
    if any(i < 0 for i in value):
        raise ValueError(f"{attribute.name} must hold visual-token indices >= 0, got {min(value)}")


class SinkWindowSelector(Selector):
    """The first and the last visual tokens (StreamingLLM's attention sink and recent window, as
    MagicDec drafts with): `sink` of the K-token budget from the start of the visual sequence, the
    rest from its end. Blind to content: a needle in the middle of a long video is never kept."""

    @attrs.frozen
    class Config:
        keep_ratio: float = attrs.field(default=0.1, validator=keep_ratio)
        sink: float = attrs.field(default=0.25, validator=_share)  # share of the budget at the start

    def select(self, visual: VisualTokens, scores, generator) -> torch.Tensor:  # -> [K]
        n = visual.n
        k = budget(n, self.config.keep_ratio)
        s = round(k * self.config.sink)
        return torch.cat([torch.arange(s), torch.arange(n - (k - s), n)])


class OracleSelector(Selector):
    """Keeps the given visual-token indices (`keep`: tokens known to matter, e.g. a benchmark's needles)
    and fills the rest of the K-token budget with a uniform lattice over the others: the upper bound
    a scorer can reach at that budget. Indices past the video are ignored; of more than K, a uniform
    lattice of K is kept."""

    @attrs.frozen
    class Config:
        keep: tuple[int, ...] = attrs.field(default=(), converter=_indices, validator=_non_negative)
        keep_ratio: float = attrs.field(default=0.1, validator=keep_ratio)

    def select(self, visual: VisualTokens, scores, generator) -> torch.Tensor:  # -> [K]
        n = visual.n
        k = budget(n, self.config.keep_ratio)
        chosen = torch.tensor(sorted({i for i in self.config.keep if i < n}), dtype=torch.long)
        if chosen.numel() >= k:
            return chosen[_lattice(k, chosen.numel())]
        rest = k - chosen.numel()
        others = torch.ones(n, dtype=torch.bool)
        others[chosen] = False
        pool = others.nonzero().flatten()  # [n - |chosen|]
        return torch.cat([chosen, pool[_lattice(rest, pool.numel())]]).sort().values


@hookimpl
def hippo_register_selectors():
    return {
        "full": FullSelector,
        "uniform": UniformSelector,
        "random": RandomSelector,
        "sink_window": SinkWindowSelector,
        "oracle": OracleSelector,
    }
