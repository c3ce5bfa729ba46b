"""A trained tiny LLaVA-OneVision pair, and the measurement that picks the adapter's default positions.

    python -m hippo.benchmarks.llava_pair --train      # target and draft from scratch into benchmarks/pair_llava/
    python -m hippo.benchmarks.llava_pair --write      # record the SHA-256 checksums (checksums.json)
    python -m hippo.benchmarks.llava_pair --measure --out benchmarks/pair_llava/measured.json
                                                 # accuracies, and serial-SD MAT for positions original/compact

Both models are the stock `LlavaOnevisionForConditionalGeneration` (SigLIP vision tower, 2-layer
projector, Qwen2 language model, 1-D positions), trained on the benchmark's captioning task
(`hippo.cli.pair.task`) at 112 px x 8 frames: each frame goes through the vision tower and projector and is
pooled 2x2 to 4x4 tokens, plus one newline token per video, so a video is 8 x 16 + 1 = 129 tokens.
A frame token sees one frame only: motion (and appearing/disappearing) can only be read by the
language model comparing frames.

Training (`train`, deterministic from the seed; about 13 min for the target and 5 min for the draft
on one thread), a small version of `train.py`'s recipe: AdamW (0.9, 0.98), warm-up then cosine
decay, clip 1.0; a short vision-only phase, then everything with a one-object curriculum at the
start (`PHASES`); cross-entropy on the caption plus an auxiliary per-frame-token loss (colour/shape at the
projector's pooled output, colour/shape/motion at the middle and last decoder layers) through
training-only linear heads that are discarded. The draft is trained on FULL inputs only, never on
pruned ones: a stock draft is not trained for pruning, and training it on one position scheme
would bias the comparison of `positions="original"` and `"compact"`.

Measurement (`measure`): hippo's serial scheduler (gamma 5) with the draft's adapter given each
`positions` option, for the `full`, `uniform` and holistic-`topk` selections; every output is
checked against `target.generate(...)`.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    PreTrainedTokenizerFast,
)

from hippo.adapters.llava_onevision import LlavaOnevisionAdapter  # noqa: E402
from hippo.adapters.llava_onevision_tiny import tiny_config  # noqa: E402
from hippo.benchmarks.tokenizer import SPECIALS, VOCAB_SIZE, messages, vocabulary  # noqa: E402
from hippo.cli.pair import task  # noqa: E402
from hippo.cli.pair.checkpoint import CHECKSUMS, ChecksumError, file_sha256  # noqa: E402
from hippo.cli.pair.task import COLOURS, MOTIONS, QUESTION, SHAPES, TaskConfig, content_score, sample  # noqa: E402

PAIR_DIR = Path(__file__).parent / "pair_llava"
HELD_OUT = 10**9  # held-out seeds; training seeds stay far below
TASK = TaskConfig(size=112, frames=8)
MAX_NEW = 24  # captions are at most 21 tokens with the end token
RENAMED = {"<|video_pad|>": "<video>", "<|image_pad|>": "<image>"}  # LLaVA-OneVision's placeholders
IDS = {RENAMED.get(k, k): v for k, v in vocabulary().items()}
BOS, EOS, PAD = IDS["<|endoftext|>"], IDS["<|im_end|>"], IDS["<|endoftext|>"]
CHAT_TEMPLATE = (  # LLaVA-OneVision's (Qwen's turns, the video placeholder first, no vision start/end)
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'video' %}<video>\n"
    "{% elif item['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SIZES = {  # language model; SigLIP vision tower (patch 14 at 112 px: 8x8 patches, pooled to 4x4)
    "target": dict(hidden=128, layers=4, heads=4, kv_heads=2, ffn=384, vit_hidden=64, vit_depth=2),
    "draft": dict(hidden=64, layers=2, heads=2, kv_heads=1, ffn=256, vit_hidden=32, vit_depth=1),
}
AUX = {"colour": len(COLOURS) + 1, "shape": len(SHAPES) + 1, "motion": len(MOTIONS) + 1}


@dataclass(frozen=True)
class Phase:
    steps: int
    lr: float
    vision_only: bool = False
    one_object_frac: float = 0.0  # the first steps show one object


#: per role: (vision-only phase, full phase); batch size BATCH
PHASES = {
    "target": (Phase(600, 3e-3, vision_only=True), Phase(1800, 3e-3, one_object_frac=0.1)),
    "draft": (Phase(600, 3e-3, vision_only=True), Phase(2000, 3e-3, one_object_frac=0.1)),
}
BATCH = 16
WARMUP, MIN_LR = 40, 1e-4


# ---- tokenizer, models, inputs ----------------------------------------------------------------


def build_tokenizer() -> PreTrainedTokenizerFast:
    """`tokenizer.py`'s vocabulary (same ids) with LLaVA-OneVision's `<video>`/`<image>` placeholders."""
    core = Tokenizer(models.WordLevel(vocab=IDS, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=[RENAMED.get(s, s) for s in SPECIALS[1:7]],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )


def pair_config(role: str) -> LlavaOnevisionConfig:
    cfg = tiny_config(
        sizes=SIZES[role],
        vocab=VOCAB_SIZE,
        ids=(BOS, EOS, PAD),
        media=(IDS["<image>"], IDS["<video>"]),
        image_size=TASK.size,
    )
    cfg.text_config.rms_norm_eps = 1e-6
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = BOS, EOS, PAD
    return cfg


def _generation_defaults(model):
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = BOS, EOS, PAD
    return model


def new_model(role: str, seed: int = 0) -> LlavaOnevisionForConditionalGeneration:
    torch.manual_seed(seed)
    return _generation_defaults(LlavaOnevisionForConditionalGeneration(pair_config(role)))


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def frame_pixels(video: torch.Tensor) -> torch.Tensor:  # [T, S, S, 3] in [0, 1] -> [T, 3, S, S]
    """Normalised as the adapter's `build_inputs` does without a processor config (OpenAI CLIP)."""
    d = LlavaOnevisionAdapter.video_defaults
    x = (video - torch.tensor(d["image_mean"])) / torch.tensor(d["image_std"])
    return x.permute(0, 3, 1, 2).contiguous()


def video_tokens(cfg: TaskConfig = TASK) -> int:  # frame tokens + the newline
    side = math.ceil(cfg.size // 14 / 2)
    return cfg.frames * side * side + 1


def prompt_ids(tokenizer, n_video_tokens: int) -> list[int]:
    text = tokenizer.apply_chat_template(messages(QUESTION), tokenize=False, add_generation_prompt=True)
    assert text.count("<video>") == 1
    return tokenizer(text.replace("<video>", "<video>" * n_video_tokens), add_special_tokens=False)[
        "input_ids"
    ]


def processor_inputs(tokenizer, video: torch.Tensor, dtype: torch.dtype = torch.float32) -> dict:
    """What the LLaVA-OneVision processor returns for one video and the task's question."""
    assert video.shape[1] == TASK.size, "frames must be the vision tower's size"
    ids = torch.tensor([prompt_ids(tokenizer, video_tokens(replace(TASK, frames=video.shape[0])))])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values_videos": frame_pixels(video)[None].to(dtype),
    }


def frame_labels(smp: task.Sample, cfg: TaskConfig = TASK) -> dict[str, torch.Tensor]:
    """Per frame token (frame-major, row-major 28 px cells): colour/shape/motion + 1 of the object
    covering it in that frame, 0 background, -1 unknown (slivers' shape; motion on frame 0)."""
    T = cfg.frames
    masks = [
        task._mask(o.shape, o.centres[:, 0], o.centres[:, 1], o.radius, cfg.size) & o.visible.view(T, 1, 1)
        for o in smp.objects
    ]
    # task's labeller reads temporal pairs of frames: give it every frame twice
    doubled = replace(cfg, frames=2 * T)
    labels = task._token_labels(doubled, smp.objects, [m.repeat_interleave(2, 0) for m in masks])
    labels["motion"].view(T, -1)[0] = -1  # one frame shows no motion
    return labels


# ---- training -----------------------------------------------------------------------------------


@dataclass
class Batch:
    pixels: torch.Tensor  # [B, T, 3, S, S]
    prompt: torch.Tensor  # [Lp]
    video_rows: torch.Tensor  # [N + 1] rows of <video> (the last holds the newline)
    captions: torch.Tensor  # [B, Lc] caption + end token, padded
    labels: torch.Tensor  # [B, Lc], -100 on padding
    token_labels: dict[str, torch.Tensor]  # name -> [B, N]


def make_batch(tokenizer, samples: list[task.Sample], cfg: TaskConfig = TASK) -> Batch:
    prompt = torch.tensor(prompt_ids(tokenizer, video_tokens(cfg)))
    caps = [tokenizer(s.caption, add_special_tokens=False)["input_ids"] + [EOS] for s in samples]
    Lc = max(map(len, caps))
    captions = torch.full((len(caps), Lc), PAD)
    labels = torch.full((len(caps), Lc), -100)
    for i, c in enumerate(caps):
        captions[i, : len(c)] = labels[i, : len(c)] = torch.tensor(c)
    per = [frame_labels(s, cfg) for s in samples]
    return Batch(
        pixels=torch.stack([frame_pixels(s.video) for s in samples]),
        prompt=prompt,
        video_rows=(prompt == IDS["<video>"]).nonzero().flatten(),
        captions=captions,
        labels=labels,
        token_labels={k: torch.stack([p[k] for p in per]) for k in AUX},
    )


class AuxHeads(torch.nn.Module):
    """Training-only linear read-outs of the per-frame-token labels (discarded after training)."""

    def __init__(self, dim: int):
        super().__init__()
        self.heads = torch.nn.ModuleDict(
            {
                f"{tap}_{k}": torch.nn.Linear(dim, n)
                for tap in ("vision", "middle", "last")
                for k, n in AUX.items()
            }
        )

    def loss(self, tap: str, h: torch.Tensor, labels: dict, names=tuple(AUX)) -> torch.Tensor:
        total = h.new_zeros(())
        for k in names:
            y = labels[k]  # [B, N]
            w = (1.0 + 3.0 * (y > 0).float()) * (y >= 0).float()  # object tokens weigh 4x
            ce = F.cross_entropy(
                self.heads[f"{tap}_{k}"](h).flatten(0, 1), y.clamp(min=0).flatten(), reduction="none"
            )
            total = total + (ce * w.flatten()).sum() / w.sum().clamp(min=1)
        return total / len(names)


def step_loss(model, aux: AuxHeads, batch: Batch, vision_only: bool):
    """-> (caption cross-entropy, auxiliary loss, caption token accuracy)."""
    core = model.model
    cfg = model.config
    feats = core.get_video_features(
        batch.pixels,
        vision_feature_layer=cfg.vision_feature_layer,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
    ).pooler_output  # [B, N + 1, D]
    a_vision = aux.loss(
        "vision", feats[:, :-1], batch.token_labels, ("colour", "shape")
    )  # no motion in a frame
    if vision_only:
        return feats.new_zeros(()), a_vision, 0.0
    B = feats.shape[0]
    embed = core.get_input_embeddings()
    x = embed(batch.prompt).expand(B, -1, -1).clone()
    x[:, batch.video_rows] = feats
    x = torch.cat([x, embed(batch.captions)], 1)
    layers = core.language_model.layers
    captured = {}
    hook = layers[len(layers) // 2 - 1].register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("middle", out[0] if isinstance(out, tuple) else out)
    )
    try:
        h = core.language_model(inputs_embeds=x, use_cache=False).last_hidden_state  # positions 0..L-1
    finally:
        hook.remove()
    Lp, Lc = batch.prompt.numel(), batch.captions.shape[1]
    logits = model.lm_head(h[:, Lp - 1 : Lp - 1 + Lc])
    ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100)
    rows = batch.video_rows[:-1]
    a = (
        a_vision
        + aux.loss("middle", captured["middle"][:, rows], batch.token_labels)
        + aux.loss("last", h[:, rows], batch.token_labels)
    ) / 3
    mask = batch.labels != -100
    acc = float(((logits.argmax(-1) == batch.labels) & mask).sum() / mask.sum())
    return ce, a, acc


def lr_at(step: int, phase: Phase) -> float:
    if step < WARMUP:
        return phase.lr * (step + 1) / WARMUP
    t = (step - WARMUP) / max(1, phase.steps - WARMUP)
    return MIN_LR + 0.5 * (phase.lr - MIN_LR) * (1 + math.cos(math.pi * t))


def train(role: str, seed: int = 0, scale: float = 1.0, log=print):
    """-> (model, seconds). Deterministic: sample seeds derive from (seed, role, phase, step)."""
    tokenizer = build_tokenizer()
    model = new_model(role, seed).train()
    aux = AuxHeads(model.config.text_config.hidden_size)
    log(f"[{role}] {n_params(model):,} params")
    t0 = time.perf_counter()
    for index, phase in enumerate(PHASES[role]):
        phase = replace(phase, steps=max(1, round(phase.steps * scale)))
        params = list((model.model.vision_tower if phase.vision_only else model).parameters())
        if phase.vision_only:
            params += list(model.model.multi_modal_projector.parameters())
        params += list(aux.parameters())
        decay = [p for p in params if p.dim() >= 2]
        other = [p for p in params if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
            lr=phase.lr,
            betas=(0.9, 0.98),
        )
        base = ((seed * 2 + (role == "draft")) * 4 + index) * 10_000_019
        hist = []
        for step in range(phase.steps):
            one = step < phase.one_object_frac * phase.steps
            cfg = replace(TASK, max_objects=1 if one else 3)
            batch = make_batch(tokenizer, [sample(base + step * BATCH + i, cfg) for i in range(BATCH)])
            for g in opt.param_groups:
                g["lr"] = lr_at(step, phase)
            ce, a, acc = step_loss(model, aux, batch, phase.vision_only)
            loss = ce + a
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            hist.append((ce.item(), a.item(), acc))
            if (step + 1) % 50 == 0 or step == phase.steps - 1:
                m = [sum(x) / len(x) for x in zip(*hist[-50:])]
                log(
                    f"[{role} {'vision' if phase.vision_only else 'all'}] step {step + 1}/{phase.steps} "
                    f"ce {m[0]:.3f} aux {m[1]:.3f} tok-acc {m[2]:.3f} {time.perf_counter() - t0:.0f}s"
                )
    return model.eval(), time.perf_counter() - t0


# ---- loading, checksums -----------------------------------------------------------------------

ROLES = ("target", "draft")


def _files(directory: Path) -> list[Path]:
    """The checkpoints' files (target/, draft/); other files there (measured.json) are not checked."""
    return sorted(p for role in ROLES for p in (directory / role).rglob("*") if p.is_file())


def load_pair(
    directory: str | Path | None = None, *, verify: bool = True, dtype: torch.dtype = torch.float32
):
    """(target, draft, tokenizer), with every file checked against checksums.json when `verify`."""
    directory = Path(directory) if directory is not None else PAIR_DIR
    if verify:
        sums = json.loads((directory / CHECKSUMS).read_text())["files"]
        present = {p.relative_to(directory).as_posix(): p for p in _files(directory)}
        for rel, path in present.items():
            if sums.get(rel) != file_sha256(path):
                raise ChecksumError(
                    f"{rel} does not match {CHECKSUMS}; re-train or restore the committed file"
                )
        if set(sums) - set(present):
            raise ChecksumError(f"missing files of the pair: {sorted(set(sums) - set(present))}")
    target, draft = (
        _generation_defaults(
            LlavaOnevisionForConditionalGeneration.from_pretrained(directory / role, dtype=dtype).eval()
        )
        for role in ("target", "draft")
    )
    return target, draft, PreTrainedTokenizerFast.from_pretrained(directory / "target")


def write_checksums(directory: Path = PAIR_DIR) -> dict:
    sums = {"files": {p.relative_to(directory).as_posix(): file_sha256(p) for p in _files(directory)}}
    (directory / CHECKSUMS).write_text(json.dumps(sums, indent=1) + "\n")
    return sums


# ---- evaluation and measurement ---------------------------------------------------------------


@torch.inference_mode()
def content_accuracy(model, tokenizer, seeds, *, blank: bool = False, batch: int = 8) -> dict:
    """Greedy captions (`model.generate`, batched: every prompt has the same length) scored with
    `task.content_score` against the true captions; `blank` shows grey frames instead."""
    right = total = exact = 0
    fields: dict[str, list[int]] = {}
    seeds = list(seeds)
    for start in range(0, len(seeds), batch):
        chunk = seeds[start : start + batch]
        truth = [sample(s, TASK).caption for s in chunk]
        shown = [sample(s, TASK, blank=blank).video for s in chunk]
        ins = [processor_inputs(tokenizer, v, model.dtype) for v in shown]
        ids = torch.cat([i["input_ids"] for i in ins])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values_videos=torch.cat([i["pixel_values_videos"] for i in ins]),
            do_sample=False,
            max_new_tokens=MAX_NEW,
        )[:, ids.shape[1] :]
        for row, ref in zip(out.tolist(), truth):
            text = tokenizer.decode(row[: row.index(EOS)] if EOS in row else row)
            r, t, f = content_score(text, ref)
            right, total, exact = right + r, total + t, exact + int(text == ref)
            for k, (x, y) in f.items():
                acc = fields.setdefault(k, [0, 0])
                acc[0], acc[1] = acc[0] + x, acc[1] + y
    return {
        "videos": len(seeds),
        "content_accuracy": round(right / total, 4),
        "exact_captions": round(exact / len(seeds), 4),
        **{f"{k}_accuracy": round(x / max(1, y), 4) for k, (x, y) in fields.items()},
    }


SELECTIONS = {  # name -> (scorer, selector, selector options)
    "full": (None, "full", {}),
    "uniform 0.1": (None, "uniform", {"keep_ratio": 0.1}),
    "uniform 0.25": (None, "uniform", {"keep_ratio": 0.25}),
    "holistic topk 0.1": ("holistic", "topk", {"keep_ratio": 0.1}),
    "holistic topk 0.25": ("holistic", "topk", {"keep_ratio": 0.25}),
}
SCHEMES = ("original", "compact")


def pipeline(target, draft, positions: str, selection: str, gamma: int = 5):
    import hippo

    scorer, selector, options = SELECTIONS[selection]
    return (
        hippo.PipelineBuilder()
        .target(target)
        .draft(draft, adapter_options={"positions": positions})
        .scorer(scorer)
        .selector(selector, **options)
        .scheduler("serial", gamma=gamma)
        .build()
    )


@torch.inference_mode()
def reference(target, inputs, max_new_tokens: int = MAX_NEW) -> torch.Tensor:
    return target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)


def measure_mat(
    target, draft, tokenizer, seeds, selections=tuple(SELECTIONS), schemes=SCHEMES, log=print
) -> dict:
    """-> {selection: {scheme: {mat, mat_accumulated, acceptance_rate, lossless}}}, MAT averaged per video."""
    inputs = [processor_inputs(tokenizer, sample(s, TASK).video) for s in seeds]
    refs = [reference(target, i) for i in inputs]
    table: dict = {}
    for selection in selections:
        for scheme in schemes:
            pipe = pipeline(target, draft, scheme, selection)
            mats, accs, rates, same = [], [], [], True
            for inp, ref in zip(inputs, refs):
                out = pipe.generate(inp, max_new_tokens=MAX_NEW, do_sample=False)
                same = same and torch.equal(out.sequences, ref)
                mats.append(out.stats.mat)
                accs.append(out.stats.mat_accumulated)
                rates.append(out.stats.acceptance_rate)
            row = {
                "mat": round(sum(mats) / len(mats), 4),
                "mat_accumulated": round(sum(accs) / len(accs), 4),
                "acceptance_rate": round(sum(rates) / len(rates), 4),
                "mat_per_video": [round(m, 3) for m in mats],
                "lossless": same,
            }
            table.setdefault(selection, {})[scheme] = row
            log(
                f"{selection:>20} {scheme:>8}: MAT {row['mat']:.3f} accumulated {row['mat_accumulated']:.3f} "
                f"acceptance {row['acceptance_rate']:.3f} lossless {same}"
            )
        if len(schemes) == 2 and len(seeds) > 1:  # paired over the same videos: difference, standard error
            a, b = (table[selection][s]["mat_per_video"] for s in schemes)
            d = [y - x for x, y in zip(a, b)]
            mean = sum(d) / len(d)
            se = (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
            table[selection][f"{schemes[1]}_minus_{schemes[0]}"] = {"mat": round(mean, 4), "se": round(se, 4)}
            log(f"{selection:>20} {schemes[1]} - {schemes[0]}: {mean:+.3f} +- {se:.3f} (standard error)")
    return table


def measure(directory=None, n: int = 64, n_accuracy: int = 64, log=print) -> dict:
    target, draft, tokenizer = load_pair(directory)
    seeds = range(HELD_OUT, HELD_OUT + n)
    acc_seeds = range(HELD_OUT, HELD_OUT + n_accuracy)
    report = {
        "task": f"{TASK.size} px x {TASK.frames} frames, {video_tokens() - 1} frame tokens + newline",
        "params": {"target": n_params(target), "draft": n_params(draft)},
        "chance_content_accuracy": round(task.chance_content_accuracy(acc_seeds, TASK), 4),
        "target": content_accuracy(target, tokenizer, acc_seeds),
        "target_blank": content_accuracy(target, tokenizer, acc_seeds, blank=True),
        "draft": content_accuracy(draft, tokenizer, acc_seeds),
        "draft_blank": content_accuracy(draft, tokenizer, acc_seeds, blank=True),
    }
    log(json.dumps(report, indent=1))
    report["mat"] = measure_mat(target, draft, tokenizer, seeds, log=log)
    return report


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", action="store_true", help="train target and draft into --dir")
    p.add_argument("--write", action="store_true", help="record the checksums of the files in --dir")
    p.add_argument("--measure", action="store_true", help="accuracies and MAT per positions option")
    p.add_argument("--role", choices=["target", "draft", "both"], default="both")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every phase's steps (quick tries)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=PAIR_DIR)
    p.add_argument("--n", type=int, default=64, help="held-out videos for the MAT measurement")
    p.add_argument("--n-accuracy", type=int, default=64, help="held-out videos for the accuracies")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="write the measurement as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.train:
        for role in ["target", "draft"] if args.role == "both" else [args.role]:
            model, seconds = train(role, args.seed, args.scale)
            model.save_pretrained(args.dir / role)
            build_tokenizer().save_pretrained(args.dir / role)
            print(f"[{role}] trained in {seconds:.0f}s -> {args.dir / role}")
    if args.write or args.train:
        write_checksums(args.dir)
    if args.measure:
        report = measure(args.dir, args.n, args.n_accuracy)
        print(json.dumps(report["mat"], indent=1))
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
