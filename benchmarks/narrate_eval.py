"""Held-out accuracy of the narration pair, and how often the draft agrees with the target.

    python -m hippo.benchmarks.narrate_eval                       # the committed narration pair
    python -m hippo.benchmarks.narrate_eval --pair /tmp/narr/pair --n 32

For each question kind (`narration.KINDS`) it reports, on held-out clips at the benchmark setting:
- the target's and the draft's step-aligned token accuracy against the reference narration
  (`narration.step_token_score`), the share of exact answers, and the accuracy per field
  (`narration.field_scores`: clauses per step, colour, shape, cell, what the object does), greedy;
- the same with the video blanked (a control: the answer must come from the video);
- the draft's agreement with the target: the share of the target's greedy answer tokens that the
  draft, teacher-forced on that answer, also puts first. This is the greedy acceptance rate of
  speculative decoding. Reported with all of the draft's visual tokens and with 10% of them
  (uniform stride, and "salient": most object tokens kept, as a good scorer does).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from hippo.benchmarks.batching import lm_inputs, make_batch, select_kept  # noqa: E402
from hippo.benchmarks.evaluate import HELD_OUT, greedy_ids  # noqa: E402
from hippo.cli.pair.narration import (  # noqa: E402
    FIELDS,
    KINDS,
    NARRATE_BENCH,
    field_scores,
    narration_sample,
    step_token_score,
)
from hippo.cli.pair.task import COLOURS, SHAPES, TaskConfig  # noqa: E402

MAX_ANSWER = 400  # tokens: longer than any reference answer (16 steps x 3 objects x 7 + 48)


def _ask(kind: str, batch_index: int) -> tuple[str, str | None]:
    arg = {"all": None, "colour": COLOURS, "shape": SHAPES}[kind]
    return kind, None if arg is None else arg[batch_index % len(arg)]


@torch.inference_mode()
def agreement(
    target, draft, batch, target_ids: list[list[int]], keep: torch.Tensor | None
) -> tuple[int, int]:
    """(tokens where the draft's argmax equals the target's greedy token, tokens), teacher-forced."""
    L = max(map(len, target_ids))
    answers = torch.zeros((batch.size, L), dtype=torch.long)  # padding after an answer is never read
    for b, ids in enumerate(target_ids):
        answers[b, : len(ids)] = torch.tensor(ids)
    forced = type(batch)(**{**batch.__dict__, "captions": answers, "labels": answers})
    embeds, positions, _, _ = lm_inputs(draft, forced, keep)
    h = draft.model.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
    logits = draft.lm_head(h[:, -L - 1 : -1])  # [B, L, V]: the prediction of answer token i
    right = total = 0
    for b, ids in enumerate(target_ids):
        n = len(ids)
        right += int((logits[b, :n].argmax(-1) == answers[b, :n]).sum())
        total += n
    return right, total


def evaluate(
    target, draft, tokenizer, cfg: TaskConfig = NARRATE_BENCH, n: int = 32, batch_size: int = 8
) -> dict:
    eos = tokenizer.eos_token_id
    report: dict[str, dict] = {}
    gen = torch.Generator().manual_seed(0)
    for kind in KINDS:
        acc = {k: [0, 0] for k in ("target", "draft", "target_blank", "draft_blank")}
        exact = {"target": 0, "draft": 0}
        fields = {m: {f: [0, 0] for f in FIELDS} for m in exact}
        agree = {k: [0, 0] for k in ("full", "uniform 10%", "salient 10%")}
        lengths = []
        for i, start in enumerate(range(0, n, batch_size)):
            seeds = range(HELD_OUT + start, HELD_OUT + min(n, start + batch_size))
            ask = _ask(kind, i)
            samples = [narration_sample(s, cfg, ask=ask) for s in seeds]
            blanks = [narration_sample(s, cfg, ask=ask, blank=True) for s in seeds]
            batch, blank = make_batch(tokenizer, samples), make_batch(tokenizer, blanks)
            refs = [s.caption for s in samples]
            lengths += [len(r.split()) + 1 for r in refs]
            outputs = {}
            for name, model in (("target", target), ("draft", draft)):
                for tag, b in ((name, batch), (f"{name}_blank", blank)):
                    ids = greedy_ids(model, b, max_new_tokens=MAX_ANSWER, eos=eos)
                    outputs[tag] = ids
                    for out, ref in zip(ids, refs):
                        text = tokenizer.decode([t for t in out if t != eos])
                        r, t = step_token_score(text, ref)
                        acc[tag][0] += r
                        acc[tag][1] += t
                        if tag in exact:
                            exact[tag] += int(text.split() == ref.split())
                            for f, (fr, ft) in field_scores(text, ref).items():
                                fields[tag][f][0] += fr
                                fields[tag][f][1] += ft
            N, k = batch.video_rows.numel(), max(1, round(0.1 * batch.video_rows.numel()))
            colour = batch.token_labels["colour"]
            keeps = {
                "full": None,
                "uniform 10%": torch.stack([select_kept(N, k, "uniform", None, gen) for _ in seeds]),
                "salient 10%": torch.stack(
                    [select_kept(N, k, "salient", colour[b], gen) for b in range(len(seeds))]
                ),
            }
            for tag, keep in keeps.items():
                r, t = agreement(target, draft, batch, outputs["target"], keep)
                agree[tag][0] += r
                agree[tag][1] += t
        report[kind] = {
            "videos": n,
            "mean_answer_tokens": round(sum(lengths) / len(lengths), 1),
            **{f"{k}_step_token_accuracy": round(a / max(1, b), 4) for k, (a, b) in acc.items()},
            **{f"{k}_exact": round(v / n, 4) for k, v in exact.items()},
            **{
                f"{m}_fields": {f: round(a / b, 4) for f, (a, b) in fs.items() if b}
                for m, fs in fields.items()
            },
            **{f"draft_agreement_{k}": round(a / max(1, b), 4) for k, (a, b) in agree.items()},
        }
    return report


def main(argv=None) -> None:
    from hippo.cli.pair.checkpoint import NARRATE_DIR, load_pair

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--pair", default=None, help="directory with target/ and draft/ (default: the committed pair)"
    )
    p.add_argument("--n", type=int, default=32, help="held-out clips per question kind")
    p.add_argument("--size", type=int, default=NARRATE_BENCH.size)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the report to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    directory = args.pair or NARRATE_DIR
    target, draft, tokenizer = load_pair(directory=directory, wide=False, verify=args.pair is None)
    cfg = TaskConfig(**{**NARRATE_BENCH.__dict__, "size": args.size})
    report = {"visual_tokens": cfg.visual_tokens, **evaluate(target, draft, tokenizer, cfg, args.n)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
