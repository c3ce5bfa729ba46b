"""Train the narration pair: the captioning pair (`benchmarks/pair/`) fine-tuned on dense narration.

    python -m hippo.benchmarks.narrate_train                  # both models, writes cli/pair/narrate/
    python -m hippo.benchmarks.narrate_train --serial         # the same checkpoints, one model after the other
    python -m hippo.benchmarks.narrate_train --role draft --scale 0.1 --out /tmp/try   # a quick try

Both models start from the committed captioning checkpoints, whose vision encoders already see
colour, shape and motion, and learn to narrate (`hippo.cli.pair.narration`: every step of a 16-step clip, three
kinds of question) on 4 fps clips of 112-224 px and 32 frames, with the captioning task's losses:
cross-entropy on the answer plus the auxiliary per-visual-token loss. The vision encoder learns
10x slower (its shape features are fragile). The draft sees pruned visual inputs (5-30% of the
tokens, random, uniform or salient) in half of its steps, as hippo's adapter feeds it, and then
distils from the trained target: its last phase learns the target's own greedy answers (full and
pruned video), since what speculative decoding needs from a draft is agreement with its target.
So the draft's distillation waits for the target: `--role both` (the default) trains the target and
the draft's first two phases side by side in two processes, one thread each, and then distils.
Each phase's batches (rendered clips and, in the distillation, the teacher's greedy answers) are
prepared ahead in worker processes (`train.phase_batches`, `--workers`); the checkpoints are the
same for any number. Deterministic from the seed and the committed checkpoints, with one thread per
model.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hippo.benchmarks import train
from hippo.benchmarks.pair import PAIR_DIR
from hippo.benchmarks.train import Phase, TrainConfig
from hippo.cli.pair.checkpoint import NARRATE_DIR

PAIR = PAIR_DIR
OUT = NARRATE_DIR  # the pair ships with `hippo demo`
SIZES = [(112, 32, 16), (168, 32, 8), (112, 32, 16), (224, 32, 4)]


def _config(role: str, steps: int, prune_frac: float, teacher: Path | None = None) -> TrainConfig:
    phases = [
        # the vision encoder learns the clips' cues (step, row, column patterns) beside colour/shape/motion
        Phase("cues", 300, [(112, 32, 8)], lr=2e-3, vision_only=True, task="narrate"),
        Phase("narrate", steps, SIZES, lr=1e-3, vision_lr_scale=0.1, prune_frac=prune_frac, task="narrate"),
    ]
    if teacher is None:  # the target: a second cosine cycle (at 500 steps it often named one object of two)
        phases.append(Phase("narrate2", 300, SIZES, lr=1e-3, vision_lr_scale=0.1, task="narrate"))
    else:  # the draft then learns to say what the trained target says: agreement is acceptance
        phases.append(
            Phase(
                "distil",
                300,
                SIZES,
                lr=5e-4,
                vision_lr_scale=0.1,
                prune_frac=prune_frac,
                task="narrate",
                teacher=str(teacher),
            )
        )
    return TrainConfig(role=role, phases=phases, warmup=20, init=str(PAIR / role))


def defaults(out: Path = OUT) -> dict[str, TrainConfig]:
    """The target first; the draft then distils from the target trained into `out`."""
    return {
        "target": _config("target", 500, prune_frac=0.0),
        "draft": _config("draft", 600, prune_frac=0.5, teacher=out / "target"),
    }


def _draft_before_distil(argv: list[str], cache: Path, defaults) -> None:
    """The draft's phases that do not need the trained target, into `cache` (a spawned process)."""
    cfg = defaults()["draft"]
    head = {"draft": replace(cfg, phases=[ph for ph in cfg.phases if ph.teacher is None])}
    train.main([*argv, "--role", "draft", "--cache", str(cache), "--out", str(cache / "head")], defaults=head)


def run_pair(argv, defaults, out: Path, doc: str) -> None:
    """Train a pair whose draft distils from its target: `defaults(out)` -> {"target", "draft"} configs.

    `--role both` (the default) trains the target and the draft's phases before distillation side
    by side in two processes, one thread each; the draft then reuses them from the phase cache and
    distils from the trained target. The same checkpoints as `--serial`."""
    import argparse
    import multiprocessing
    import shutil
    import sys
    import tempfile

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--role", default="both")
    p.add_argument("--cache", type=Path, default=None)
    p.add_argument("--serial", action="store_true")
    known, rest = p.parse_known_args(argv)
    configs = defaults(known.out)
    # a draft that starts with its distillation (pruned from the trained target) has nothing to
    # train beside the target: one model after the other
    head = any(ph.teacher is None for ph in configs["draft"].phases)
    if known.role != "both" or known.serial or not head or "-h" in rest or "--help" in rest:
        rest = [a for a in argv if a != "--serial"]
        train.main(rest, defaults=configs, out=out, doc=doc)
        return
    cache = known.cache or Path(tempfile.mkdtemp(prefix="pair-phases-"))
    one = [*rest, "--out", str(known.out), "--threads", "1"]
    draft = multiprocessing.get_context("spawn").Process(
        target=_draft_before_distil, args=(one, cache, defaults)
    )
    draft.start()
    try:
        train.main([*one, "--role", "target", "--cache", str(cache)], defaults=configs, out=out, doc=doc)
        draft.join()
        if draft.exitcode:
            raise SystemExit(f"training the draft's first phases failed (exit code {draft.exitcode})")
        train.main([*one, "--role", "draft", "--cache", str(cache)], defaults=configs, out=out, doc=doc)
    finally:
        if draft.is_alive():  # the target's training failed or was interrupted
            draft.terminate()
        if known.cache is None:
            shutil.rmtree(cache, ignore_errors=True)


def main(argv=None) -> None:
    run_pair(argv, defaults, OUT, __doc__)


if __name__ == "__main__":
    main()
