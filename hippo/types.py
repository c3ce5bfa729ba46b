"""Small value carriers passed between the pipeline's parts.

Notation (as in the paper): p = target, q = draft, γ = draft length, N = visual tokens, V = vocabulary.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

if TYPE_CHECKING:
    pass


@attrs.frozen
class Items:
    """One medium of a padded processor batch (`hippo.padded`): its placeholder token, how many of them
    each item fills, and how many entries of each of its tensors each item takes."""

    token: int  # the placeholder token id the items fill
    tokens: Sequence[int]  # placeholders per item, in batch order
    extent: Mapping[str, Sequence[int]]  # key -> entries along dim 0 per item (a tensor or a list)


@attrs.frozen
class VideoClip:
    """Frames sampled from a video file (what an adapter's `build_inputs` reads)."""

    frames: torch.Tensor  # [T, H, W, 3] uint8
    timestamps: torch.Tensor  # [T] seconds
    fps: float  # the file's average frame rate
    indices: tuple[int, ...]  # the sampled frame numbers


@attrs.frozen
class VisualTokens:
    """The video tokens of one prompt, in sequence order, across all videos of the prompt."""

    embeds: torch.Tensor  # [N, D] visual embeddings as the language model receives them
    seq_index: torch.Tensor  # [N] position of each visual token in input_ids
    grids: tuple[tuple[int, int, int], ...]  # per video: (t, h, w) token grid; sum(t*h*w) == N

    def __attrs_post_init__(self):
        n = sum(t * h * w for t, h, w in self.grids)
        if n != self.embeds.shape[0] or n != self.seq_index.shape[0]:
            raise ValueError(
                f"visual grids cover {n} tokens but embeds has {self.embeds.shape[0]} and "
                f"seq_index {self.seq_index.shape[0]}"
            )

    @property
    def n(self) -> int:
        return int(self.seq_index.shape[0])

    def frame_index(self) -> torch.Tensor:  # [N] global frame number of each token
        ids, offset = [], 0
        for t, h, w in self.grids:
            ids.append(torch.arange(t).repeat_interleave(h * w) + offset)
            offset += t
        if not ids:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat(ids)

    def frames(self) -> list[torch.Tensor]:
        """Each frame's embeddings as a [h, w, D] tensor, in order."""
        out, start = [], 0
        for t, h, w in self.grids:
            block = self.embeds[start : start + t * h * w].reshape(t, h, w, -1)
            out.extend(block.unbind(0))
            start += t * h * w
        return out


@attrs.define
class Stats:
    """What a generate call did and where the time went (seconds are wall-clock)."""

    new_tokens: int = 0
    rounds: int = 0
    accepted_per_round: list[int] = attrs.Factory(list)  # draft tokens accepted in each verify round
    drafted_per_round: list[int] = attrs.Factory(list)  # γ used in each round
    emitted_per_round: list[int] = attrs.Factory(list)  # tokens each round emitted (accepted + next)
    rejected_per_round: list[bool] = attrs.Factory(list)  # the round rejected a draft token
    visual_tokens: int = 0
    kept_visual_tokens: int = 0
    seconds_total: float = 0.0
    seconds_ttft: float = 0.0
    seconds_pruning: float = 0.0
    seconds_target_prefill: float = 0.0
    seconds_target_decode: float = 0.0
    seconds_draft_prefill: float = 0.0
    seconds_draft_decode: float = 0.0
    seconds_draft_overlapped: float = 0.0  # draft work done while the target was busy (hidden)
    seconds_compile: float = 0.0  # first forwards of compiled static-cache sessions (in the decode seconds)
    fallback: bool = False  # the draft failed and the target finished alone
    #: decoding steps of the target alone that `gamma="auto"` chose (γ = 0: drafting was losing)
    target_steps: int = 0
    #: what the planner chose and why: γ's inputs (α, t_decode, t_draft) and the predicted tokens/s of
    #: each option; under `scheduler="auto"`, also the schedule and each schedule's prediction
    plan: dict = attrs.Factory(dict)
    scheduler: str = ""
    notes: list[str] = attrs.Factory(list)
    #: hippo.events.Event of each piece of work, in time order (seconds since the call began);
    #: empty unless `generate(..., timeline=True)`
    events: list = attrs.Factory(list)

    @property
    def mat(self) -> float:
        """Mean accepted tokens: tokens produced per target verification (accepted drafts + 1)."""
        if not self.emitted_per_round:
            return 1.0 if self.new_tokens else 0.0
        return statistics.fmean(self.emitted_per_round)

    @property
    def mat_accumulated(self) -> float:
        """The paper's MAT: tokens accumulated over consecutive verify rounds until a rejection.

        Fully accepted rounds do not end a run, so this can exceed γ + 1; it is the mean length of
        the runs of emitted tokens between rejections (HIPPO Sec. 6.1, as PEARL counts it).
        """
        if not self.emitted_per_round:
            return self.mat
        runs = sum(self.rejected_per_round) + (0 if self.rejected_per_round[-1] else 1)
        return sum(self.emitted_per_round) / runs

    def record_round(self, drafted: int, accepted: int, emitted: int, rejected: bool) -> None:
        """Book one verification round."""
        self.rounds += 1
        self.drafted_per_round.append(drafted)
        self.accepted_per_round.append(accepted)
        self.emitted_per_round.append(emitted)
        self.rejected_per_round.append(rejected)

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(self.drafted_per_round)
        return sum(self.accepted_per_round) / drafted if drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds_total if self.seconds_total > 0 else 0.0

    @property
    def draft_hidden_fraction(self) -> float:
        """Share of the draft's time that overlapped the target's (paper Table 2: "overlapped")."""
        return self.seconds_draft_overlapped / self.seconds_draft if self.seconds_draft > 0 else 0.0

    @property
    def seconds_draft(self) -> float:
        return self.seconds_draft_prefill + self.seconds_draft_decode

    @property
    def seconds_target(self) -> float:
        return self.seconds_target_prefill + self.seconds_target_decode

    def as_dict(self) -> dict:
        d = attrs.asdict(self)
        d.update(
            mat=self.mat,
            mat_accumulated=self.mat_accumulated,
            acceptance_rate=self.acceptance_rate,
            tokens_per_second=self.tokens_per_second,
            seconds_draft=self.seconds_draft,
            seconds_target=self.seconds_target,
            draft_hidden_fraction=self.draft_hidden_fraction,
        )
        return d

    def summary(self) -> str:
        return (
            f"{self.new_tokens} new tokens | MAT {self.mat:.2f} | {self.tokens_per_second:.1f} tok/s | "
            f"TTFT {self.seconds_ttft:.3f}s | pruning {self.seconds_pruning * 1e3:.1f} ms | "
            f"total {self.seconds_total:.3f}s"
        )


@attrs.frozen
class GenerateOutput:
    sequences: torch.Tensor  # [1, prompt_len + new]
    stats: Stats
    kept_visual_index: torch.Tensor | None = None  # [K] indices into the visual tokens the draft saw
