"""The long-video pair on needle lists (`hippo.cli.pair.lists`): does it read the video, and what does
pruning the draft's video cost in acceptance?

    python -m hippo.benchmarks.lists_eval                          # the committed pair, 4k and 8k
    python -m hippo.benchmarks.lists_eval --n 4 --tokens 4096 8192 --write   # and record measured.json

For each N (visual tokens), on held-out clips (168 px; the pair trained on 1,152-4,608):

- **reading**: per question, the target's and the draft's greedy answers scored word by word
  against the task's (`lists.field_scores`: word i against word i; chance is 1/4 for colours and
  directions, 1/3 for shapes and rows);
- **how much of the answer depends on the video**: the target's per-token accuracy teacher-forced on
  the task's answer (its words and full stop, not the end of turn) with the video and *blind* (a
  blank grey video of the same size): a token the blind target predicts is one the question alone
  gives away, so `1 - blind accuracy` is the share of the answer's tokens that depend on the video;
- **acceptance**: the draft teacher-forced on the target's greedy answer to `what happens ?` with all
  its visual tokens, a uniform 10%, a holistic 10% (HIPPO's score, from the target's prefill, as
  `hippo` selects it) and the oracle 10% (the needles' tokens, topped up uniformly), and the MAT
  (tokens per target verification, γ = 5) that greedy chain drafting gets from those matches
  (`niah_eval.chain_rounds`: every accepted token is the target's, so teacher forcing predicts the
  rounds exactly). Deterministic: no timing.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from dataclasses import replace  # noqa: E402

import torch  # noqa: E402

from hippo.benchmarks.batching import make_batch  # noqa: E402
from hippo.benchmarks.evaluate import HELD_OUT, greedy_ids  # noqa: E402
from hippo.benchmarks.niah_eval import chain_rounds, kept, matches  # noqa: E402
from hippo.cli.pair.lists import MAIN, QUESTIONS, field_scores, lists_sample  # noqa: E402
from hippo.cli.pair.niah import config_for, needle_rows  # noqa: E402

TOKENS = (4096, 8192)
MAX_ANSWER = 16  # tokens: longer than any reference answer (9)
SELECTIONS = ("full", "uniform 10%", "holistic 10%", "oracle 10%")


def teacher_forced_accuracy(model, batch, ids: list[int]) -> list[bool]:
    """Per token of `ids` (the reference answer): whether the model's argmax on its prefix is it."""
    return matches(model, batch, ids, None)


def holistic_keep(target, tokenizer, smp, ratio: float = 0.1) -> torch.Tensor:  # -> [1, K]
    """The visual tokens HIPPO's holistic top-k keeps of this clip (from the target's own prefill)."""
    import hippo
    from hippo.benchmarks.tokenizer import processor_inputs

    inputs = processor_inputs(tokenizer, smp.video, smp.question, fps=smp.fps)
    pipe = (
        hippo.PipelineBuilder()
        .target(target)
        .draft(target)
        .scorer("holistic")
        .selector("topk", keep_ratio=ratio)
        .scheduler("serial", gamma=1)
        .build()
    )
    try:
        out = pipe.generate(inputs, max_new_tokens=3, do_sample=False)  # the draft runs from token 2
    finally:
        pipe.close()
    return out.kept_visual_index.cpu().sort().values[None]


def selection_run(target, tokenizer, smp, scorer: str, ratio: float = 0.1) -> tuple[torch.Tensor, list[int]]:
    """What `scorer`'s top-k keeps of this clip (from the target's own prefill) and the target's greedy
    answer (the pipeline is lossless: its tokens are the target's), from one prefill: ([1, K], ids)."""
    import hippo
    from hippo.benchmarks.tokenizer import processor_inputs

    inputs = processor_inputs(tokenizer, smp.video, smp.question, fps=smp.fps)
    pipe = (
        hippo.PipelineBuilder()
        .target(target)
        .draft(target)
        .scorer(scorer)
        .selector("topk", keep_ratio=ratio)
        .scheduler("serial", gamma=1)
        .build()
    )
    try:
        out = pipe.generate(inputs, max_new_tokens=MAX_ANSWER, do_sample=False)
    finally:
        pipe.close()
    ids = [
        t for t in out.sequences[0, inputs["input_ids"].shape[1] :].tolist() if t != tokenizer.eos_token_id
    ]
    return out.kept_visual_index.cpu().sort().values[None], ids


def ratio_ci(tokens: list[int], rounds: list[int]) -> tuple[float, float, float]:
    """MAT = sum(tokens) / sum(rounds) over answers, with a 95% interval that treats each answer as
    one draw (the ratio estimator's variance over answers: rounds of one answer are not independent)."""
    n, t, r = len(tokens), sum(tokens), sum(rounds)
    mat = t / r
    if n < 2:
        return mat, mat, mat
    mean_r = r / n
    var = sum((a - mat * b) ** 2 for a, b in zip(tokens, rounds)) / (n * (n - 1) * mean_r**2)
    half = 1.96 * math.sqrt(var)
    return mat, mat - half, mat + half


MAT_SELECTIONS = ("holistic", "attention", "uniform", "full", "oracle")


@torch.inference_mode()
def mat_by_selection(
    target, draft, tokenizer, tokens: int, n: int, seed: int = 0, ratio: float = 0.1
) -> dict:
    """The draft's MAT (greedy chain drafting, γ = 5, exact from teacher forcing) on `n` held-out clips
    of `tokens` visual tokens, each asked the four questions, per selection of its visual tokens at
    `ratio`: holistic and attention-only top-k (from the target's prefill of that question), uniform,
    full, oracle (the needles' tokens, topped up uniformly). Per selection: MAT with a 95% interval over
    the 4n answers (`ratio_ci`), and the share of needle tokens kept."""
    per = {s: {"tokens": [], "rounds": [], "needles": [0, 0]} for s in MAT_SELECTIONS}
    eos = tokenizer.eos_token_id
    for i in range(n):
        for q in QUESTIONS:
            smp = lists_sample(HELD_OUT + seed + i, config_for(tokens), q)
            batch = make_batch(tokenizer, [smp])
            N = batch.video_rows.numel()
            needles = needle_rows(smp)
            holistic, answer = selection_run(target, tokenizer, smp, "holistic", ratio)
            attention, _ = selection_run(target, tokenizer, smp, "attention", ratio)
            keeps = {
                "holistic": holistic,
                "attention": attention,
                "uniform": kept("uniform", N),
                "full": None,
                "oracle": kept("oracle", N, keep=needles),
            }
            ids = answer + [eos]
            for name, keep in keeps.items():
                match = matches(draft, batch, ids, keep)
                per[name]["tokens"].append(len(match))
                per[name]["rounds"].append(chain_rounds(match))
                if keep is not None:
                    per[name]["needles"][0] += int(torch.isin(needles, keep[0]).sum())
                    per[name]["needles"][1] += needles.numel()
    out: dict = {"visual_tokens": tokens, "clips": n, "answers": n * len(QUESTIONS), "keep_ratio": ratio}
    for name, d in per.items():
        mat, lo, hi = ratio_ci(d["tokens"], d["rounds"])
        k, total = d["needles"]
        out[name] = {"mat": mat, "ci95": [lo, hi], "needle_recall": k / total if total else 1.0}
    return out


@torch.inference_mode()
def evaluate(target, draft, tokenizer, tokens: int, n: int, seed: int = 0) -> dict:
    eos = tokenizer.eos_token_id
    words = {role: {q: [0, 0] for q in QUESTIONS} for role in ("target", "draft")}
    seen, blind = [0, 0], [0, 0]
    agree = {s: [0, 0] for s in SELECTIONS}
    rounds = dict.fromkeys(SELECTIONS, 0)
    recall = {s: [0, 0] for s in SELECTIONS[1:]}
    for i in range(n):
        for q in QUESTIONS:
            smp = lists_sample(HELD_OUT + seed + i, config_for(tokens), q)
            batch = make_batch(tokenizer, [smp])
            answers = {}
            for role, model in (("target", target), ("draft", draft)):
                ids = greedy_ids(model, batch, max_new_tokens=MAX_ANSWER, eos=eos)[0]
                answers[role] = [t for t in ids if t != eos]
                right, total = field_scores(tokenizer.decode(answers[role]), smp.caption)
                words[role][q][0] += right
                words[role][q][1] += total
            ref = tokenizer(smp.caption, add_special_tokens=False)["input_ids"]
            grey = replace(smp, video=torch.full_like(smp.video, 0.5))
            for acc, b in ((seen, batch), (blind, make_batch(tokenizer, [grey]))):
                m = teacher_forced_accuracy(target, b, ref)
                acc[0] += sum(m)
                acc[1] += len(m)
            if q != MAIN:
                continue
            N = batch.video_rows.numel()
            needles = needle_rows(smp)
            keeps = {
                "full": None,
                "uniform 10%": kept("uniform", N),
                "holistic 10%": holistic_keep(target, tokenizer, smp),
                "oracle 10%": kept("oracle", N, keep=needles),
            }
            target_ids = answers["target"] + [eos]
            for name, keep in keeps.items():
                match = matches(draft, batch, target_ids, keep)
                agree[name][0] += sum(match)
                agree[name][1] += len(match)
                rounds[name] += chain_rounds(match)
                if keep is not None:
                    recall[name][0] += int(torch.isin(needles, keep[0]).sum())
                    recall[name][1] += needles.numel()
    out = {"visual_tokens": tokens, "clips": n}
    for role, qs in words.items():
        out.update({f"{role}_words {q}": r / t for q, (r, t) in qs.items() if t})
    out["target_token_accuracy_teacher_forced"] = seen[0] / seen[1]
    out["blind_target_token_accuracy"] = blind[0] / blind[1]
    out["video_dependent_share"] = 1 - blind[0] / blind[1]
    out.update({f"draft_agreement {s}": r / t for s, (r, t) in agree.items() if t})
    out.update({f"draft_mat {s}": t / rounds[s] for s, (r, t) in agree.items() if t})
    out.update({f"needle_recall {s}": r / t for s, (r, t) in recall.items() if t})
    return out


def main(argv=None) -> None:
    from pathlib import Path

    from hippo.cli.pair.checkpoint import MEASURED, load_pair

    from .pair import LISTS_DIR

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", default=str(LISTS_DIR))
    p.add_argument("--n", type=int, default=3, help="held-out clips per N (default: %(default)s)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-verify", action="store_true", help="a pair without checksums (a training run's)")
    p.add_argument("--write", action="store_true", help=f"record the figures in the pair's {MEASURED}")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft, tok = load_pair(wide=False, directory=args.pair, verify=not args.no_verify)
    results = []
    for tokens in args.tokens:
        r = evaluate(target, draft, tok, tokens, args.n)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.write:
        (Path(args.pair) / MEASURED).write_text(json.dumps({"by_visual_tokens": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
