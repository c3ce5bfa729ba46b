"""Held-out needle accuracy of the long-video pair against N, and how often the draft agrees with it.

    python -m hippo.benchmarks.niah_eval                      # the committed pair, N up to 16k
    python -m hippo.benchmarks.niah_eval --n 2 --tokens 1152 4096 --write   # and record measured.json

For each N (visual tokens), on held-out clips (`hippo.cli.pair.niah`, 168 px, the pair trained on
1,152-2,304): the target's and the draft's greedy answers scored clause by clause against the task's
answer (`niah.needle_scores`: count, colour, shape, cell, direction; chance for a field is 1/4,
1/3, 1/9, 1/4), and the draft's agreement with the target, teacher-forced on the target's answer (the
greedy acceptance rate of speculative decoding) with all its visual tokens, a uniform 10% of them
and the needles' tokens topped up uniformly to 10% (the oracle), and the MAT (tokens per target
verification, accepted drafts + 1) that greedy chain drafting of GAMMA tokens gets from those
matches: a round accepts the draft's run of matching tokens, which teacher forcing predicts exactly,
since every accepted token is the target's. Length generalisation is part of the result: the target
never saw more than 4,608 visual tokens.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from hippo.benchmarks.batching import lm_inputs, make_batch  # noqa: E402
from hippo.benchmarks.evaluate import HELD_OUT, greedy_ids  # noqa: E402
from hippo.cli.pair.niah import config_for, needle_rows, needle_scores, niah_sample  # noqa: E402
from hippo.registry import lookup  # noqa: E402
from hippo.types import VisualTokens  # noqa: E402

TOKENS = (1152, 2048, 4096, 8192, 16384)
MAX_ANSWER = 96  # tokens: longer than any reference answer (75)
GAMMA = 5  # drafted tokens per round (`hippo bench --long`'s default)


def matches(draft, batch, ids: list[int], keep: torch.Tensor | None) -> list[bool]:
    """Per token of the target's answer `ids`: whether the draft's argmax, teacher-forced on the
    answer's prefix and the kept visual tokens, is that token (one clip)."""
    answers = torch.tensor([ids])
    forced = type(batch)(**{**batch.__dict__, "captions": answers, "labels": answers})
    embeds, positions, _, _ = lm_inputs(draft, forced, keep)
    h = draft.model.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
    logits = draft.lm_head(h[:, -len(ids) - 1 : -1])  # the prediction of answer token i
    return (logits[0].argmax(-1) == answers[0]).tolist()


def chain_rounds(match: list[bool], gamma: int = GAMMA) -> int:
    """Target verifications that greedy chain drafting of `gamma` tokens needs for the answer."""
    i = rounds = 0
    while i < len(match):
        run = 0
        while run < gamma and i + run < len(match) and match[i + run]:
            run += 1
        i += run + 1  # the accepted drafts and the target's own next token
        rounds += 1
    return rounds


def kept(
    name: str, n: int, **options
) -> torch.Tensor:  # -> [1, K] what a registered selector keeps of n tokens
    visual = VisualTokens(torch.zeros(n, 1), torch.arange(n), ((n, 1, 1),))
    return lookup("selectors", name).from_options(keep_ratio=0.1, **options).select(visual, None, None)[None]


@torch.inference_mode()
def evaluate(target, draft, tokenizer, tokens: int, n: int, seed: int = 0) -> dict:
    fields: dict[str, dict[str, list[int]]] = {"target": {}, "draft": {}}
    agree = {"full": [0, 0], "uniform 10%": [0, 0], "needles + uniform 10%": [0, 0]}
    rounds = dict.fromkeys(agree, 0)
    for i in range(n):
        smp = niah_sample(HELD_OUT + seed + i, config_for(tokens))
        batch = make_batch(tokenizer, [smp])
        eos = tokenizer.eos_token_id
        answers = {}
        for role, model in (("target", target), ("draft", draft)):
            ids = greedy_ids(model, batch, max_new_tokens=MAX_ANSWER, eos=eos)[0]
            answers[role] = [t for t in ids if t != eos]
            text = tokenizer.decode(answers[role])
            for f, (right, total) in needle_scores(text, smp.caption).items():
                acc = fields[role].setdefault(f, [0, 0])
                acc[0], acc[1] = acc[0] + right, acc[1] + total
        N = batch.video_rows.numel()
        keeps = {
            "full": None,
            "uniform 10%": kept("uniform", N),
            "needles + uniform 10%": kept("oracle", N, keep=needle_rows(smp)),
        }
        target_ids = answers["target"] + [eos]
        for name, keep in keeps.items():
            match = matches(draft, batch, target_ids, keep)
            agree[name][0] += sum(match)
            agree[name][1] += len(match)
            rounds[name] += chain_rounds(match)
    return {
        "visual_tokens": tokens,
        "clips": n,
        **{f"{role}_{f}": r / t for role, fs in fields.items() for f, (r, t) in fs.items() if t},
        **{f"draft_agreement_{name}": r / t for name, (r, t) in agree.items() if t},
        **{f"draft_mat_{name}": t / rounds[name] for name, (r, t) in agree.items() if t},
    }


def main(argv=None) -> None:
    from hippo.cli.pair.checkpoint import MEASURED, load_pair

    from .pair import NIAH_DIR

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", default=str(NIAH_DIR))
    p.add_argument("--n", type=int, default=4, help="held-out clips per N (default: %(default)s)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write", action="store_true", help=f"record the figures in the pair's {MEASURED}")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft, tok = load_pair(wide=False, directory=args.pair)
    results = []
    for tokens in args.tokens:
        r = evaluate(target, draft, tok, tokens, args.n)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.write:
        from pathlib import Path

        (Path(args.pair) / MEASURED).write_text(json.dumps({"by_visual_tokens": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
