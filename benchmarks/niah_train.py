"""Train the long-video pair: needles in a video haystack (`hippo.cli.pair.niah`).

    python -m hippo.benchmarks.niah_train                  # both models, writes benchmarks/pair_niah/
    python -m hippo.benchmarks.niah_train --role target --scale 0.05 --out /tmp/try   # a quick try

Both models start from the committed captioning pair (`benchmarks/pair/`), whose vision encoders
already see colour, shape and motion, and learn to list a clip's needles in temporal order on
168 px clips of 64-128 frames (1,152-2,304 visual tokens); the benchmark evaluates them up to 16k
visual tokens (length generalisation is part of the result). Losses: cross-entropy on the answer,
the auxiliary per-visual-token labels (colour, shape, direction, the token's cell, and, read from
the language model's states only, the needle's order among the needles), and a guided-attention
loss: one head of one layer puts its mass, from each clause's words, on that needle's tokens, and,
from the prompt's last position, on every needle's. The draft sees pruned visual inputs (5-30%
of the tokens: random, uniform or salient) in half of its steps, and then distils from the trained
target (its greedy answers on full and pruned video), since agreement is acceptance. As with the
narration pair, the target and the draft's first phase train side by side, one thread each.
"""

from __future__ import annotations

from pathlib import Path

from hippo.benchmarks import narrate_train
from hippo.benchmarks.pair import NIAH_DIR, PAIR_DIR
from hippo.benchmarks.train import Phase, TrainConfig

OUT = NIAH_DIR
SIZES = [(168, 64, 4), (168, 96, 3), (168, 64, 4), (168, 128, 2)]
#: the target's second cycle: clips of up to 4,608 visual tokens, with temporal positions stretched
#: up to 4x (a 128-patch clip then spans the positions of a 16k-token one at the task's frame rate)
LONGER = [(168, 128, 2), (168, 192, 1), (168, 96, 3), (168, 256, 1)]


def _config(role: str, steps: int, prune_frac: float, teacher: Path | None = None) -> TrainConfig:
    attend = (2, 0) if role == "target" else (1, 0)
    phases = [
        Phase(
            "niah",
            steps,
            SIZES,
            lr=1e-3,
            vision_lr_scale=0.3,
            prune_frac=prune_frac,
            task="niah",
            attend_weight=0.5,
        )
    ]
    if teacher is None:  # the target: a second cosine cycle (after one its answers were barely above chance)
        phases.append(
            Phase(
                "niah2",
                240,
                LONGER,
                lr=1e-3,
                vision_lr_scale=0.3,
                task="niah",
                attend_weight=0.5,
                time_stretch=(1, 2, 4),
            )
        )
    else:  # the draft then learns to say what the trained target says (agreement is acceptance), on
        # the target's second cycle's clips
        phases.append(
            Phase(
                "distil",
                150,
                LONGER,
                lr=5e-4,
                vision_lr_scale=0.3,
                prune_frac=prune_frac,
                task="niah",
                teacher=str(teacher),
                attend_weight=0.5,
                time_stretch=(1, 2, 4),
            )
        )
    return TrainConfig(role=role, phases=phases, warmup=20, init=str(PAIR_DIR / role), attend_at=attend)


def defaults(out: Path = OUT) -> dict[str, TrainConfig]:
    """The target first; the draft then distils from the target trained into `out`."""
    return {
        "target": _config("target", 360, prune_frac=0.0),
        "draft": _config("draft", 360, prune_frac=0.5, teacher=out / "target"),
    }


def main(argv=None) -> None:
    narrate_train.run_pair(argv, defaults, OUT, __doc__)


if __name__ == "__main__":
    main()
