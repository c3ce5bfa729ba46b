"""Held-out accuracy of a trained model: greedy captions, content-word and token accuracy.

    python -m hippo.benchmarks.evaluate                       # the committed pair, 128 held-out videos
    python -m hippo.benchmarks.evaluate --size 224 --frames 64 --n 32 --keep 0.1

Greedy decoding here is batched and runs the language model on `inputs_embeds` with explicit
M-RoPE positions (as `generate()` computes them), so a pruned input (`keep`) can be evaluated the
way hippo's adapter feeds a pruned draft; `check_against_generate` confirms on full inputs that
the captions equal `model.generate()`'s.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from hippo.benchmarks.batching import lm_inputs, make_batch, prompt_positions, select_kept  # noqa: E402
from hippo.benchmarks.tokenizer import caption_ids, processor_inputs  # noqa: E402
from hippo.cli.pair.task import TaskConfig, content_score, sample, token_score  # noqa: E402
from hippo.compat import cache_arg  # noqa: E402

HELD_OUT = 10**9  # held-out seeds start here; training seeds stay far below


@dataclass
class Scores:
    videos: int = 0
    content: list[int] = field(default_factory=lambda: [0, 0])
    tokens: list[int] = field(default_factory=lambda: [0, 0])
    exact: int = 0
    fields: dict[str, list[int]] = field(default_factory=dict)

    def add(
        self, generated_text: str, generated_ids: list[int], sample_caption: str, ref_ids: list[int]
    ) -> None:
        r, t, f = content_score(generated_text, sample_caption)
        self.content[0] += r
        self.content[1] += t
        a, b = token_score(generated_ids, ref_ids)
        self.tokens[0] += a
        self.tokens[1] += b
        self.exact += int(generated_ids[: len(ref_ids)] == ref_ids)
        self.videos += 1
        for k, (x, y) in f.items():
            acc = self.fields.setdefault(k, [0, 0])
            acc[0] += x
            acc[1] += y

    @property
    def content_accuracy(self) -> float:
        return self.content[0] / max(1, self.content[1])

    @property
    def token_accuracy(self) -> float:
        return self.tokens[0] / max(1, self.tokens[1])

    def summary(self) -> dict:
        return {
            "videos": self.videos,
            "content_accuracy": round(self.content_accuracy, 4),
            "token_accuracy": round(self.token_accuracy, 4),
            "exact_captions": round(self.exact / max(1, self.videos), 4),
            **{f"{k}_accuracy": round(x / max(1, y), 4) for k, (x, y) in self.fields.items()},
        }


@torch.inference_mode()
def greedy_ids(
    model, batch, keep: torch.Tensor | None = None, max_new_tokens: int = 24, eos: int | None = None
) -> list[list[int]]:
    """Batched greedy decoding of a batch's prompts; each row stops after its first eos."""
    eos = model.generation_config.eos_token_id if eos is None else eos
    B = batch.size
    empty = batch.captions[:, :0]
    batch = type(batch)(**{**batch.__dict__, "captions": empty, "labels": empty})
    embeds, positions, _, _ = lm_inputs(model, batch, keep)
    first = prompt_positions(model, batch)[1]  # the prompt's last position + 1, as generate() continues
    cache = DynamicCache(config=model.config)
    out = model(
        inputs_embeds=embeds, position_ids=positions, **cache_arg(cache), use_cache=True, logits_to_keep=1
    )
    tokens = out.logits[:, -1].argmax(-1)  # [B]
    result = [[int(t)] for t in tokens]
    done = tokens == eos
    for i in range(1, max_new_tokens):
        if bool(done.all()):
            break
        pos = torch.full((3, B, 1), first + i - 1)
        out = model(input_ids=tokens[:, None], position_ids=pos, **cache_arg(cache), use_cache=True)
        tokens = out.logits[:, -1].argmax(-1)
        for b in range(B):
            if not done[b]:
                result[b].append(int(tokens[b]))
        done = done | (tokens == eos)
    return result


def evaluate(
    model,
    tokenizer,
    cfg: TaskConfig,
    n: int = 64,
    *,
    keep_ratio: float | None = None,
    strategy: str = "uniform",
    blank: bool = False,
    batch_size: int = 16,
    first_seed: int = HELD_OUT,
) -> Scores:
    scores = Scores()
    gen = torch.Generator().manual_seed(0)
    for start in range(0, n, batch_size):
        seeds = range(first_seed + start, first_seed + min(n, start + batch_size))
        samples = [sample(s, cfg, blank=blank) for s in seeds]
        truth = [sample(s, cfg).caption for s in seeds] if blank else [s.caption for s in samples]
        batch = make_batch(tokenizer, samples)
        keep = None
        if keep_ratio is not None:
            N = batch.video_rows.numel()
            k = max(1, round(keep_ratio * N))
            keep = torch.stack(
                [select_kept(N, k, strategy, batch.token_labels["colour"][b], gen) for b in range(batch.size)]
            )
        for ids, cap in zip(greedy_ids(model, batch, keep), truth):
            text = tokenizer.decode([i for i in ids if i != tokenizer.eos_token_id])
            scores.add(text, ids, cap, caption_ids(tokenizer, cap))
    return scores


@torch.inference_mode()
def check_against_generate(model, tokenizer, cfg: TaskConfig, seeds: range) -> bool:
    """True when the batched greedy path gives the same ids as `model.generate()` on full inputs."""
    for s in seeds:
        smp = sample(s, cfg)
        inputs = processor_inputs(tokenizer, smp.video, dtype=model.dtype)
        ref = model.generate(**inputs, max_new_tokens=24, do_sample=False)[0, inputs["input_ids"].shape[1] :]
        ours = greedy_ids(model, make_batch(tokenizer, [smp]))[0]
        if ref.tolist()[: len(ours)] != ours:
            return False
    return True


def main(argv=None) -> None:
    import json

    from hippo.benchmarks.pair import PAIR_DIR
    from hippo.cli.pair.checkpoint import load_pair

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=112)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--keep", type=float, default=None)
    p.add_argument("--strategy", default="uniform")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--pair", default=None, help="directory with target/ and draft/ (default: the committed pair)"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_pair(directory=args.pair or PAIR_DIR, verify=args.pair is None)
    cfg = TaskConfig(size=args.size, frames=args.frames)
    report = {"visual_tokens": cfg.visual_tokens}
    for name, model in (("target", target), ("draft", draft)):
        report[name] = evaluate(model, tokenizer, cfg, args.n).summary()
        report[f"{name}_blank"] = evaluate(model, tokenizer, cfg, args.n, blank=True).summary()
        if args.keep is not None:
            report[f"{name}_keep{args.keep}"] = evaluate(
                model, tokenizer, cfg, args.n, keep_ratio=args.keep, strategy=args.strategy
            ).summary()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
