"""The abstract parts of a pipeline. Concrete ones are plugins (`hippo.plugins`) or adapters.

Notation: p = target, q = draft, γ = draft length, N = visual tokens, K = kept visual tokens,
V = vocabulary, T = tokens in the sequence so far (prompt + generated).
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import attrs
import torch

from hippo.errors import ConfigError, UnsupportedError
from hippo.placement import input_device, model_devices

if TYPE_CHECKING:
    from hippo.proposal import DraftProposal, TokenPolicy, Verdict
    from hippo.types import Items, Stats, VideoClip, VisualTokens


@attrs.frozen
class NoConfig:
    """Config of a part that takes no options."""


class Component(ABC):  # noqa: B024 - abstract through its subclasses
    """A named, configurable part. `Config` is a frozen attrs class validated at build time."""

    Config: ClassVar[type] = NoConfig

    def __init__(self, config: Any = None):
        self.config = self.Config() if config is None else config

    @classmethod
    def from_options(cls, **options: Any) -> Component:
        return cls(make_config(cls.Config, options, owner=cls.__name__))


def make_config(config_cls: type, options: dict[str, Any], owner: str) -> Any:
    """Build an attrs config, turning unknown options and failed validators into ConfigError."""
    known = {a.name for a in attrs.fields(config_cls)} if attrs.has(config_cls) else set()
    unknown = sorted(set(options) - known)
    if unknown:
        valid = ", ".join(sorted(known)) or "none"
        raise ConfigError(f"{owner}: unknown option(s) {', '.join(unknown)}; valid options: {valid}")
    try:
        return config_cls(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{owner}: {exc}") from exc


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share: what a session that consumed `a` keeps when the
    sequence is now `b` (a draft catching up after a round rejected its tokens)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def catch_up(consumed: Sequence[int], emitted: Sequence[int], logits_kept: bool) -> int:
    """How many of the tokens a session consumed after its prompt it keeps, now that the tokens after
    the prompt are `emitted`; it then rolls back to them and feeds `emitted[kept:]`, whose last logits
    draft the next token (the one catch-up of `ModelSession.sync` and of a batch's draft rows).

    That is their common prefix, less one where nothing would be fed and the logits after the last
    kept token are gone: a rollback drops them (the prompt's are kept), and `logits_kept` says
    whether the session holds them now."""
    common = common_prefix(consumed, emitted)
    if common and common == len(emitted) and not (logits_kept and common == len(consumed)):
        return common - 1  # fed again for its logits
    return common


class ModelSession(ABC):
    """One model with its KV cache, fed token by token after its prefill.

    `length` counts logical tokens of the *full* sequence consumed so far, so a draft that saw
    only K of the N visual tokens still reports the full prompt length after its prefill.
    """

    length: int
    prompt_length: int
    generated: list[int]  # tokens consumed after the prompt, in order
    last_logits: torch.Tensor | None  # [V] logits after the last consumed token (None after a rollback)
    seconds_decode: float = 0.0  # wall-clock seconds spent in forward passes
    forwards: int = 0  # forward passes after the prefill (a verification round is one)
    #: tokens those passes fed (`hippo.cost.GammaPlan` times each pass against t_verify(k))
    tokens_forwarded: int = 0
    seconds_compile: float = 0.0  # of `seconds_decode`: forwards that compiled a graph (hippo.static)

    @abstractmethod
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [k] -> logits [k, V]
        """Consume k tokens at logical positions length .. length+k-1 and return their logits."""

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Forget everything after the first `length` logical tokens (KV cache crop)."""

    def forward_masked(
        self,
        tokens: torch.Tensor,  # [k] long
        offsets: torch.Tensor,  # [k] long: token i sits at logical position length + offsets[i]
        visible: torch.Tensor,  # [k, k] bool: [i, j] = token i attends to token j of this block
    ) -> torch.Tensor:  # -> logits [k, V]
        """Score a block of k tokens in one pass (e.g. a token tree with its ancestor mask).

        Every token attends to the whole consumed sequence and to the block tokens `visible` marks.
        The block is tentative: `length`, `generated` and `last_logits` change only at `keep`,
        which must follow before any other call.
        """
        raise UnsupportedError(f"{type(self).__name__} cannot score a masked block of tokens (token trees)")

    def keep(self, rows: Sequence[int]) -> None:
        """After `forward_masked`: consume the block rows `rows` (ascending) in order; drop the rest.

        The kept rows' offsets must be 0, 1, 2, ... (a chain through the block), so the cache ends up
        as if those tokens had been fed by `forward`; `last_logits` becomes the last kept row's.
        """
        raise UnsupportedError(f"{type(self).__name__} cannot keep rows of a masked block (token trees)")

    def score_proposal(self, prefix: torch.Tensor, proposal: DraftProposal) -> torch.Tensor:
        """p at the root and after each draft token, in one pass: logits [n+1, V] (prefix [T]).

        The tokens of `prefix` not consumed yet go first. A chain is fed as plain tokens; a tree in one
        `forward_masked` block, each node seeing the prefix, its ancestors and itself. `keep_path`
        must follow.
        """
        pending = prefix[self.length :]  # [m] emitted tokens this session has not consumed
        m = int(pending.shape[0])
        if not m:  # p at the root is the last logits (fed again after a rollback dropped them)
            p0 = self.sync(prefix)[None]  # [1, V]
            if not proposal.size:
                return p0
            nodes = self._score_nodes(pending, proposal)  # [n, V]
            return torch.cat([p0.to(nodes.device), nodes])
        return self._score_nodes(pending, proposal)[m - 1 :]

    def _score_nodes(self, pending: torch.Tensor, proposal: DraftProposal) -> torch.Tensor:  # [m+n, V]
        if proposal.chain:
            return self.forward(torch.cat([pending, proposal.tokens.cpu()]))
        m, n = int(pending.shape[0]), proposal.size
        offsets = torch.cat([torch.arange(m), m - 1 + proposal.depths()])  # [m+n]
        visible = torch.zeros(
            m + n, m + n, dtype=torch.bool
        )  # pending: causal; nodes: all pending + ancestors
        visible[:m, :m] = torch.ones(m, m, dtype=torch.bool).tril()
        visible[m:, :m] = True
        visible[m:, m:] = proposal.ancestor_mask()
        return self.forward_masked(torch.cat([pending, proposal.tokens.cpu()]), offsets, visible)

    def keep_path(self, length: int, proposal: DraftProposal, path: Sequence[int]) -> None:
        """After `score_proposal` on a prefix of `length` tokens: keep that prefix and the draft tokens
        of `path` (node indices, root first) in the cache; drop the other draft tokens."""
        if proposal.chain:
            self.rollback(length + len(path))
        else:
            m = length - self.length  # the pending tokens scored before the nodes
            self.keep([*range(m), *(m + i for i in path)])

    def sync(self, prefix: torch.Tensor) -> torch.Tensor:  # prefix [T] -> logits [V]
        """Roll back to the longest common prefix with `prefix`, feed the rest, return the last logits."""
        new = prefix[self.prompt_length :].tolist()
        kept = catch_up(self.generated, new, self.last_logits is not None)
        self.rollback(self.prompt_length + kept)
        if kept < len(new):
            self.forward(torch.tensor(new[kept:], dtype=torch.long))
        return self.last_logits

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (caches, remote workers)."""


class Scorer(Component):
    """Scores visual tokens; higher means more worth keeping for the draft."""

    @abstractmethod
    def score(self, visual: VisualTokens, context: ScoringContext) -> torch.Tensor:  # -> [N] float
        ...

    def observe_target_prefill(self, adapter: Adapter, encoded: Encoded) -> AbstractContextManager:
        """Entered around the target's prefill, e.g. to capture per-layer text queries with hooks.

        Whatever it records must not change the target's computation.
        """
        return nullcontext()

    def observed(self) -> Any:
        """What the last observed prefill recorded (opaque; a video context keeps it), or None."""
        return None

    def observe_target_extension(
        self, adapter: Adapter, encoded: Encoded, start: int, prior: Any
    ) -> AbstractContextManager:
        """Like `observe_target_prefill`, around a forward of only the rows start..L-1 of `encoded`.

        Rows 0..start-1 come from a cached prefix (a video context) whose prefill was observed
        earlier: `prior` is what `observed()` returned then. A scorer that reads the target's prefill
        must override this too, or it cannot be used with video contexts.
        """
        if type(self).observe_target_prefill is Scorer.observe_target_prefill:
            return nullcontext()
        raise UnsupportedError(
            f"scorer {type(self).__name__} reads the target's prefill but cannot read a cached video "
            "context's extension; use Pipeline.generate, or a scorer that implements "
            "observe_target_extension"
        )

    def observe_target_piece(
        self, adapter: Adapter, encoded: Encoded, start: int, end: int, prior: Any
    ) -> AbstractContextManager:
        """Like `observe_target_extension`, around a forward of only the rows start..end-1: one piece
        of a prefill in pieces (`Adapter.prefill_pieces`). `prior` is what `observed()` returned
        after the piece before (None for the first). A scorer that reads the target's prefill and
        does not override this gets the prefill in one piece (`observes_pieces`)."""
        if type(self).observe_target_prefill is Scorer.observe_target_prefill:
            return nullcontext()
        raise UnsupportedError(f"scorer {type(self).__name__} cannot observe a prefill in pieces")


def observes_pieces(scorer: Scorer | None) -> bool:
    """Whether the target's prefill may run in pieces under `scorer` (see `Scorer.observe_target_piece`)."""
    if scorer is None or type(scorer).observe_target_prefill is Scorer.observe_target_prefill:
        return True
    return type(scorer).observe_target_piece is not Scorer.observe_target_piece


class Selector(Component):
    """Turns scores (or none) into the ascending indices of the visual tokens the draft keeps."""

    #: Whether this selector needs a scorer's output.
    needs_scores: ClassVar[bool] = False

    @abstractmethod
    def select(
        self,
        visual: VisualTokens,
        scores: torch.Tensor | None,  # [N] or None
        generator: torch.Generator,
    ) -> torch.Tensor:  # -> [K] long, ascending, unique, in [0, N)
        ...


class Drafter(Component):
    """Proposes γ tokens continuing `prefix` with the draft model."""

    #: True for a drafter whose proposal is a chain drawn token by token from q (x_i ~ q_i, each fed
    #: back), as the built-in `chain` drafter's: the batch engine then draws a batch's chains itself,
    #: every row in one forward per token. A subclass with a `propose` of its own does not inherit it.
    plain_chains: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "propose" in cls.__dict__ and "plain_chains" not in cls.__dict__:
            cls.plain_chains = False

    @abstractmethod
    def propose(
        self,
        session: ModelSession,
        prefix: torch.Tensor,  # [T] long: prompt + accepted tokens
        gamma: int,
        policy: TokenPolicy,
        should_stop: Callable[[], bool] | None = None,
    ) -> DraftProposal:
        """Draft up to γ tokens; if `should_stop()` turns true, return the tokens drafted so far.

        Draft logits go through `policy.fit` first: a draft whose embedding matrix is padded
        differently from the target's scores the target's vocabulary.
        """


class Verifier(Component):
    """Accepts a path of draft tokens and draws the token after it (`hippo.accept` has the stock rules)."""

    #: True for verifiers that are exact only under greedy decoding.
    greedy_only: ClassVar[bool] = False
    #: False for verifiers written for chains only (the round refuses a tree drafter's proposals).
    trees: ClassVar[bool] = False

    @abstractmethod
    def verify(
        self,
        proposal: DraftProposal,  # tokens [n], q [n, V] | None, parents [n] | None (a chain)
        p_scores: torch.Tensor,  # [n+1, V] processed target scores: row 0 at the root, row i+1 after node i
        policy: TokenPolicy,
    ) -> Verdict: ...

    def verify_chains(
        self,
        proposals: Sequence[DraftProposal],  # B chains, on the host
        p_scores: torch.Tensor,  # [B, W, V] processed target scores; row b's first size + 1 are its own
        policies: Sequence[TokenPolicy],  # each row's
    ) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [B] long, next token [B] long, on p_scores' device
        """Optional: `verify` for B chains in one call, with no host read (the stock verifiers:
        `hippo.accept.accept_rows`). The round uses it where the class that defines `verify` (or one
        below it) defines this; otherwise it calls `verify` row by row."""
        raise NotImplementedError


class SessionKind(Protocol):
    """What takes over a role's prefilled sessions (packed weights, a static cache, compiled).

    A kind may also define `prefilling(model) -> context manager`, the context the role's prefill
    runs in (`prefilling` below)."""

    def open(self, session: ModelSession, new_tokens: int) -> ModelSession: ...


def prefilling(kind: SessionKind | None, model: torch.nn.Module) -> AbstractContextManager:
    """The context a role's prefill runs in: `kind.prefilling(model)` where the kind has one."""
    fn = getattr(kind, "prefilling", None)
    return nullcontext() if fn is None else fn(model)


class Job(Protocol):
    """The one generation a scheduler drives (`hippo.job.DecodeJob`): what a schedule may call.

    A schedule decides when the draft drafts and the target verifies; every emitted token goes
    through `first_token`, `target_step` or `verify_round`, so it never decides *what* is emitted.
    """

    done: bool  # EOS or the token budget reached
    remaining: int  # tokens still allowed
    stats: Stats
    policy: TokenPolicy
    alpha_prior: float | None  # the α a `gamma="auto"` plan starts from (None: the default, 1/2)

    def prefix(self) -> torch.Tensor: ...  # [T] prompt + emitted tokens
    def prefill_target(self) -> ModelSession: ...
    def draft_side(self) -> Any: ...  # hippo.draft.DraftSide, prefilled on the kept visual tokens
    def new_draft_side(self, own_policy: bool = False) -> Any: ...  # another one, not prefilled (executors)
    def first_token(self, target: ModelSession) -> None: ...
    def target_step(self, target: ModelSession) -> None: ...
    def verify_round(self, target: ModelSession, proposal: DraftProposal, bonus: bool = True) -> Verdict: ...

    # A batch (`hippo.engine`) drives its rows' jobs itself: one forward for all rows, then each row
    # settles its round as `verify_round` does (`hippo.accept.settle`, through `emit`). It also reads:
    tokens: list[int]  # the emitted tokens
    verifier: Verifier

    @property
    def length(self) -> int: ...  # T: prompt + emitted tokens
    def prefill_draft(self) -> ModelSession: ...
    def prune(self) -> torch.Tensor: ...  # [K] the kept visual indices, scored once per job
    # returns how many were kept (EOS, token budget); `logits` [m, V]: p's raw logits token i was
    # chosen from, at row rows[i] (None: row i), read only when log-probabilities were asked for
    def emit(
        self, tokens: Sequence[int], logits: torch.Tensor | None = None, rows: Sequence[int] | None = None
    ) -> int: ...
    def step_from(self, logits: torch.Tensor) -> int: ...  # [1, V]: emit p's own next token
    def finish(self) -> None: ...  # books the stats and closes the sessions


@attrs.frozen
class RoundInfo:
    """What a schedule's policy reads before a round of the engine (`GammaPolicy.gamma`)."""

    round: int  # rounds the live rows' batch has taken (0: its first)
    stats: tuple  # each live row's `Stats` so far (its rounds, accepted tokens)
    t_verify: float | None  # p's mean seconds per forward so far (None before the first)
    t_draft: float | None  # q's seconds per draft token so far (None before the first)


class GammaPolicy(ABC):
    """A schedule's own rule for γ, asked before every round of the engine for all live rows (a
    job alone is a batch of one): what `Scheduler.batch_gamma` returns where neither a fixed γ nor
    the cost model (`hippo.cost.AutoGamma`) is the rule."""

    @abstractmethod
    def gamma(self, info: RoundInfo) -> int:
        """γ for this round; 0: a step of the target alone (the draft idles and catches up later)."""


#: the engine's loop for a job alone, which `Scheduler.decode` runs: set by `hippo.engine` when it
#: is imported (the engine sits on these interfaces; they do not import it)
_ENGINE: dict[str, Callable[..., None] | None] = {"decode_alone": None}


class Scheduler(Component):
    """Decides when the draft drafts and the target verifies. It never decides *what* is emitted.

    A schedule is policy: `batch_gamma` says how the rows draft (a fixed γ, the cost model, or a
    `GammaPolicy` asked each round; 0: the target alone), and `batch_overlap` whether q drafts beside
    p. The engine (`hippo.engine`) runs every round, for a job alone (`decode`) and for rows decoded
    together. A schedule whose draft runs behind an executor also gives the producer of a job alone
    (`open_drafting`). Overriding `run` (a loop of one's own) is deprecated."""

    #: False for schedules that run the target alone.
    needs_draft: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "batch_gamma" in cls.__dict__ and "batches" not in cls.__dict__:
            cls.batches = True  # a policy is all the engine needs
        if "run" in cls.__dict__:
            import warnings

            warnings.warn(
                f"{cls.__module__}.{cls.__qualname__} overrides Scheduler.run, which is deprecated since "
                "hippo 0.2 and will be removed in 0.3: define batch_gamma (a fixed γ, an AutoGamma or a "
                "GammaPolicy) and the engine runs every round, for one request and for batches",
                DeprecationWarning,
                stacklevel=2,
            )

    def decode(self, job: Job) -> None:
        """Drive `job` alone until `job.done` (what `Pipeline.generate` calls): the engine's round as
        a batch of one, with this schedule's policy and producer. A schedule that still overrides
        the deprecated `run` runs its own loop instead."""
        if type(self).run is not Scheduler.run:
            self.run(job)
            return
        if _ENGINE["decode_alone"] is None:
            raise RuntimeError("hippo.engine is not imported: import hippo first")
        _ENGINE["decode_alone"](self, job, self.open_drafting(job))

    def run(self, job: Job) -> None:
        """Deprecated (a warning when a subclass overrides it; removed in 0.3): drive `job` until
        `job.done`, emitting tokens through `job.emit`. Define `batch_gamma` instead."""
        self.decode(job)

    def open_drafting(self, job: Job) -> Any:
        """The producer of `job` alone where its draft runs behind an executor (a
        `hippo.engine.Overlapped`: the parallel schedules), or None: the engine drafts it inline."""
        return None

    def open_batch_drafting(self, job: Job) -> Any:
        """Where the draft rows of a batch that `job` starts live when they draft beside p: a
        `hippo.executor.BatchDraft` of the schedule's executor (a draft process), or None: in the
        engine's process, on a thread beside p."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release workers (processes, streams) held across generate calls."""

    # ---- rows decoded together (`hippo.engine`) ------------------------------------------------
    #: whether this schedule has a batched form: then `batch_gamma` says how a batch drafts (set
    #: for a subclass that defines `batch_gamma`)
    batches: ClassVar[bool] = False

    def batch_gamma(self, job: Job, rows: int) -> Any:  # -> int | hippo.cost.AutoGamma | GammaPolicy
        """How rows that `job` joins (`rows` of them expected; 1 for a job alone) draft on the
        engine's round: a fixed γ for every round (0: the target alone), a `hippo.cost.AutoGamma`
        that re-chooses one γ for all live rows each round, or a `GammaPolicy` asked each round.
        Asked when a batch starts (its first row joins); a schedule may record its choice on
        `job.stats.plan`."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no policy: give it batch_gamma (a fixed γ, an AutoGamma or a "
            "GammaPolicy)"
        )

    def batch_overlap(self, job: Job) -> bool | str:
        """Whether a batch that `job` starts drafts beside the target (PEARL's pre-/post-verify, the
        parallel schedules): True, q drafts each row's next block on a thread (a CUDA side stream)
        while p verifies this one; "inline", the same blocks drafted in the engine's thread before
        p verifies (same tokens, no overlap: for simulated executors and tests). Default: False, q
        and p take turns (`serial`)."""
        return False

    def batch_done(self, job: Job) -> None:  # noqa: B027 - optional hook
        """Told when a row of a batch has finished (its stats are final), e.g. to learn its α."""


@attrs.frozen
class ScoringContext:
    """What a scorer may read beyond the visual tokens themselves."""

    adapter: Adapter
    encoded: Encoded  # the target's encoded prompt
    target: ModelSession | None = None  # prefilled target (KV cache), when available
    #: per-video memo (a video context's): question-independent scores may be kept here across questions
    memo: dict | None = None


@attrs.frozen
class Encoded:
    """A prompt after the vision encoder: what a decoder needs for its prefill.

    Adapters may subclass this to carry backbone extras (deepstack features, audio...).
    """

    input_ids: torch.Tensor  # [L] long
    embeds: torch.Tensor  # [L, D] input embeddings with visual features scattered in
    positions: torch.Tensor  # [P, L] position ids (P = 3 for M-RoPE, 1 for 1-D RoPE)
    visual: VisualTokens
    next_position: int  # position id of the first generated token
    extras: dict = attrs.field(factory=dict)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


class Adapter(ABC):
    """Everything backbone-specific: loading, encoding the video, positions, and pruned prefill."""

    #: Registry name, e.g. "qwen2_5_vl".
    name: ClassVar[str] = ""
    #: `config.model_type` values this adapter handles.
    model_types: ClassVar[tuple[str, ...]] = ()
    #: The transformers class for `from_pretrained`.
    model_class: ClassVar[Any] = None
    #: Whether the backbone also needs the video's audio track (audio-visual models).
    needs_audio: ClassVar[bool] = False
    #: Whether the model's logits are its output head (`get_output_embeddings()`) applied to its
    #: decoder's (`get_decoder()`) last hidden state with nothing in between (no scaling, no
    #: soft-capping): text-only steps then call those two directly (`KVSession(direct=True)`).
    direct_steps: ClassVar[bool] = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Adapter:
        # Record the options the adapter is built with, whatever the subclass's signature, so that
        # `type(a)(model, **a.options)` rebuilds it elsewhere (the draft's process).
        self = super().__new__(cls)
        self._options = _options(cls, self, args, kwargs)
        return self

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @property
    def options(self) -> dict[str, Any]:
        """The keyword options this adapter was built with (beyond the model), e.g. {"positions": ...}."""
        return dict(self._options)

    @classmethod
    def matches(cls, config: Any) -> bool:
        return getattr(config, "model_type", None) in cls.model_types

    @classmethod
    def load(cls, path: str, **kwargs: Any) -> torch.nn.Module:
        return cls.model_class.from_pretrained(path, **kwargs)

    @property
    def device(self) -> torch.device:
        """Where the model's inputs go: its input embedding's device (the first of a device map)."""
        return input_device(self.model)

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """Every device holding the model's weights, `device` first (several under a device map)."""
        return model_devices(self.model)

    # ---- optional: a tiny random model and synthetic inputs, for tests, demos and benchmarks ----
    #: Module with `tiny_model(role, seed=, dtype=)` and `synthetic_inputs(model, video, before, after)`.
    tiny_module: ClassVar[str | None] = None

    @classmethod
    def _tiny(cls) -> Any:
        if cls.tiny_module is None:
            raise NotImplementedError(f"adapter {cls.name!r} ships no tiny model")
        return importlib.import_module(cls.tiny_module)

    @classmethod
    def tiny_model(cls, role: str = "target", *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
        """A randomly initialised tiny model of the real class ('target' or the smaller 'draft')."""
        return cls._tiny().tiny_model(role, seed=seed, dtype=dtype)

    @classmethod
    def synthetic_inputs(
        cls,
        model: Any,
        video: torch.Tensor,  # [T, H, W, 3] floats in [0, 1]
        text_before: list[int],
        text_after: list[int],
        **options: Any,
    ) -> dict[str, Any]:
        """Processor-shaped inputs for one video between two runs of text token ids."""
        return cls._tiny().synthetic_inputs(model, video, text_before, text_after, **options)

    # ---- optional: inputs from a decoded video and a prompt (`hippo generate`, generate_from_video) ----
    def build_inputs(
        self,
        tokenizer: Any,
        clip: VideoClip,  # frames [T, H, W, 3] uint8, timestamps [T]
        prompt: str,
        *,
        max_pixels: int | None = None,
        video_processor: Any = None,
        audio: torch.Tensor | None = None,  # [S] mono waveform, for adapters with needs_audio
    ) -> dict[str, Any]:
        """The processor-shaped inputs of one user turn: the video, then `prompt`, chat template applied.

        `max_pixels` caps the pixels per frame; `video_processor` is the checkpoint's transformers
        video processor when one can be loaded (else the adapter lays the pixels out itself).
        """
        raise UnsupportedError(
            f"adapter {self.name!r} cannot build its inputs from a video file; run the model's own "
            "processor and call Pipeline.generate(inputs) instead"
        )

    # ---- optional: several prompts in one padded processor output (Pipeline.generate_batch) ----------
    def batch_items(self, inputs: dict[str, Any]) -> list[Items]:
        """The media of a padded batch (`inputs`: one processor call on several prompts) as runs of
        items (`hippo.types.Items`), so that `hippo.padded.split_rows` can give each row its own. This
        default knows no media: a batch with any is refused by key name; adapters override it."""
        return []

    # ---- video contexts (Pipeline.prepare / ask): a cached prefix extended by a question ----------
    def prompt_positions(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, int]:
        """(position ids [P, L] of the whole prompt, position of the first generated token), as `encode`
        computes them. This default runs `encode`; adapters override it to skip the vision encoder."""
        encoded = self.encode(inputs)
        return encoded.positions, encoded.next_position

    def shared_prefix_length(self, input_ids: torch.Tensor) -> int:  # input_ids [L]
        """Tokens up to and including the last multimodal placeholder (video, image, audio): the prefix
        whose KV does not depend on the question that follows. 0 if there is none."""
        cfg = self.model.config
        names = ("video_token_id", "image_token_id", "audio_token_id")
        media = {int(v) for n in names for v in [getattr(cfg, n, None)] if isinstance(v, int)}
        hits = torch.isin(input_ids.cpu(), torch.tensor(sorted(media), dtype=torch.long)).nonzero()
        return int(hits.max()) + 1 if hits.numel() else 0

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:  # ids [k] -> [k, D]
        """Input embeddings of plain text tokens (what `encode` puts at non-visual rows)."""
        with torch.inference_mode():
            return self.model.get_input_embeddings()(ids.to(self.device))

    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def context_length(self) -> int: ...

    @abstractmethod
    def encode(self, inputs: dict[str, Any]) -> Encoded:
        """Run the vision encoder and build input embeddings and positions for the full prompt."""

    @abstractmethod
    def prefill(self, encoded: Encoded, keep: torch.Tensor | None) -> ModelSession:
        """Prefill on the full prompt (keep=None) or with only the kept visual tokens (keep [K])."""

    def prefill_pieces(
        self, encoded: Encoded, rows: int, around: Callable[[int, int], AbstractContextManager]
    ) -> Iterator[ModelSession | None]:
        """`prefill(encoded, None)` as forwards of the prompt rows 0..rows-1, rows..2·rows-1, ...:
        each runs inside `around(start, end)`; yields None after each piece but the last, then the
        session. Between two pieces the model may run other forwards (other requests' decoding). This
        default runs one piece, `around(0, L)`; adapters whose model takes its prefill in pieces
        override it."""
        with around(0, encoded.length):
            session = self.prefill(encoded, None)
        yield session


def _options(cls: type, self: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of `cls(model, *args[1:], **kwargs)` beyond the model, by name."""
    sig = inspect.signature(cls.__init__)
    try:
        bound = sig.bind(self, *args, **kwargs)
    except TypeError:  # bad arguments (raised again by __init__) or unpickling (state restored after)
        return {}
    out: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[2:]:  # past self and the model
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(f"{cls.__name__}: pass adapter options by keyword, got positional {value!r}")
        else:
            out[name] = value
    return out
