"""How well does a checkpoint's vision encoder tell the needles' shapes apart? A linear probe.

    python -m hippo.benchmarks.lists_probe benchmarks/pair_lists/target /tmp/run/target

For each checkpoint: the vision encoder's output (the merger's, what the language model reads) on
`--train` training-range clips and `--test` held-out clips of the lists task (168 px, `--frames`
frames); a linear probe (multinomial logistic regression, L-BFGS) fitted on the training clips'
needle tokens (those whose `shape` label is known) and scored on the held-out ones per token, per
needle by a vote of its tokens' logits, and on each needle's mean feature (a second probe). The same
clips for every checkpoint, so the figures compare encoders, not clips. Colour and row (the token's
3 x 3 cell row) and motion as controls.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import Qwen2_5_VLForConditionalGeneration  # noqa: E402

from hippo.benchmarks.batching import make_batch  # noqa: E402
from hippo.benchmarks.evaluate import HELD_OUT  # noqa: E402
from hippo.benchmarks.tokenizer import build_tokenizer  # noqa: E402
from hippo.cli.pair.lists import lists_sample  # noqa: E402
from hippo.cli.pair.niah import NiahConfig  # noqa: E402

TRAIN_BASE = 7_777_000_000  # above the training seeds (train.TRAIN_SEED_STRIDE * 16 * seed), below HELD_OUT


def clips(first: int, n: int, frames: int, tokenizer) -> list:
    cfg = NiahConfig(size=168, frames=frames)
    return [make_batch(tokenizer, [lists_sample(first + i, cfg)]) for i in range(n)]


@torch.inference_mode()
def features(model, batches) -> list[tuple[torch.Tensor, dict]]:
    out = []
    for b in batches:
        f = model.model.visual(b.pixels, grid_thw=b.grid).pooler_output  # [N, D]
        out.append((f, {k: v[0] for k, v in b.token_labels.items()}))
    return out


def fit(x: torch.Tensor, y: torch.Tensor, classes: int, l2: float = 1e-3) -> torch.nn.Linear:
    mu, sd = x.mean(0), x.std(0) + 1e-6
    lin = torch.nn.Linear(x.shape[1], classes)
    opt = torch.optim.LBFGS(lin.parameters(), max_iter=300, line_search_fn="strong_wolfe")
    xn = (x - mu) / sd

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(lin(xn), y) + l2 * lin.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():  # fold the normalisation in
        lin.weight /= sd
        lin.bias -= lin.weight @ mu
    return lin


def tokens(feats, name: str):
    xs, ys = [], []
    for f, lab in feats:
        m = (lab[name] > 0) & (lab["shape"] > 0) if name != "shape" else lab["shape"] > 0
        xs.append(f[m])
        ys.append(lab[name][m] - 1)
    return torch.cat(xs), torch.cat(ys)


def needles(feats, name: str):
    """Per needle: its known-shape tokens' features (list), and its label."""
    out = []
    for f, lab in feats:
        for i in lab["step"][lab["step"] > 0].unique():
            m = (lab["step"] == i) & (lab["shape"] > 0)
            if m.any():
                out.append((f[m], int(lab[name][m][0]) - 1))
    return out


def probe(train, test) -> dict:
    res = {}
    for name, classes in (("shape", 3), ("colour", 4), ("motion", 4), ("row", 3)):
        if name == "row":  # the token's cell row (cell labels are 1-based row * 3 + column)
            for feats in (train, test):
                for _, lab in feats:
                    lab["row"] = torch.where(lab["step"] > 0, (lab["cell"] - 1) // 3 + 1, 0)
        x, y = tokens(train, name)
        lin = fit(x, y, classes)
        xt, yt = tokens(test, name)
        with torch.no_grad():
            res[f"{name} token"] = float((lin(xt).argmax(-1) == yt).float().mean())
            nd = needles(test, name)
            if name != "row":  # a needle's tokens span cells: its row is per token
                vote = [int(lin(f).log_softmax(-1).sum(0).argmax()) == y for f, y in nd]
                res[f"{name} needle vote"] = sum(vote) / len(vote)
        if name == "shape":
            ntr = needles(train, name)
            pooled = fit(
                torch.stack([f.mean(0) for f, _ in ntr]), torch.tensor([y for _, y in ntr]), classes, 1e-2
            )
            with torch.no_grad():
                right = [int(pooled(f.mean(0)).argmax()) == y for f, y in nd]
            res["shape needle pooled"] = sum(right) / len(right)
            res["needles"] = len(nd)
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--train", type=int, default=48, help="clips to fit the probes on")
    p.add_argument("--test", type=int, default=24, help="held-out clips to score them on")
    p.add_argument("--frames", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = build_tokenizer()
    t0 = time.perf_counter()
    tr, te = clips(TRAIN_BASE, args.train, args.frames, tok), clips(HELD_OUT, args.test, args.frames, tok)
    print(f"rendered {len(tr) + len(te)} clips in {time.perf_counter() - t0:.0f}s", flush=True)
    for path in args.checkpoints:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        t0 = time.perf_counter()
        r = probe(features(model, tr), features(model, te))
        r = {k: round(v, 3) for k, v in r.items()}
        print(
            json.dumps({"checkpoint": str(path), **r, "seconds": round(time.perf_counter() - t0)}), flush=True
        )


if __name__ == "__main__":
    main()
