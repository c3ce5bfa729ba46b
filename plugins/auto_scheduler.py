"""`scheduler="auto"`: the schedule and γ chosen from costs measured once per machine and model pair.

Notation: p = target, q = draft, γ = draft length, α = the probability a draft token is accepted.

Measured on the first job of a new machine + model pair (`measure`), with `hippo.cost`'s calibration:
t_verify(k) of p for the widths a round may verify, and t_draft, one step of q on all visual tokens
("full") and on the pipeline's kept ones ("pruned"). They are cached in `<cache_dir>/<key>.json`
(default ~/.cache/hippo/costs/), keyed by a fingerprint of the CPU (model and flags), the kernels
torch picks on it (`ISA_VARIABLES` can cap them), the device, the thread count, torch and
transformers, and each model's config and tensor shapes (`model_digest`); a change of any of them is
another key, and a file that cannot be read is measured again and rewritten.

Each job then gets the schedule of the most predicted tokens/s (`predict`):
- autoregressive, 1 / t_decode, chosen only when even a draft that is always right (α = 1) would lose
  (where the keep ratio is planned, below: over the expected answer, the draft's prefill included,
  so a short answer on a long video goes to the target alone);
- serial: q and p take turns; pearl and hippo: q drafts while p verifies, which they can only do
  where the auto executor gives the draft its own thread or process (else they are not offered).
  Decoding, they are predicted alike. They differ in the prefill: hippo prunes early and prefills
  the draft beside p's prefill (re-prefilling it once p's attention has re-scored the video), pearl
  prefills it after. That is free only where the draft has a device of its own: on one CPU or one GPU
  the early prefill takes p's compute (on 2 cores with one thread per model, `hippo bench --quick`:
  TTFT 0.41 s against pearl's 0.27 s). So a tie goes to hippo where q and p are on different devices,
  and to pearl where they share one;
at the α seen in this pipeline's earlier jobs (1/2 before the first). Where even the best drafting
schedule is predicted slower than the target alone at that α (over the expected answer, its prefill
included, where the keep ratio is planned), the next job runs the target alone,
without the draft's prefill, and a later one probes the draft again: after 1 such job, then 2, 4, ...
up to `JOB_BACKOFF_MAX` while the probes still lose (no regret on a draft that cannot help; `why`
says so). A probe, or a schedule predicted to pay, decodes with γ re-chosen each round, so a draft
that turns out poor mid-answer still hands over to the target alone.

The keep ratio (`keep_ratios`, by default `KEEP_RATIOS`; `()` keeps the selector's own), where the
pipeline's selector has one: each job's draft keeps the share of the visual tokens that answers
soonest, counting q's prefill on the kept tokens, then the answer the job is expected to give (the
mean length of the latest answers) at the tokens/s predicted from q's step and the α seen at that
ratio. q's step and prefill are lines through what was measured at each ratio on the first job (the
prefill without q's vision encoding, which every ratio pays) and what later jobs took
(`draft_seconds`), so they follow the video's length. α is kept per ratio and per length band
(`length_band`: videos within a factor of ~4), since what pruning costs the draft depends on how long
the video is. On a band's first job the candidates are the selector's own ratio and larger ones, at
the pipeline's α; later, a ratio not tried in the band is predicted at the α of the nearest larger
ratio tried (fewer tokens cannot help the draft), else halfway from the nearest smaller one's α to 1,
so it is tried once where it could pay. A ratio is taken over a larger one only where it is predicted
`KEEP_MARGIN` sooner, so nothing is pruned where pruning does not pay (short videos, where q's step
and prefill are per-operation overhead).

The chosen drafting schedule runs with `gamma="auto"` on the cached curve, so it still re-chooses γ
each round, γ = 0 (the target alone) included. `Stats.plan` records the choice and each option's
prediction.

A batch (`Pipeline.generate_batch`, `Pipeline.map`, `hippo batch`, `hippo serve`) is planned the same
way, with γ re-chosen each round for all its rows on t_verify(B, k) measured on the batch
(`batch_gamma`): `serial`, or `pearl`/`hippo` where the draft can work beside the target (the batch's
draft then drafts each row's next block on a thread while the target verifies), or the target alone.
A batch's rows keep the selector's own ratio, and are timed over the expected answer with q's prefill
on the tokens it keeps, as a job alone (once q's prefill has been measured).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import transformers

from hippo import hookimpl
from hippo.cost import (
    GAMMA_MAX,
    Acceptance,
    AutoGamma,
    VerifyCurve,
    calibration_widths,
    costs_option,
    fixed_costs,
    measure_verify_curve,
    rates,
)
from hippo.errors import ConfigError
from hippo.interfaces import Scheduler
from hippo.job import DecodeJob
from hippo.placement import input_device, model_devices
from hippo.plugins.auto_executor import choose as choose_executor
from hippo.plugins.auto_executor import usable_cores
from hippo.registry import lookup
from hippo.validators import positive_int
from hippo.visual import budget, keep_ratio_of

#: the drafting schedules `auto` may run, in order of preference on equal predictions: hippo before
#: pearl where the draft has a device of its own (`own_device`), pearl before hippo where it has not
DRAFTING = ("serial", "hippo", "pearl")
#: the cache's format; a file of another version is measured again
VERSION = 3
#: the keep ratios `auto` plans among where the pipeline's selector has one (1.0: nothing pruned)
KEEP_RATIOS = (1.0, 0.25, 0.1, 0.05)
#: a keep ratio is chosen over a larger one only where it is predicted this much faster
KEEP_MARGIN = 0.03
#: the draft steps and prefills of the latest jobs that `draft_seconds` fits (with the first job's
#: calibration), and the answer lengths the planner expects the next one from
LIVE_POINTS = 16
#: environment variables that cap the instruction set of torch's, oneDNN's and MKL's kernels
#: where drafting is predicted to lose at the α of the pipeline's earlier jobs, the target decodes the
#: next jobs alone, with no draft prefill, before the draft is tried again (a probe): first 1 job,
#: doubling after each probe that still loses, up to this many
JOB_BACKOFF_MAX = 16
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def _answer_seconds(expected: dict[str, Any] | None, own: bool) -> Callable[[dict, str], float]:
    """How a schedule is timed against the others from its predicted tokens/s (`rates`): per token
    where the expected answer is not known (`expected` None), else the expected answer's seconds
    (`expected`: its "answer_tokens" and q's prefill, "t_prefill"), the prefill included where q
    does not run it on a device of its own beside the target's (hippo's synchronous prefill)."""

    def per_token(rate: float) -> float:
        return 1.0 / rate if rate > 0 else math.inf

    if expected is None:
        return lambda rates, name: per_token(rates[name])

    def seconds(rates: dict, name: str) -> float:
        hidden = name == "autoregressive" or (name == "hippo" and own)
        return (0.0 if hidden else expected["t_prefill"]) + expected["answer_tokens"] * per_token(rates[name])

    return seconds


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hippo" / "costs"


def _cpu() -> str:
    """The CPU's model name and instruction-set flags (what decides which kernels run)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', '')} | {fields.get('flags', '')}"


def model_digest(model: torch.nn.Module) -> str:
    """A hash of what a model's seconds depend on: its config and each tensor's name, dtype and shape.
    Not the values: the costs are timings, which retraining does not change, and a pass over every
    weight would cost each cold process seconds on a large model before its first token."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    described = type(model).__name__
    if config is not None:  # the same checkpoint loaded from another directory is the same model
        described = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    h.update(json.dumps(described, sort_keys=True, default=str).encode())
    for name, t in model.state_dict().items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
    return h.hexdigest()


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's inputs go (the first device of a target spread by a device map)."""
    return input_device(model)


def device_names(model: torch.nn.Module) -> str:
    """The model's devices, e.g. "cuda:0" or "cuda:0,cuda:1,cuda:2" for a target spread over three."""
    return ",".join(map(str, model_devices(model)))


def fingerprint(target: torch.nn.Module, draft: torch.nn.Module) -> dict[str, Any]:
    """What the measured costs depend on: the machine, the libraries, the models."""
    return {
        "version": VERSION,
        "cpu": _cpu(),
        "device": [device_names(target), device_names(draft)],
        "cuda": torch.cuda.get_device_name(model_device(target))
        if model_device(target).type == "cuda"
        else None,
        "threads": torch.get_num_threads(),
        # the kernels torch, oneDNN and MKL pick; the variables cap them below what the CPU offers
        "kernels": [torch.backends.cpu.get_cpu_capability()] + [os.environ.get(v) for v in ISA_VARIABLES],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "target": model_digest(target),
        "draft": model_digest(draft) if draft is not target else "the target",
    }


@attrs.frozen
class Costs:
    """Measured seconds: t_verify(k) of p, and one step of q on all / the kept visual tokens;
    `draft_steps` and `draft_prefills`: (tokens q attends to, seconds of its step / of its prefill's
    forward) at each keep ratio measured."""

    verify: dict[int, float]
    draft_full: float
    draft_pruned: float
    draft_steps: tuple[tuple[int, float], ...] = ()
    draft_prefills: tuple[tuple[int, float], ...] = ()

    @property
    def curve(self) -> VerifyCurve:
        return VerifyCurve(self.verify)

    def to_json(self) -> dict[str, Any]:
        return {
            "verify": {str(k): v for k, v in self.verify.items()},
            "draft": [self.draft_full, self.draft_pruned],
            "draft_steps": [list(p) for p in self.draft_steps],
            "draft_prefills": [list(p) for p in self.draft_prefills],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Costs:
        verify = {int(k): float(v) for k, v in d["verify"].items()}
        full, pruned = (float(x) for x in d["draft"])
        steps = tuple((int(n), float(t)) for n, t in d.get("draft_steps", ()))
        prefills = tuple((int(n), float(t)) for n, t in d.get("draft_prefills", ()))
        if (
            not verify
            or min(verify.values()) <= 0
            or full <= 0
            or pruned <= 0
            or any(t <= 0 for _, t in steps + prefills)
        ):
            raise ValueError("non-positive seconds")
        return cls(verify, full, pruned, steps, prefills)


def load(path: Path, key: dict[str, Any]) -> Costs | None:
    """The cached costs at `path` if they were measured for `key`; None if absent, stale or corrupt."""
    try:
        d = json.loads(path.read_text())
        return Costs.from_json(d["costs"]) if d["key"] == key else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save(path: Path, key: dict[str, Any], costs: Costs) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "costs": costs.to_json()}, indent=1))
    os.replace(tmp, path)  # atomic: another process never reads half a file


def measure(job: DecodeJob, gamma_max: int, keep_ratios: tuple[float, ...] = ()) -> Costs:
    """Time p's forwards of 1, 2, 4, 8 and γ_max + 1 tokens, and q's prefill and one-token step on all
    visual tokens, on the kept ones and on those of each of `keep_ratios`; every session ends as it
    began (the job then runs as usual)."""
    target = job.prefill_target()
    prefix = job.prefix()  # [T] the prompt
    widths = calibration_widths(gamma_max)
    verify = measure_verify_curve(target, prefix, widths, repeats=3).seconds
    n = job.target_encoded().visual.n
    text = prefix.shape[0] - n
    scorer, own = job.pipeline.scorer, keep_ratio_of(job.pipeline.selector)
    keeps = {"full": None, "pruned": job.select(scorer)}
    keeps.update({r: job.select(scorer, r) for r in keep_ratios if r < 1.0 and r != own})  # own: "pruned"
    side = job.new_draft_side()
    try:
        side.encoded()  # q's vision encoding, the same at every ratio: not in the prefills' seconds
        draft, prefills = {}, []
        for name, keep in keeps.items():
            side.prefill(keep)
            tokens = text + (n if keep is None else int(keep.shape[0]))
            prefills.append((tokens, side.seconds_prefill))
            draft[name] = (tokens, measure_verify_curve(side.session, prefix, (1,), repeats=5)(1))
    finally:
        side.close()
    steps = tuple(draft.values())
    return Costs(verify, draft["full"][1], draft["pruned"][1], steps, tuple(prefills))


def draft_seconds(steps: list[tuple[int, float]], tokens: int) -> float:
    """q's step (or prefill) on `tokens` tokens: the least-squares line through `steps` ((tokens,
    seconds) pairs), its slope at least 0 (a step reads each token's keys and values once)."""
    xs, ys = [float(n) for n, _ in steps], [t for _, t in steps]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var > 0 else 0.0
    return max(my + slope * (tokens - mx), min(ys) * 0.5)


def predict(
    costs: Costs, alpha: float, overlap: bool, gamma_max: int, t_draft: float | None = None
) -> dict[str, float | None]:
    """Predicted tokens/s of each schedule at acceptance α (None: not offered on this job), with q's
    step `t_draft` (default: measured on the kept visual tokens)."""
    curve, t_draft = costs.curve, costs.draft_pruned if t_draft is None else t_draft
    serial = rates(curve, alpha, t_draft, False, gamma_max)
    parallel = max(rates(curve, alpha, t_draft, True, gamma_max)[1:]) if overlap else None
    return {
        "autoregressive": serial[0],
        "serial": max(serial[1:]),
        "hippo": parallel,
        "pearl": parallel,
    }


def own_device(job: DecodeJob) -> bool:
    """Whether the draft runs on a device of its own (another GPU), where its prefill beside the
    target's costs the target nothing."""
    p = job.pipeline
    return not set(p.draft_adapter.devices) & set(p.target_adapter.devices)


def length_band(visual_tokens: int) -> int:
    """Videos whose visual tokens are within a factor of ~4 share a band: the planner keeps the α seen
    at each keep ratio per band, since what a draft loses to pruning depends on the video's length."""
    return int(math.log2(max(visual_tokens, 1)) // 2)


def _points(name: str, zero: bool):
    """A converter of (tokens, seconds) pairs for the option `name`; `zero`: 0 seconds allowed."""

    def convert(value: Any) -> tuple[tuple[int, float], ...]:
        try:
            points = tuple((int(n), float(t)) for n, t in value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be (tokens, seconds) pairs, got {value!r}") from None
        if any(n < 0 or t < 0 or (t == 0 and not zero) for n, t in points):
            seconds = "seconds >= 0" if zero else "positive seconds"
            raise ValueError(f"{name} need tokens >= 0 and {seconds}, got {value!r}")
        return points

    return convert


def _ratios(instance: Any, attribute: attrs.Attribute, value: tuple) -> None:
    if not all(isinstance(r, int | float) and 0 < r <= 1 for r in value):
        raise ValueError(f"{attribute.name} must be keep ratios in (0, 1], got {value!r}")


class AutoScheduler(Scheduler):
    """Measures the machine once, then runs each job with the schedule predicted fastest (module doc)."""

    @attrs.frozen
    class Config:
        gamma_max: int = attrs.field(default=GAMMA_MAX, validator=positive_int)
        cache_dir: str | None = None  # None: ~/.cache/hippo/costs (XDG_CACHE_HOME)
        #: fixed costs instead of measuring them, as serial/pearl/hippo take them:
        #: {"verify": {k: seconds}, "draft": seconds per draft step} (the cache is then not used)
        costs: dict | None = attrs.field(default=None, validator=costs_option)
        #: the keep ratios a job's draft may get (module doc); (): the selector's own
        keep_ratios: tuple = attrs.field(default=KEEP_RATIOS, converter=tuple, validator=_ratios)
        #: with `costs`: q's step against the tokens it attends to, ((tokens, seconds), ...), for the
        #: keep-ratio planner (without it q's step is `costs["draft"]` at every ratio)
        draft_steps: tuple = attrs.field(default=(), converter=_points("draft_steps", zero=False))
        #: with `costs`: q's prefill against the tokens it keeps, the same way (without it: free)
        draft_prefills: tuple = attrs.field(default=(), converter=_points("draft_prefills", zero=True))

    def __init__(self, config=None):
        super().__init__(config)
        self.costs: Costs | None = None
        if self.config.costs is not None:
            curve, draft = fixed_costs(self.config.costs)
            if draft is None:
                raise ConfigError('scheduler "auto": fixed costs need the draft\'s seconds too ("draft")')
            c = self.config
            self.costs = Costs(curve.seconds, draft, draft, c.draft_steps, c.draft_prefills)
        self.acceptance = Acceptance()  # across this pipeline's jobs
        #: α across the jobs at each (length band, keep ratio) (`length_band`)
        self.by_keep: dict[tuple[int, float], Acceptance] = {}
        #: the latest jobs' (tokens q attends to, its step), (tokens q kept, its prefill's seconds) and
        #: answer lengths
        self.draft_steps: deque[tuple[int, float]] = deque(maxlen=LIVE_POINTS)
        self.draft_prefills: deque[tuple[int, float]] = deque(maxlen=LIVE_POINTS)
        self.answers: deque[int] = deque(maxlen=LIVE_POINTS)
        self._schedulers: dict[str, Scheduler] = {}
        self._batches: AutoGamma | None = None
        self._batch_parallel = False  # the batch now starting drafts beside the target
        self._batch_name = "serial"  # and its schedule
        self.drafted_jobs = 0  # jobs (and batch rows) with a drafted round: α is seen, not a prior
        self.skip = 0  # jobs left to run the target alone before the draft's next probe
        self.probe_due = False  # the next job that would lose drafts anyway, once `skip` is 0
        self.job_backoff = 1  # the wait after the next probe that still loses (`JOB_BACKOFF_MAX`)

    def _costs(self, job: DecodeJob) -> Costs:
        if self.costs is None:
            p = job.pipeline
            key = fingerprint(p.target_adapter.model, p.draft_adapter.model)
            name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
            path = Path(self.config.cache_dir or default_cache_dir()) / f"{name}.json"
            self.costs = load(path, key)
            if self.costs is None:
                self.costs = measure(job, self.config.gamma_max, self._ratios(job) or ())
                save(path, key, self.costs)
        return self.costs

    def _scheduler(self, name: str) -> Scheduler:
        if name not in self._schedulers:
            options: dict[str, Any] = {}
            if name != "autoregressive":
                options = {"gamma": "auto", "costs": {"verify": self.costs.verify}}
                if name != "serial":
                    options["gamma_max"] = self.config.gamma_max
            self._schedulers[name] = lookup("schedulers", name).from_options(**options)
        return self._schedulers[name]

    def choose(self, job: DecodeJob, batch: int = 0) -> tuple[str, dict[str, Any]]:
        """(schedule, the record of why) for this job, or for a batch of `batch` rows led by it."""
        costs, g = self._costs(job), self.config.gamma_max
        overlap = choose_executor(job, usable_cores()) != ("inline", {"overlap": "off"})
        keep = None if batch else self._keep(job, costs, overlap)
        expected = keep if not batch else self._batch_answer(job, costs)
        alpha = self.acceptance.alpha if keep is None else keep["alpha"]
        t_draft = None if keep is None else keep["t_draft"]
        now = predict(costs, alpha, overlap, g, t_draft)
        best_case = predict(costs, 1.0, overlap, g, t_draft)
        order = DRAFTING if own_device(job) else ("serial", "pearl", "hippo")
        offered = [n for n in order if now[n] is not None]
        seconds = _answer_seconds(expected, own_device(job))
        if min(seconds(best_case, n) for n in offered) > seconds(now, "autoregressive"):
            name, why = (
                "autoregressive",
                "even a draft that is always right would be slower than the target alone",
            )
            if expected is not None:
                why += f" over the expected answer ({expected['answer_tokens']} tokens), its prefill included"
        else:
            name = max(offered, key=lambda n: now[n])  # the first of `order` on a tie
            why = f"the most predicted tokens/s of the drafting schedules at α = {alpha:.2f}"
            if name == "hippo":
                why += "; hippo, not pearl: the draft has its own device, so its early prefill is free"
            elif name == "pearl":
                why += "; pearl, not hippo: the draft shares the target's device, so an early draft prefill would slow the target's"
            if seconds(now, name) > seconds(now, "autoregressive"):
                why += "; slower than the target alone there, so γ = 0 decodes with it, probing the draft"
        record = {
            "schedule": name,
            "why": why,
            "alpha": alpha,
            "draft_overlaps_target": overlap,
            "tokens_per_second": now,
            "tokens_per_second_if_always_right": best_case,
            "costs": {"t_decode": costs.verify[min(costs.verify)], **attrs.asdict(costs)},
        }
        if expected is not None:  # the expected answer's seconds, the draft's prefill included
            record["answer_seconds"] = {n: seconds(now, n) for n in now if now[n] is not None}
        if batch:
            record["batch"] = batch
        if keep is not None:
            record["keep"] = keep
        return name, record

    def _batch_answer(self, job: DecodeJob, costs: Costs) -> dict[str, Any] | None:
        """What a batch row is timed over, as `_keep` times a job alone: its expected answer (the mean
        of the latest answers, at most its `max_new_tokens`) and q's prefill on the tokens the
        selector keeps (None where q's prefill was never measured: tokens/s decide)."""
        prefills = self._prefill_points(costs)
        if not prefills:
            return None
        own = keep_ratio_of(job.pipeline.selector)
        n = job.target_encoded().visual.n
        tokens = job.prompt_ids.shape[0] - n + (n if own is None or own >= 1.0 else budget(n, own))
        return {"t_prefill": draft_seconds(prefills, tokens), "answer_tokens": self._answer_tokens(job)}

    def _prefill_points(self, costs: Costs) -> list[tuple[int, float]]:
        """q's prefills measured (tokens, seconds): the first job's calibration and the latest jobs'
        (the fixed costs alone where given)."""
        return [*costs.draft_prefills, *([] if self.config.costs is not None else self.draft_prefills)]

    def _answer_tokens(self, job: DecodeJob) -> int:
        """The answer the job is expected to give: the mean of the latest answers, at most its
        `max_new_tokens`."""
        if not self.answers:
            return job.max_new_tokens
        return min(job.max_new_tokens, round(sum(self.answers) / len(self.answers)))

    # ---- the keep ratio -------------------------------------------------------------------------
    def _ratios(self, job: DecodeJob) -> list[float] | None:
        """The keep ratios this job's draft may get, largest first (None: the selector's own)."""
        own = keep_ratio_of(job.pipeline.selector)
        if not self.config.keep_ratios or own is None:
            return None
        return sorted({*self.config.keep_ratios, own}, reverse=True)

    def _seen(self, band: int, ratio: float) -> float | None:
        a = self.by_keep.get((band, ratio))
        return None if a is None else a.alpha

    def _alpha_at(self, band: int, ratio: float, ratios: list[float]) -> float | None:
        """α predicted at `ratio` for a video in `band` (None: not a candidate yet): the α seen there;
        untried, the α of the nearest larger ratio tried (an upper bound), or halfway from the nearest
        smaller one's to 1."""
        seen = self._seen(band, ratio)
        if seen is not None:
            return seen
        larger = (self._seen(band, r) for r in sorted(r for r in ratios if r > ratio))
        upper = next((a for a in larger if a is not None), None)
        if upper is not None:
            return upper
        smaller = (self._seen(band, r) for r in sorted((r for r in ratios if r < ratio), reverse=True))
        lower = next((a for a in smaller if a is not None), None)
        return None if lower is None else lower + (1.0 - lower) / 2

    def _keep(self, job: DecodeJob, costs: Costs, overlap: bool) -> dict[str, Any] | None:
        """The job's keep ratio and the record of why (None where the planner is off); sets it on the
        job (`DecodeJob.keep_ratio`). Each ratio is timed over the answer the job is expected to give
        (the mean of the latest answers, at most its `max_new_tokens`): q's prefill on the tokens it
        keeps, then that many tokens at the predicted tokens/s."""
        ratios = self._ratios(job)
        if ratios is None:
            return None
        own, g = keep_ratio_of(job.pipeline.selector), self.config.gamma_max
        n = job.target_encoded().visual.n
        text = job.prompt_ids.shape[0] - n
        fixed = self.config.costs is not None  # fixed costs are the whole model
        steps = [*costs.draft_steps, *([] if fixed else self.draft_steps)]
        steps = steps or [(text + budget(n, own), costs.draft_pruned)]
        prefills = self._prefill_points(costs)
        answer = self._answer_tokens(job)
        band = length_band(n)
        fresh = not any(b == band for b, _ in self.by_keep)  # nothing seen yet on videos of this length
        options: dict[float, dict[str, float]] = {}
        for r in ratios:
            alpha = self.acceptance.alpha if fresh and r >= own else self._alpha_at(band, r, ratios)
            if alpha is None:
                continue
            tokens = text + (n if r >= 1.0 else budget(n, r))
            t = draft_seconds(steps, tokens)
            drafting = [v for k, v in predict(costs, alpha, overlap, g, t).items() if k != "autoregressive"]
            rate = max(v for v in drafting if v)
            prefill = draft_seconds(prefills, tokens) if prefills else 0.0
            options[r] = {
                "alpha": alpha,
                "t_draft": t,
                "t_prefill": prefill,
                "tokens_per_second": rate,
                "answer_seconds": prefill + answer / rate,
            }
        best = next(iter(options))  # the largest; a smaller one must be KEEP_MARGIN faster
        for r, o in options.items():
            if o["answer_seconds"] * (1 + KEEP_MARGIN) < options[best]["answer_seconds"]:
                best = r
        job.keep_ratio = best
        return {
            "ratio": best,
            "band": band,
            "fresh": fresh,
            "answer_tokens": answer,
            **options[best],
            "options": {str(r): o for r, o in options.items()},
        }

    def _no_regret(self, name: str, record: dict[str, Any]) -> str:
        """Where the chosen drafting schedule is predicted slower than the target alone at an α seen
        on earlier jobs, run the target alone (its γ = 0 fallback would pay the draft's prefill and
        probes first), except for a probe job after `skip` such jobs (the module doc); a schedule
        predicted to pay resets the wait."""
        rates, answer = record["tokens_per_second"], record.get("answer_seconds")
        pays = (
            rates[name] >= rates["autoregressive"]
            if answer is None
            else answer[name] <= answer["autoregressive"]
        )
        if name == "autoregressive" or pays:
            self.skip, self.job_backoff, self.probe_due = 0, 1, False
            return name
        if not self.drafted_jobs or record.get("keep", {}).get("fresh"):
            return name  # α is still the prior, or nothing was seen on videos of this length: see
        if self.probe_due and not self.skip:  # the wait is over: try the draft again
            self.probe_due = False
            record["why"] += "; a probe of the draft after jobs it was predicted to lose"
            return name
        if not self.probe_due:  # a drafted job just lost: wait 1 job, then 2, 4, ...
            self.skip, self.probe_due = self.job_backoff, True
            self.job_backoff = min(2 * self.job_backoff, JOB_BACKOFF_MAX)
        self.skip -= 1
        record["schedule"] = "autoregressive"
        record["why"] = (
            f"drafting was predicted slower than the target alone at α = {record['alpha']:.2f} "
            "(earlier jobs): the target alone, without the draft's prefill; the draft is tried "
            f"again after {self.skip} more job(s)"
        )
        record.pop("keep", None)
        return "autoregressive"

    def decode(self, job: DecodeJob) -> None:
        name, record = self.choose(job)
        name = self._no_regret(name, record)
        if name == "autoregressive":
            job.keep_ratio = None
        job.stats.plan.update(record)
        job.alpha_prior = record["keep"]["alpha"] if "keep" in record else self.acceptance.alpha
        self._scheduler(name).decode(job)
        self._carry(job)

    batches = True

    def batch_gamma(self, job: DecodeJob, rows: int) -> int | AutoGamma:
        """A batch (`hippo.engine`) runs the drafting schedule `choose` picks (serial, or pearl/hippo
        beside the target) with γ re-chosen each round for all its live rows (`hippo.cost`:
        t_verify(B, k) measured on the batch), or the target alone; chosen on this machine's one-row
        costs at the α of this pipeline's earlier jobs, and recorded on `job.stats.plan`."""
        name, record = self.choose(job, batch=rows)
        name = self._no_regret(name, record)
        job.stats.plan.update(record)
        job.alpha_prior = self.acceptance.alpha
        self._batch_parallel = name in ("pearl", "hippo")
        self._batch_name = name
        return 0 if name == "autoregressive" else self._batch_gamma()

    def batch_overlap(self, job: DecodeJob) -> bool:
        """Beside the target where the batch's schedule (`batch_gamma`'s choice) is pearl or hippo."""
        return self._batch_parallel

    def open_batch_drafting(self, job: DecodeJob) -> Any:
        """Where that schedule's executor puts the batch's draft rows: a draft process where it would
        run a job's draft in one (greedy, both models on a CPU of 4 or more cores), else None."""
        return self._scheduler(self._batch_name).open_batch_drafting(job) if self._batch_parallel else None

    def batch_done(self, job: DecodeJob) -> None:
        self._carry(job)

    def _carry(self, job: DecodeJob) -> None:
        """Put the job's measured α and decode-phase tokens/s (after its first token; a batch row's own
        tokens over a time it shares with its batch) on its plan as "measured"; count its rounds in the α the pipeline's
        next job starts from, and in the α of its keep ratio and video length; keep its answer's length
        and q's step and prefill."""
        s = job.stats
        decoding, tokens = job.seconds_decoding, len(job.tokens)
        s.plan["measured"] = {  # the outcome, beside the prediction (`choose`'s record)
            "alpha": s.acceptance_rate if s.rounds else None,
            "tokens_per_second": (tokens - 1) / decoding if tokens > 1 and decoding > 0 else None,
        }
        self.drafted_jobs += bool(s.rounds)
        self.acceptance.update(s)
        self.acceptance.seen = 0
        if job.keep_ratio is not None and s.rounds:
            a = self.by_keep.setdefault((length_band(s.visual_tokens), job.keep_ratio), Acceptance())
            a.update(s)
            a.seen = 0
        self.answers.append(len(job.tokens))
        tokens = job.prompt_ids.shape[0] - s.visual_tokens + s.kept_visual_tokens  # q attended to
        step, prefill = job.draft_step_seconds, job.draft_prefill_seconds
        if step:  # q ran on this thread: its step and prefill against the tokens it attended to
            self.draft_steps.append((tokens, step))
        if prefill:
            self.draft_prefills.append((tokens, prefill))

    def _batch_gamma(self) -> AutoGamma:
        """The batches' γ chooser, kept across batches (its t_verify(B, k) per batch size B): the
        fixed costs where given, else one row's measured curve, which a batch replaces by its own."""
        if self._batches is None:
            costs = self.config.costs or {"verify": self.costs.verify}
            self._batches = AutoGamma(parallel=False, gamma_max=self.config.gamma_max, costs=costs)
        return self._batches

    def close(self) -> None:
        for s in self._schedulers.values():
            s.close()


@hookimpl
def hippo_register_schedulers():
    return {"auto": AutoScheduler}
