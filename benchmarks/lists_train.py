"""Train the long-video pair on needle lists (`hippo.cli.pair.lists`): both models from the niah pair.

    python -m hippo.benchmarks.lists_train --role target --steps 600 --out /tmp/lists   # one model
    python -m hippo.benchmarks.lists_train --role target --resume --seed 1 --out /tmp/lists   # continue

Each model starts from the committed long-video pair's model of its role (`benchmarks/pair_niah/`),
whose language model already learned to look up the needles of a haystack clip one by one, and
learns the four questions of `hippo.cli.pair.lists` (one per batch) with the niah recipe's losses:
cross-entropy on the answer, the auxiliary per-visual-token labels, and the guided-attention loss
(from answer word i, one head of one layer puts its mass on needle i's tokens). The draft trains on
the whole video only (pruned inputs taught the niah draft to answer without the needles) and on the
references, not the target's answers, so that the two models train side by side, one thread each.
Clips of 168 px and 64-256 frames (1,152-4,608 visual tokens), temporal positions stretched up to 4x
so that they span the positions of 16k-token clips. The model and its auxiliary heads are saved to
`<out>/<role>` every `--save-every` steps, so a stopped run can `--resume` (a new cosine cycle).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import Qwen2_5_VLForConditionalGeneration  # noqa: E402

from hippo.benchmarks.pair import NIAH_DIR  # noqa: E402
from hippo.benchmarks.tokenizer import build_tokenizer  # noqa: E402
from hippo.benchmarks.train import AuxHeads, Phase, TrainConfig, deepen_vision, run_phase  # noqa: E402
from hippo.cli.pair.tokens import set_generation_defaults  # noqa: E402

SIZES = [(168, 64, 4), (168, 128, 2), (168, 96, 3), (168, 192, 1), (168, 64, 4), (168, 256, 1)]
#: `--small`: half the visual tokens per step (1,152-2,304), for more steps on a busy machine
SMALL_SIZES = [(168, 64, 2), (168, 96, 1), (168, 64, 2), (168, 128, 1)]
#: `--long`: clips up to the bench's 8k (2,304-8,064 visual tokens a step), so that the pointer from
#: answer word i to needle i holds at the lengths it is asked at
LONG_SIZES = [(168, 128, 2), (168, 448, 1), (168, 256, 1), (168, 192, 1), (168, 384, 1), (168, 320, 1)]
#: (layer, query head) whose attention the guided loss trains: the niah pair's own
ATTEND_AT = {"target": (2, 0), "draft": (1, 0)}


def config(
    role: str,
    steps: int,
    lr: float,
    seed: int = 0,
    small: bool | str = False,
    weights: tuple[float, ...] | None = None,
    aux_object_weight: float = 4.0,
    vision_lr_scale: float = 0.3,
    vision_steps: int = 0,
    vision_lr: float = 3e-3,
    aux_label_weights: dict | None = None,
    aux_needle_weight: float = 0.0,
    prune_frac: float = 0.0,
) -> TrainConfig:
    """`vision_steps` > 0: a first phase ("vision") in which the vision encoder (and its merger) alone
    learns the per-token labels at `vision_lr`, before the lists phase. `small`: `SMALL_SIZES`, or
    "long": `LONG_SIZES` (default: `SIZES`). `prune_frac`: the share of the lists phase's steps on
    pruned visual inputs that keep the needles' tokens (5-20% of the tokens kept, "salient"), for a
    draft that will see a selection of the video."""
    sizes = LONG_SIZES if small == "long" else SMALL_SIZES if small else SIZES
    phase = Phase(
        "lists",
        steps,
        sizes,
        lr=lr,
        vision_lr_scale=vision_lr_scale,
        task="lists",
        attend_weight=0.5,
        time_stretch=(1, 2, 4),
        question_weights=weights,
        prune_frac=prune_frac,
    )
    vision = Phase(
        "vision",
        vision_steps,
        sizes,
        lr=vision_lr,
        vision_only=True,
        task="lists",
        time_stretch=(1, 2, 4),
        question_weights=weights,
    )
    return TrainConfig(
        role=role,
        phases=[vision, phase] if vision_steps else [phase],
        warmup=10,
        seed=seed,
        attend_at=ATTEND_AT[role],
        aux_object_weight=aux_object_weight,
        aux_label_weights=dict(aux_label_weights or {}),
        aux_needle_weight=aux_needle_weight,
        prune_strategies=("salient",),
        keep_range=(0.05, 0.2),
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["target", "draft"], required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the clips are a function of (seed, step): a new one for each --resume",
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--init", type=Path, default=None, help="start from this checkpoint (default: the niah pair's)"
    )
    p.add_argument("--resume", action="store_true", help="start from <out>/<role> and its auxiliary heads")
    p.add_argument("--save-every", type=int, default=25)
    sizes = p.add_mutually_exclusive_group()
    sizes.add_argument("--small", action="store_true", help="`SMALL_SIZES`: shorter clips, smaller batches")
    sizes.add_argument("--long", action="store_true", help="`LONG_SIZES`: clips up to 8k visual tokens")
    p.add_argument(
        "--weights",
        type=float,
        nargs=4,
        default=None,
        metavar="W",
        help="how often a batch asks each question, in the order of hippo.cli.pair.lists.QUESTIONS "
        "(colours, shapes, rows, directions; default: its WEIGHTS, 0.55 0.15 0.15 0.15)",
    )
    p.add_argument(
        "--aux-object-weight",
        type=float,
        default=4.0,
        help="a needle's visual token counts this many times a background token in the auxiliary "
        "per-token loss (default: %(default)s)",
    )
    p.add_argument(
        "--vision-lr-scale",
        type=float,
        default=0.3,
        help="the vision encoder (not its merger) learns at this times --lr (default: %(default)s)",
    )
    p.add_argument(
        "--aux-label-weights",
        nargs="+",
        default=[],
        metavar="NAME=W",
        help="how much a label's term counts in the auxiliary loss's mean over labels (colour, shape, "
        "motion, step, cell; default 1 each), e.g. shape=8 motion=4",
    )
    p.add_argument(
        "--aux-needle-weight",
        type=float,
        default=0.0,
        help="weight of an auxiliary loss on each needle's shape read from its tokens' mean vision "
        "feature (`train.needle_loss`; default: %(default)s, off)",
    )
    p.add_argument(
        "--vision-steps",
        type=int,
        default=0,
        help="first train the vision encoder (and its merger) alone on the per-token labels for this many "
        "steps, at --vision-lr (default: %(default)s, none)",
    )
    p.add_argument("--vision-lr", type=float, default=3e-3)
    p.add_argument(
        "--vision-depth",
        type=int,
        default=None,
        help="grow the vision encoder to this many blocks, the new ones identities at the start "
        "(`train.deepen_vision`; default: as loaded)",
    )
    p.add_argument(
        "--prune-frac",
        type=float,
        default=0.0,
        help="share of the steps on pruned visual inputs that keep the needles' tokens (5-20%% of the "
        "tokens; for the draft; default: %(default)s, none)",
    )
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if not 0 <= args.prune_frac <= 1:
        p.error(f"--prune-frac must be in [0, 1], got {args.prune_frac}")
    if min(args.vision_steps, args.steps, args.aux_needle_weight) < 0:
        p.error("--vision-steps, --steps and --aux-needle-weight must be 0 or more")
    label_weights = {}
    for item in args.aux_label_weights:
        name, _, w = item.partition("=")
        try:
            label_weights[name] = float(w)
        except ValueError:
            p.error(f"--aux-label-weights takes NAME=W, got {item!r}")
        if name not in ("colour", "shape", "motion", "step", "cell") or label_weights[name] < 0:
            p.error(f"--aux-label-weights: unknown label or negative weight in {item!r}")
    if args.weights is not None and (min(args.weights) < 0 or not sum(args.weights)):
        p.error(f"--weights must be 4 non-negative numbers, not all 0, got {args.weights}")
    if args.vision_lr_scale < 0:
        p.error(f"--vision-lr-scale must be 0 or more, got {args.vision_lr_scale}")
    if args.aux_object_weight <= 0:
        p.error(f"--aux-object-weight must be positive, got {args.aux_object_weight}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = args.out / args.role
    init = out if args.resume else (args.init or NIAH_DIR / args.role)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(init, dtype=torch.float32).train()
    set_generation_defaults(model)
    if args.vision_depth is not None:
        deepen_vision(model, args.vision_depth)
    tokenizer = build_tokenizer()
    aux = AuxHeads(model.config.text_config.hidden_size, cues=True, global_labels=("step",))
    if args.resume and (out / "aux.pt").is_file():
        aux.load_state_dict(torch.load(out / "aux.pt"))
    weights = None if args.weights is None else tuple(args.weights)
    cfg = config(
        args.role,
        args.steps,
        args.lr,
        args.seed,
        "long" if args.long else args.small,
        weights,
        args.aux_object_weight,
        args.vision_lr_scale,
        args.vision_steps,
        args.vision_lr,
        label_weights,
        args.aux_needle_weight,
        args.prune_frac,
    )
    print(f"[{args.role}] from {init}; {cfg}", flush=True)

    def saver(phase):
        def save(step: int) -> None:
            if (step + 1) % args.save_every and step + 1 != phase.steps:
                return
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
            torch.save(aux.state_dict(), out / "aux.pt")
            print(f"[{args.role} {phase.name}] saved step {step + 1} -> {out}", flush=True)

        return save

    t0 = time.perf_counter()
    for index, phase in enumerate(cfg.phases):
        run_phase(model, aux, tokenizer, cfg, index, log=lambda s: print(s, flush=True), on_step=saver(phase))
    model.eval()
    steps = " + ".join(str(ph.steps) for ph in cfg.phases)
    print(f"[{args.role}] trained {steps} steps in {time.perf_counter() - t0:.0f}s -> {out}", flush=True)


if __name__ == "__main__":
    main()
