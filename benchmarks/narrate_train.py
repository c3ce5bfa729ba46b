"""Train the narration pair: the captioning pair (`benchmarks/pair/`) fine-tuned on dense narration.

    python -m hippo_benchmarks.narrate_train                  # both models, writes benchmarks/pair_narrate/
    python -m hippo_benchmarks.narrate_train --role draft --scale 0.1 --out /tmp/try   # a quick try

Both models start from the committed captioning checkpoints, whose vision encoders already see
colour, shape and motion, and learn to narrate (`narration.py`: every step of a 16-step clip, three
kinds of question) on 4 fps clips of 112-224 px and 32 frames, with the captioning task's losses:
cross-entropy on the answer plus the auxiliary per-visual-token loss. The vision encoder learns
10x slower (its shape features are fragile). The draft sees pruned visual inputs (5-30% of the
tokens, random, uniform or salient) in half of its steps, as hippo's adapter feeds it, and then
distils from the trained target: its last phase learns the target's own greedy answers (full and
pruned video), since what speculative decoding needs from a draft is agreement with its target.
So the target is trained first (`--role both` does that order). Deterministic from the seed and
the committed checkpoints.
"""

from __future__ import annotations

from pathlib import Path

from hippo_benchmarks import train
from hippo_benchmarks.train import Phase, TrainConfig

PAIR = Path(__file__).parent / "pair"
OUT = Path(__file__).parent / "pair_narrate"
SIZES = [(112, 32, 16), (168, 32, 8), (112, 32, 16), (224, 32, 4)]


def _config(role: str, steps: int, prune_frac: float, teacher: Path | None = None) -> TrainConfig:
    phases = [
        # the vision encoder learns the clips' cues (step hue, cell brightness) beside colour/shape/motion
        Phase("cues", 300, [(112, 32, 8)], lr=2e-3, vision_only=True, task="narrate"),
        Phase("narrate", steps, SIZES, lr=1e-3, vision_lr_scale=0.1, prune_frac=prune_frac, task="narrate"),
    ]
    if teacher is not None:  # then learn to say what the trained target says: agreement is acceptance
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


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--out", type=Path, default=OUT)
    out = p.parse_known_args(argv)[0].out
    train.main(argv, defaults=defaults(out), out=OUT, doc=__doc__)


if __name__ == "__main__":
    main()
