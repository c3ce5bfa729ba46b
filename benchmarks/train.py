"""Train the benchmark pair on this CPU, deterministically from a seed.

    python -m hippo.benchmarks.train                      # both models, writes benchmarks/pair/
    python -m hippo.benchmarks.train --role draft --scale 0.1 --out /tmp/pair   # one model, a quick try

Loss: cross-entropy on the caption (teacher forcing) plus an auxiliary per-visual-token loss: small
training-only linear heads read the colour, shape and motion of the object each visual token sees
(or background) from the vision encoder's output, the middle decoder layer and the last one. The
heads are dropped afterwards; the saved models are the stock class. Without such a loss a tiny
model stays at prior-level accuracy for hundreds of steps.

Training runs in phases (see DEFAULTS):
1. vision: the vision encoder alone learns the per-token labels. Cheap, and it gets through the
   long plateau (several hundred steps) before shape and motion features appear;
2. small: everything, on small videos (112 px, 8 frames, 64 visual tokens), where objects are
   dense and the language model learns to read them quickly;
3. mixed: everything, on a mix of sizes up to 448 px and 16 frames (2,048 visual tokens), with
   the vision encoder learning 10x slower (its shape features are fragile), so the model
   generalises to long visual contexts.

The draft sees pruned visual inputs (5-30% of the tokens, random, uniform-stride or salient
selections, passed as embeddings with their original positions) in half of its phase 2-3 steps.
"""

from __future__ import annotations

import os

os.environ.setdefault(
    "OMP_WAIT_POLICY", "PASSIVE"
)  # before torch loads OpenMP: spinning threads starve a shared CPU

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import Qwen2_5_VLForConditionalGeneration  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb  # noqa: E402

from hippo.benchmarks.batching import IGNORE, lm_inputs, make_batch, select_kept
from hippo.benchmarks.models import n_params, new_model
from hippo.benchmarks.tokenizer import build_tokenizer
from hippo.cli.pair.narration import draw_batch_question, narration_config, narration_sample
from hippo.cli.pair.niah import FPS as NIAH_FPS
from hippo.cli.pair.niah import NiahConfig, niah_sample
from hippo.cli.pair.task import CLOCK_STEPS, COLOURS, MOTIONS, SHAPES, TaskConfig, sample
from hippo.cli.pair.tokens import set_generation_defaults
from hippo.plugins.auto_executor import usable_cores

AUX_CLASSES = {"colour": len(COLOURS) + 1, "shape": len(SHAPES) + 1, "motion": len(MOTIONS) + 1}
#: the narration clips' visible cues (`hippo.cli.pair.task.cues`): every token's time step and 3 x 3 cell, 1-based
CUE_CLASSES = {"step": CLOCK_STEPS + 1, "cell": 10}
TAPS = ("vision", "middle", "last")
TRAIN_SEED_STRIDE = (
    10_000_019  # sample seeds: (16 seed + phase) * stride + 16 step + i, far below held-out ones
)


Size = tuple[int, int, int]  # (frame px, frames, batch size)


@dataclass
class Phase:
    name: str
    steps: int
    sizes: list[Size]  # cycled, one per step
    lr: float = 3e-3
    vision_only: bool = False  # train the vision encoder alone, on its per-token labels
    vision_lr_scale: float = 1.0  # the vision encoder (not its merger) learns this much slower
    one_object_frac: float = 0.0  # curriculum: the phase's first steps show one object only
    prune_frac: float = 0.0  # fraction of steps (after the curriculum) with pruned visual inputs
    #: "caption" (hippo.cli.pair.task), "narrate" (hippo.cli.pair.narration: one question per batch),
    #: "niah" (hippo.cli.pair.niah: needles in a long haystack) or "lists" (hippo.cli.pair.lists: one
    #: attribute of every needle, one question per batch)
    task: str = "caption"
    teacher: str | None = None  # distil: answers are this checkpoint's greedy outputs, not the references
    attend_weight: float = 0.0  # narration: weight of `attention_loss` (0: off)
    cue_design: str = "angle"  # narration: how the clips draw their cues (`task.TaskConfig.cue_design`)
    #: niah: M-RoPE temporal positions per temporal patch, one drawn per batch (the clip's frame rate is
    #: divided by it), so that short training clips span the positions of long ones; None: 1
    time_stretch: tuple[int, ...] | None = None
    #: lists: how often a batch asks each of `hippo.cli.pair.lists.QUESTIONS` (in its order); None: its WEIGHTS
    question_weights: tuple[float, ...] | None = None


@dataclass
class TrainConfig:
    role: str = "target"
    phases: list[Phase] = field(default_factory=list)
    min_lr: float = 1e-4
    warmup: int = 40
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    aux_weight: float = 1.0
    aux_object_weight: float = 4.0  # object tokens count this many times a background token
    #: label name -> how much its term counts in the auxiliary loss's mean over labels (default 1 each)
    aux_label_weights: dict = field(default_factory=dict)
    #: weight of `AuxHeads.needle_loss` (the shape read from each needle's mean vision feature); 0: off
    aux_needle_weight: float = 0.0
    keep_range: tuple[float, float] = (0.05, 0.3)  # kept share of the visual tokens when pruned
    overrides: dict = field(default_factory=dict)  # model size overrides
    init: str | None = None  # start from this checkpoint directory instead of a random model
    #: keep only these language-model layers of `init`, by index (a draft pruned from its trained
    #: target: the target's vision encoder, embeddings, those layers, final norm and lm_head); None: all
    init_layers: tuple[int, ...] | None = None
    #: how pruned steps choose the kept tokens (`batching.select_kept`), one drawn per step
    prune_strategies: tuple[str, ...] = ("random", "uniform", "salient")
    attend_at: tuple[int, int] = (2, 0)  # (layer, query head) whose attention `attention_loss` guides


class AuxHeads(torch.nn.Module):
    """Training-only linear read-outs of per-visual-token labels at several depths."""

    def __init__(self, dim: int, cues: bool = False, global_labels: tuple[str, ...] = ()):
        super().__init__()
        classes = {**AUX_CLASSES, **CUE_CLASSES} if cues else AUX_CLASSES
        # labels no single frame region shows (a needle's order among the needles) are read from the
        # language model's states only, not from the vision encoder's local features
        self.heads = torch.nn.ModuleDict(
            {
                f"{tap}_{name}": torch.nn.Linear(dim, n)
                for tap in TAPS
                for name, n in classes.items()
                if not (tap == "vision" and name in global_labels)
            }
        )

    def loss(
        self,
        tap: str,
        h: torch.Tensor,
        labels: dict[str, torch.Tensor],
        obj_weight: float,
        label_weights: dict[str, float] | None = None,
    ) -> torch.Tensor:
        # h [B, N, D]; labels name -> [B, N]; label_weights: name -> its term's weight (default 1)
        total = h.new_zeros(())
        names = [n for n in (*AUX_CLASSES, *CUE_CLASSES) if f"{tap}_{n}" in self.heads and n in labels]
        scale = {n: (label_weights or {}).get(n, 1.0) for n in names}
        for name in names:
            y = labels[name]  # -1: unknown, left out
            w = (1.0 + (obj_weight - 1.0) * (y > 0).float()) * (y >= 0).float()
            logits = self.heads[f"{tap}_{name}"](h).flatten(0, 1)
            ce = F.cross_entropy(logits, y.clamp(min=0).flatten(), reduction="none")
            total = total + scale[name] * (ce * w.flatten()).sum() / w.sum()
        return total / sum(scale.values())


def needle_loss(aux: AuxHeads, feats: torch.Tensor, labels: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the vision shape head on each needle's mean vision feature (over its tokens
    whose shape is known): what an answer word that attends to the needle's tokens reads, on
    average. `feats` [B, N, D]; labels' `step` names each token's needle (0: none)."""
    step, shape = labels["step"], labels["shape"]
    K = int(step.max())
    if K == 0:
        return feats.new_zeros(())
    known = (shape > 0) & (step > 0)
    onehot = (step[..., None] == torch.arange(1, K + 1)) & known[..., None]  # [B, N, K]
    count = onehot.sum(1)  # [B, K]
    pooled = torch.einsum("bnk,bnd->bkd", onehot.to(feats.dtype), feats) / count.clamp(min=1)[..., None]
    # each needle's shape: the (one) shape label of its known tokens
    y = (onehot * shape[..., None]).amax(1)  # [B, K]
    used = count > 0
    logits = aux.heads["vision_shape"](pooled[used])
    return F.cross_entropy(logits, y[used])


def attention_loss(
    attn,  # the decoder layer's self-attention module
    hidden: torch.Tensor,  # [B, L, D] its input
    rope: tuple[torch.Tensor, torch.Tensor],  # its position embeddings (cos, sin), [B, L, head_dim] each
    head: int,
    batch,
    vis_rows: torch.Tensor,  # [N'] rows of the (kept) visual tokens
    labels: dict[str, torch.Tensor],  # name -> [B, N'] the kept visual tokens' labels
) -> torch.Tensor:
    """Minus the log of the attention mass that `head` puts, from each answer position, on the visual
    tokens of the object and step that the predicted word describes (`narration.attention_targets`),
    those in the cell the clause names where the object has any there.

    A training-only loss, like the auxiliary heads: without it the narration target attends to the
    clause's object at the clause's step with 0.0-0.4% of its mass (uniform: 0.35%) and writes its
    clauses from a pooled summary of the clip, which keeps colours and motions but loses cells.
    """
    B, L, _ = hidden.shape
    Lc = batch.captions.shape[1]
    hd = attn.head_dim
    q = attn.q_proj(hidden).view(B, L, -1, hd).transpose(1, 2)  # [B, Hq, L, hd]
    k = attn.k_proj(hidden).view(B, L, -1, hd).transpose(1, 2)  # [B, Hkv, L, hd]
    kv = head // (q.shape[1] // k.shape[1])
    q, k = apply_rotary_pos_emb(q[:, head : head + 1], k[:, kv : kv + 1], *rope)
    rows = torch.arange(L - Lc - 1, L - 1)  # the positions predicting the answer's tokens
    scores = (q[:, 0, rows] @ k[:, 0].transpose(1, 2)) * attn.scaling  # [B, Lc, L]
    scores = scores.masked_fill(torch.arange(L)[None, None, :] > rows[None, :, None], float("-inf"))
    colour, step, cell = batch.attend.unbind(-1)  # [B, Lc] each
    on = (labels["colour"][:, None, :] == colour[..., None]) & (labels["step"][:, None, :] == step[..., None])
    on = on & (colour[..., None] > 0)  # [B, Lc, N']: the object's tokens at the step
    every = (colour[..., None] == -1) & (labels["colour"][:, None, :] > 0)  # colour -1: every object token
    on = on | every
    in_cell = on & (labels["cell"][:, None, :] == cell[..., None])
    on = torch.where(in_cell.any(-1, keepdim=True), in_cell, on)  # those in the named cell, if any
    target = torch.zeros_like(scores, dtype=torch.bool)
    target[:, :, vis_rows] = on
    used = target.any(-1)  # [B, Lc]: words with a described object on screen (and kept)
    if not used.any():
        return scores.new_zeros(())
    mass = scores.masked_fill(~target, float("-inf")).logsumexp(-1) - scores.logsumexp(-1)  # [B, Lc]
    return -mass[used].mean()


def step_loss(model, aux: AuxHeads, batch, cfg: TrainConfig, keep: torch.Tensor | None, attend: bool = False):
    """-> (cross-entropy, auxiliary loss, token accuracy, `attention_loss`: zero unless `attend`)."""
    embeds, positions, vis_rows, feats = lm_inputs(model, batch, keep)
    labels = batch.token_labels
    kept_labels = labels if keep is None else {k: v.gather(1, keep) for k, v in labels.items()}
    layers = model.model.language_model.layers
    captured = {}
    hooks = [
        layers[len(layers) // 2 - 1].register_forward_hook(
            lambda _m, _i, out: captured.__setitem__("middle", out[0] if isinstance(out, tuple) else out)
        )
    ]
    guided = attend and batch.attend is not None  # a captioning batch has no attention targets
    if guided:
        layer, head = cfg.attend_at

        def keep_inputs(_m, args, kwargs):
            captured["attn"] = (args[0] if args else kwargs["hidden_states"], kwargs["position_embeddings"])

        hooks.append(layers[layer].self_attn.register_forward_pre_hook(keep_inputs, with_kwargs=True))
    try:
        h = model.model.language_model(inputs_embeds=embeds, position_ids=positions, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    h = h.last_hidden_state  # [B, L, D]
    Lc = batch.captions.shape[1]
    start = h.shape[1] - Lc - 1
    logits = model.lm_head(h[:, start : start + Lc])  # [B, Lc, V]
    ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE)
    lw = cfg.aux_label_weights
    a = (
        aux.loss("vision", feats, labels, cfg.aux_object_weight, lw)
        + aux.loss("middle", captured["middle"][:, vis_rows], kept_labels, cfg.aux_object_weight, lw)
        + aux.loss("last", h[:, vis_rows], kept_labels, cfg.aux_object_weight, lw)
    ) / 3
    if cfg.aux_needle_weight:
        a = a + cfg.aux_needle_weight * needle_loss(aux, feats, labels)
    mask = batch.labels != IGNORE
    acc = ((logits.argmax(-1) == batch.labels) & mask).sum() / mask.sum()
    att = ce.new_zeros(())
    if guided:
        hidden, rope = captured["attn"]
        attn = layers[cfg.attend_at[0]].self_attn
        att = attention_loss(attn, hidden, rope, cfg.attend_at[1], batch, vis_rows, kept_labels)
    return ce, a, float(acc), att


def _optimizer(params, lr: float, weight_decay: float, slow: set[int] = frozenset(), slow_scale: float = 1.0):
    """AdamW; parameters whose id is in `slow` learn at `slow_scale` times the rate."""
    groups = []
    for is_slow in (False, True):
        ps = [p for p in params if (id(p) in slow) == is_slow]
        for decay in (True, False):
            sel = [p for p in ps if (p.dim() >= 2) == decay]
            if sel:
                groups.append(
                    {
                        "params": sel,
                        "weight_decay": weight_decay if decay else 0.0,
                        "scale": slow_scale if is_slow else 1.0,
                    }
                )
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))


def lr_at(step: int, phase: Phase, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return phase.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, phase.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (phase.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


def _samples(cfg: TrainConfig, index: int, phase: Phase, step: int) -> list:
    px, frames, batch = phase.sizes[step % len(phase.sizes)]
    one = step < phase.one_object_frac * phase.steps
    base = (cfg.seed * 16 + index) * TRAIN_SEED_STRIDE + step * 16
    if phase.task == "niah":
        stretch = random.Random(base).choice(phase.time_stretch or (1,))
        task = NiahConfig(size=px, frames=frames, fps=NIAH_FPS / stretch)
        return [niah_sample(base + i, task) for i in range(batch)]
    if phase.task == "lists":
        from hippo.cli.pair.lists import draw_question, lists_sample

        rng = random.Random(base)
        stretch = rng.choice(phase.time_stretch or (1,))
        question = draw_question(rng, phase.question_weights)
        task = NiahConfig(size=px, frames=frames, fps=NIAH_FPS / stretch)
        return [lists_sample(base + i, task, question) for i in range(batch)]
    if phase.task == "narrate":
        task = narration_config(px, frames, max_objects=1 if one else 3, cue_design=phase.cue_design)
        ask = draw_batch_question(random.Random(base))
        return [narration_sample(base + i, task, ask=ask) for i in range(batch)]
    task = TaskConfig(size=px, frames=frames, max_objects=1 if one else 3)
    return [sample(base + i, task) for i in range(batch)]


def distilled(teacher, tokenizer, samples: list) -> list:
    """The samples with the teacher's greedy answers in place of the references (for agreement)."""
    from hippo.benchmarks.evaluate import greedy_ids

    eos = tokenizer.eos_token_id
    with torch.inference_mode():
        answers = greedy_ids(teacher, make_batch(tokenizer, samples), max_new_tokens=400, eos=eos)
    return [
        replace(s, caption=tokenizer.decode([t for t in a if t != eos])) for s, a in zip(samples, answers)
    ]


def _load_teacher(path: str):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _batch(cfg: TrainConfig, index: int, step: int, tokenizer, teacher=None):
    """One step's batch: its clips rendered and, in a distillation, the teacher's answers."""
    samples = _samples(cfg, index, cfg.phases[index], step)
    return make_batch(tokenizer, samples if teacher is None else distilled(teacher, tokenizer, samples))


_WORKER: dict = {}  # a batch worker's tokenizer and teacher, loaded once per process


def _worker_init(teacher: str | None, threads: int) -> None:
    torch.set_num_threads(threads)
    _WORKER.update(tokenizer=build_tokenizer(), teacher=None if teacher is None else _load_teacher(teacher))


def _worker_batch(job: tuple[TrainConfig, int, int]):
    return _batch(*job, _WORKER["tokenizer"], _WORKER["teacher"])


@contextlib.contextmanager
def phase_batches(cfg: TrainConfig, index: int, workers: int, tokenizer):
    """The phase's batches, step by step, prepared in `workers` processes ahead of the training.

    Rendering the clips and tokenizing take ~14% of a target's step (35% of a vision-only one), a
    distillation teacher's greedy answers 2-3x the draft's step, and none of it depends on the model
    being trained. The workers are spawned with this process's thread count and compute exactly
    what `_batch` computes here, so the checkpoints are the same for any `workers`; 0: here, one
    step at a time. A phase without a teacher uses one worker."""
    phase = cfg.phases[index]
    if workers <= 0:
        teacher = None if phase.teacher is None else _load_teacher(phase.teacher)
        yield (_batch(cfg, index, step, tokenizer, teacher) for step in range(phase.steps))
        return
    workers = workers if phase.teacher is not None else 1
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, _worker_init, (phase.teacher, torch.get_num_threads())) as pool:
        jobs = ((cfg, index, step) for step in range(phase.steps))

        def submit(n: int) -> list:
            return [pool.apply_async(_worker_batch, (job,)) for job in itertools.islice(jobs, n)]

        def ahead():  # two batches per worker in flight at most: a batch holds up to ~80 MB of pixels
            pending = submit(2 * workers)
            while pending:
                batch = pending.pop(0).get()
                pending += submit(1)
                yield batch

        yield ahead()
        pool.close()  # every batch was taken: let the workers exit (leaving early terminates them)
        pool.join()


def _keep(cfg: TrainConfig, batch, gen: torch.Generator) -> torch.Tensor:  # -> [B, k]
    n = batch.video_rows.numel()
    ratio = float(torch.empty(1).uniform_(*cfg.keep_range, generator=gen))
    k = max(1, round(ratio * n))
    strategies = cfg.prune_strategies
    strategy = strategies[int(torch.randint(len(strategies), (1,), generator=gen))]
    return torch.stack(
        [select_kept(n, k, strategy, batch.token_labels["colour"][b], gen) for b in range(batch.size)]
    )


def run_phase(
    model,
    aux: AuxHeads,
    tokenizer,
    cfg: TrainConfig,
    index: int,
    log=print,
    workers: int = 0,
    on_step=None,
) -> None:
    """One phase of `cfg`, its batches prepared in `workers` processes (`phase_batches`; 0: here).
    `on_step(step)`: called after every optimiser step (e.g. to save a checkpoint now and then)."""
    phase = cfg.phases[index]
    tag = f"[{cfg.role} {phase.name}]"
    visual = model.model.visual
    params = list((visual if phase.vision_only else model).parameters()) + list(aux.parameters())
    slow = {id(p) for n, p in visual.named_parameters() if not n.startswith("merger.")}
    opt = _optimizer(params, phase.lr, cfg.weight_decay, slow, phase.vision_lr_scale)
    gen = torch.Generator().manual_seed(cfg.seed * 16 + index + 17)
    D = model.config.text_config.hidden_size
    with phase_batches(cfg, index, workers, tokenizer) as batches:
        t0, hist = time.perf_counter(), []
        for step, batch in enumerate(batches):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, phase, cfg) * g["scale"]
            if phase.vision_only:
                feats = visual(batch.pixels, grid_thw=batch.grid).pooler_output.view(batch.size, -1, D)
                loss = aux.loss(
                    "vision", feats, batch.token_labels, cfg.aux_object_weight, cfg.aux_label_weights
                )
                if cfg.aux_needle_weight:
                    loss = loss + cfg.aux_needle_weight * needle_loss(aux, feats, batch.token_labels)
                hist.append((0.0, loss.item(), 0.0, 0.0))
            else:
                curriculum = step < phase.one_object_frac * phase.steps
                prune = not curriculum and float(torch.rand(1, generator=gen)) < phase.prune_frac
                keep = _keep(cfg, batch, gen) if prune else None
                ce, a, acc, att = step_loss(model, aux, batch, cfg, keep, attend=phase.attend_weight > 0)
                loss = ce + cfg.aux_weight * a + phase.attend_weight * att
                hist.append((ce.item(), a.item(), acc, att.item()))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            if (step + 1) % 50 == 0 or step == phase.steps - 1:
                m = [sum(x) / len(x) for x in zip(*hist[-50:])]
                log(
                    f"{tag} step {step + 1}/{phase.steps} ce {m[0]:.3f} aux {m[1]:.3f} tok-acc {m[2]:.3f} "
                    + (f"attend {m[3]:.3f} (mass {math.exp(-m[3]):.2f}) " if phase.attend_weight else "")
                    + f"lr {lr_at(step, phase, cfg):.2e} {time.perf_counter() - t0:.0f}s"
                )
            if on_step is not None:
                on_step(step)


def keep_layers(model, layers: tuple[int, ...]) -> None:
    """Keep these decoder layers of the language model, in order (its config follows, so it saves and
    loads as the stock class)."""
    text = model.config.text_config
    if not layers or sorted(set(layers)) != list(layers) or not 0 <= layers[-1] < text.num_hidden_layers:
        raise ValueError(
            f"init_layers must be increasing indices below {text.num_hidden_layers}, got {layers}"
        )
    lm = model.model.language_model
    lm.layers = torch.nn.ModuleList([lm.layers[i] for i in layers])
    for i, layer in enumerate(lm.layers):
        layer.self_attn.layer_idx = i  # its slot in a KV cache
    text.num_hidden_layers = len(layers)
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = [text.layer_types[i] for i in layers]


def deepen_vision(model, depth: int) -> None:
    """Give the vision encoder `depth` blocks, the new ones first and each an identity at the start
    (a copy of the first block whose attention and MLP output projections are zero): the model's
    outputs are unchanged, and it saves and loads as the stock class (its config follows)."""
    import copy

    visual = model.model.visual
    have = len(visual.blocks)
    if depth < have:
        raise ValueError(f"the vision encoder has {have} blocks; it can only grow, not to {depth}")
    new = []
    for _ in range(depth - have):
        block = copy.deepcopy(visual.blocks[0])
        for lin in (block.attn.proj, block.mlp.down_proj):
            torch.nn.init.zeros_(lin.weight)
            torch.nn.init.zeros_(lin.bias)
        new.append(block)
    visual.blocks = torch.nn.ModuleList([*new, *visual.blocks])
    model.config.vision_config.depth = depth
    # full-attention block indexes (none in the pairs' encoders) move with their blocks
    shift = depth - have
    visual.fullatt_block_indexes = [i + shift for i in visual.fullatt_block_indexes]
    model.config.vision_config.fullatt_block_indexes = list(visual.fullatt_block_indexes)


def _phase_key(cfg: TrainConfig, index: int) -> str:
    # fields that older configs did not have leave their keys as they were while left at their defaults
    new = {
        "init_layers": None,
        "prune_strategies": TrainConfig.prune_strategies,
        "aux_label_weights": {},
        "aux_needle_weight": 0.0,
    }
    fixed = {k: v for k, v in asdict(cfg).items() if k != "phases" and not (k in new and v == new[k])}
    phases = [{k: v for k, v in asdict(p).items() if v is not None} for p in cfg.phases]  # unset: as before
    text = json.dumps([fixed, phases[: index + 1]], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def train(cfg: TrainConfig, log=print, cache: Path | None = None, workers: int = 0):
    """All phases. `cache`: a directory where each finished phase's state is kept and reused by a
    later run whose settings up to that phase are identical (a development shortcut; training is
    deterministic, so reusing a phase gives the same result as re-running it). `workers`: processes
    preparing the batches ahead (`phase_batches`; the same checkpoints for any number)."""
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer()
    if cfg.init is not None:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(cfg.init, dtype=torch.float32).train()
        set_generation_defaults(model)
        if cfg.init_layers is not None:
            keep_layers(model, cfg.init_layers)
    else:
        model = new_model(cfg.role, seed=cfg.seed, **cfg.overrides).train()
    niah = any(p.task in ("niah", "lists") for p in cfg.phases)
    cues = niah or any(p.task == "narrate" for p in cfg.phases)
    aux = AuxHeads(model.config.text_config.hidden_size, cues=cues, global_labels=("step",) if niah else ())
    log(f"[{cfg.role}] {n_params(model) / 1e6:.3f}M params; {asdict(cfg)}")
    t0 = time.perf_counter()
    for index, phase in enumerate(cfg.phases):
        saved = cache / f"{cfg.role}-{_phase_key(cfg, index)}.pt" if cache is not None else None
        if saved is not None and saved.exists():
            state = torch.load(saved)
            model.load_state_dict(state["model"])
            aux.load_state_dict(state["aux"])
            log(f"[{cfg.role} {phase.name}] reused from {saved}")
            continue
        run_phase(model, aux, tokenizer, cfg, index, log, workers)
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "aux": aux.state_dict()}, saved)
    model.eval()
    return model, tokenizer, time.perf_counter() - t0


def main(argv=None, defaults: dict | None = None, out: Path | None = None, doc: str | None = None) -> None:
    defaults = DEFAULTS if defaults is None else defaults
    p = argparse.ArgumentParser(
        description=doc or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--role", choices=["target", "draft", "both"], default="both")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every phase's steps (quick tries)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=out or Path(__file__).parent / "pair")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", type=Path, default=None, help="keep/reuse finished phases here (development)")
    p.add_argument(
        "--workers",
        type=int,
        default=usable_cores(),
        help="processes preparing each step's batch ahead of the training (rendering, and a distillation's "
        "teacher answers), each with --threads threads; one for a phase without a teacher (default: one "
        "per usable core; 0: in the training process). The checkpoints are the same for any number",
    )
    args = p.parse_args(argv)
    if args.workers < 0:
        p.error(f"--workers must be 0 (batches prepared in the training process) or more, got {args.workers}")
    torch.set_num_threads(args.threads)
    roles = ["target", "draft"] if args.role == "both" else [args.role]
    total = 0.0
    for role in roles:
        cfg = defaults[role]
        phases = [replace(ph, steps=max(1, round(ph.steps * args.scale))) for ph in cfg.phases]
        cfg = replace(cfg, seed=args.seed, phases=phases)
        model, tokenizer, seconds = train(cfg, cache=args.cache, workers=args.workers)
        total += seconds
        out = args.out / role
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        print(f"[{role}] trained in {seconds:.0f}s -> {out}")
    print(f"total training time {total:.0f}s")


SMALL = [(112, 8, 16)]
MIXED = [
    (112, 8, 16),
    (224, 16, 4),
    (112, 8, 16),
    (336, 8, 4),
    (168, 8, 8),
    (448, 16, 1),
    (224, 8, 8),
    (336, 16, 2),
]


def _phases(small: int, mixed: int, prune_frac: float) -> list[Phase]:
    return [
        Phase("vision", 1200, SMALL, lr=3e-3, vision_only=True, one_object_frac=0.1),
        Phase("small", small, SMALL, lr=3e-3, one_object_frac=0.1, prune_frac=prune_frac),
        Phase("mixed", mixed, MIXED, lr=1e-3, vision_lr_scale=0.1, prune_frac=prune_frac),
    ]


DEFAULTS = {
    "target": TrainConfig(role="target", phases=_phases(600, 400, prune_frac=0.0)),
    "draft": TrainConfig(role="draft", phases=_phases(1000, 700, prune_frac=0.5)),
}

if __name__ == "__main__":
    main()
