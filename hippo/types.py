"""Small value carriers passed between the pipeline's parts.

Notation (as in the paper): p = target, q = draft, γ = draft length, N = visual tokens, V = vocabulary.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import torch

if TYPE_CHECKING:
    from hippo.interfaces import ModelSession, Verifier
    from hippo.sampling import TokenPolicy


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


@attrs.frozen
class DraftProposal:
    """γ draft tokens and, when sampling, the draft distribution each was drawn from.

    The proposal's type also decides how the target scores and keeps it (`score`, `process`,
    `verify`, `commit`), so `DecodeJob.verify_round` is the one verification round whatever its
    shape: a chain is fed as plain tokens and cropped back; a token tree (a subclass) is scored in
    one masked pass and compacted to its accepted path.
    """

    tokens: torch.Tensor  # [γ] long
    q: torch.Tensor | None = None  # [γ, V] probabilities (None for greedy drafts)

    @property
    def gamma(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def size(self) -> int:
        """Draft tokens made (a round books them as drafted)."""
        return self.gamma

    @property
    def depth(self) -> int:
        """The most draft tokens one round can accept; fewer accepted means a rejection."""
        return self.gamma

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> DraftProposal:
        """The same proposal with `fn` applied to each tensor field (to host, to shared memory)."""
        changes = {}
        for a in attrs.fields(type(self)):
            value = getattr(self, a.name)
            if isinstance(value, torch.Tensor):
                changes[a.name] = fn(value)
        return attrs.evolve(self, **changes)

    def cpu(self) -> DraftProposal:
        return self.map_tensors(lambda t: t.cpu())

    def chunks(self, size: int) -> list[DraftProposal]:
        """Consecutive pieces of at most `size` tokens, to verify one after the other without bonus
        tokens (each piece's last target row checks the next piece's first token)."""
        if size >= self.gamma:
            return [self]
        q = self.q
        return [
            attrs.evolve(self, tokens=self.tokens[i : i + size], q=None if q is None else q[i : i + size])
            for i in range(0, self.gamma, size)
        ]

    def truncate(self, n: int) -> DraftProposal:
        """The first n draft tokens: what a drafting stopped early had made."""
        return attrs.evolve(self, tokens=self.tokens[:n], q=None if self.q is None else self.q[:n])

    # ---- verification (called by DecodeJob.verify_round, in this order) ------------------------
    def score(self, target: ModelSession, prefix: torch.Tensor, bonus: bool) -> torch.Tensor:
        """The target's raw logits p_0..p_γ [γ+1, V] (p_0..p_{γ-1} [γ, V] without bonus), one pass.

        The target first consumes the tokens of `prefix` [T] it has not seen.
        """
        tokens = self.tokens.cpu()
        pending = prefix[target.length :]  # accepted tokens the target has not consumed
        if pending.numel():
            logits = target.forward(torch.cat([pending, tokens]))[-(self.gamma + 1) :]
        else:  # the target already holds the whole prefix: p_0 is its last logits
            p0 = target.sync(prefix)[None]
            rest = [target.forward(tokens)] if self.gamma else []
            logits = torch.cat([p0, *rest])
        return logits if bonus else logits[:-1]

    def process(self, policy: TokenPolicy, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Each row of `score`'s logits [k, V] processed with the sequence it conditions on."""
        seq = torch.cat([prefix, self.tokens.cpu()])[: prefix.shape[0] + logits.shape[0] - 1]
        return policy.process(seq, logits)

    def verify(self, verifier: Verifier, scores: torch.Tensor, policy: TokenPolicy, bonus: bool) -> Verdict:
        """The verifier's decision on the processed scores [k, V]."""
        return verifier.verify(self, scores, policy)

    def commit(self, target: ModelSession, length: int, verdict: Verdict) -> list[int]:
        """Leave the target holding the prefix (`length` tokens) and the accepted draft tokens; return those."""
        target.rollback(length + verdict.n_accepted)
        return self.tokens[: verdict.n_accepted].tolist()


@attrs.frozen
class Verdict:
    """The verifier's decision: the first `n_accepted` draft tokens stand, then `next_token`.

    `next_token` is the recovered token (after a reject) or the bonus token (all γ accepted); it is
    None when all γ were accepted and the caller asked for no bonus token.
    """

    n_accepted: int
    next_token: int | None


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
