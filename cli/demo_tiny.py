"""`hippo demo --adapter NAME`: lossless speculative decoding on a tiny random video-LLM (a wiring check).

Builds the tiny random target/draft pair of an adapter (Qwen2.5-VL by default) in float32, makes a
synthetic video, and decodes the same prompt three ways:

- `autoregressive`: the target alone, one token per forward (the reference and the baseline);
- `serial`: the tiny draft q proposes γ tokens from `keep_ratio` of the visual tokens, the target p
  verifies them in one forward;
- `self-speculation`: the target drafts for itself from `keep_ratio` of the video. With random weights
  a different small draft rarely agrees with p, but the target agrees with itself, so MAT > 1.

Greedy outputs must be token-for-token identical to the autoregressive one (and to transformers'
`target.generate`); `run_demo` reports whether they are.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from hippo.builder import PipelineBuilder
from hippo.errors import ConfigError
from hippo.registry import lookup

#: Text around the video, as token ids (the tiny models have no tokenizer). Ids < 150 are plain text.
TEXT_BEFORE = [1, 17, 42, 23, 8]
TEXT_AFTER = [61, 19, 77, 33]
DEFAULT_SIZE = 112


def synthetic_video(frames: int, size: int, seed: int = 0) -> torch.Tensor:  # -> [T, H, W, 3] in [0, 1]
    """A textured background, a bright border, and two coloured squares moving across the frames."""
    g = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(
        torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32), indexing="ij"
    )
    phase = torch.rand(3, generator=g) * 2 * math.pi
    texture = torch.stack(
        [
            0.35 + 0.12 * torch.sin(x / 5 + y / 9 + phase[c]) + 0.08 * torch.cos(y / 4 - phase[c])
            for c in range(3)
        ],
        dim=-1,
    )  # [H, W, 3]
    video = texture.expand(frames, -1, -1, -1).clone()
    video += 0.04 * torch.rand(video.shape, generator=g)  # per-frame sensor noise
    border = max(2, size // 28)
    video[:, :border], video[:, -border:] = 1.0, 1.0
    video[:, :, :border], video[:, :, -border:] = 1.0, 1.0
    side = max(4, size // 5)
    span = size - 2 * border - side
    colours = (torch.tensor([0.95, 0.15, 0.1]), torch.tensor([0.1, 0.35, 0.95]))
    for t in range(frames):
        f = t / max(1, frames - 1)
        # square 1 moves left -> right along the upper third; square 2 moves top -> bottom on the right
        corners = (
            (border + round(f * span), border + span // 4),
            (border + round((1 - f) * span), border + 3 * span // 4),
        )
        for (left, top), colour in zip(corners, colours):
            video[t, top : top + side, left : left + side] = colour
    return video.clamp_(0.0, 1.0)


def _validate(frames: int, size: int, max_new_tokens: int, gamma: int, keep_ratio: float, unit: int) -> None:
    if frames < 1:
        raise ConfigError(f"--frames must be >= 1, got {frames}")
    if size < unit or size % unit:
        raise ConfigError(
            f"--size must be a positive multiple of {unit} (the model's patch size x spatial merge), got {size}"
        )
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if gamma < 1:
        raise ConfigError(f"--gamma must be >= 1, got {gamma}")
    if not 0.0 < keep_ratio <= 1.0:
        raise ConfigError(f"--keep-ratio must be in (0, 1], got {keep_ratio}")


def _video_token_id(config: Any) -> int | None:
    for key in ("video_token_id", "video_token_index"):
        if getattr(config, key, None) is not None:
            return int(getattr(config, key))
    return None


def _timed(fn, *args, **kwargs) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def run_demo(
    *,
    frames: int = 8,
    size: int | None = None,
    max_new_tokens: int = 64,
    gamma: int = 5,
    keep_ratio: float = 0.2,
    seed: int = 0,
    adapter: str = "qwen2_5_vl",
    repeats: int = 3,
    threads: int | None = 1,
) -> dict[str, Any]:
    """Run the demo and return a JSON-serialisable result (see `format_result` for the text view).

    `adapter` is any registered adapter that ships a tiny model; `size=None` picks the smallest
    frame size >= 112 that its vision patches tile.

    Each run is preceded by a short warm-up generation and timed `repeats` times; the best wall time
    is reported (the tiny models take milliseconds, so other processes easily add noise). `threads`
    sets torch's intra-op threads for the duration (restored afterwards; None leaves them alone):
    the tiny models are far too small for threads to pay off, and on a busy machine thread
    contention made the demo about 10x slower.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(frames, size, max_new_tokens, gamma, keep_ratio, seed, adapter, max(1, repeats))
    finally:
        torch.set_num_threads(before)


def _run(
    frames: int,
    size: int | None,
    max_new_tokens: int,
    gamma: int,
    keep_ratio: float,
    seed: int,
    adapter: str,
    repeats: int,
) -> dict[str, Any]:
    cls = lookup("adapters", adapter)
    target = cls.tiny_model("target", seed=seed, dtype=torch.float32)
    draft = cls.tiny_model("draft", seed=seed + 1, dtype=torch.float32)
    vc = target.config.vision_config
    unit = int(vc.patch_size) * int(getattr(vc, "spatial_merge_size", 1))
    if size is None:  # the smallest valid size >= DEFAULT_SIZE (112 for Qwen2.5-VL, 128 for Qwen3-VL)
        size = -(-DEFAULT_SIZE // unit) * unit
    _validate(frames, size, max_new_tokens, gamma, keep_ratio, unit)
    video = synthetic_video(frames, size, seed)
    inputs = cls.synthetic_inputs(target, video, TEXT_BEFORE, TEXT_AFTER)
    prompt = inputs["input_ids"][0]

    def builder(draft_model: Any) -> PipelineBuilder:
        return PipelineBuilder().target(target).draft(draft_model).selector("uniform", keep_ratio=keep_ratio)

    runs = [
        ("autoregressive", "-", builder(draft).scheduler("autoregressive").build()),
        ("serial", "tiny draft", builder(draft).scheduler("serial", gamma=gamma).build()),
        ("self-speculation", "target (self)", builder(target).scheduler("serial", gamma=gamma).build()),
    ]
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False)
    for _, _, pipe in runs:  # first forwards pay one-off allocation costs; keep them out of the timings
        pipe.generate(inputs, max_new_tokens=min(4, max_new_tokens), do_sample=False)

    results: list[dict[str, Any]] = []
    reference: list[int] | None = None
    baseline = None
    for name, drafted_by, pipe in runs:
        outs = [_timed(pipe.generate, inputs, **gen) for _ in range(repeats)]
        out, seconds = outs[0][0], min(t for _, t in outs)
        repeatable = all(torch.equal(o.sequences, out.sequences) for o, _ in outs)
        tokens = out.sequences[0, prompt.shape[0] :].tolist()
        if reference is None:
            reference, baseline = tokens, seconds
        s = out.stats
        results.append(
            {
                "name": name,
                "scheduler": pipe.names.get("scheduler"),
                "draft": drafted_by,
                "gamma": None if name == "autoregressive" else gamma,
                "visual_tokens": s.visual_tokens,
                "kept_visual_tokens": None if name == "autoregressive" else s.kept_visual_tokens,
                "new_tokens": s.new_tokens,
                "tokens": tokens,
                "identical": tokens == reference and repeatable,
                "repeatable": repeatable,
                "mat": s.mat,
                "acceptance_rate": s.acceptance_rate,
                "rounds": s.rounds,
                # target forwards: the prefill, then one per token (autoregressive) or per verify round
                "target_forwards": s.new_tokens if name == "autoregressive" else 1 + s.rounds,
                "seconds": seconds,
                "speedup": baseline / seconds if seconds > 0 else float("nan"),
                "stats": s.as_dict(),
            }
        )

    # The reference itself must be what transformers' generate returns.
    with torch.inference_mode():
        hf, hf_seconds = _timed(target.generate, **inputs, max_new_tokens=max_new_tokens, do_sample=False)
    hf_tokens = hf[0, prompt.shape[0] :].tolist()
    return {
        "adapter": adapter,
        "dtype": "float32",
        "settings": {
            "frames": frames,
            "size": size,
            "max_new_tokens": max_new_tokens,
            "gamma": gamma,
            "keep_ratio": keep_ratio,
            "seed": seed,
            "repeats": repeats,
            "threads": torch.get_num_threads(),
        },
        "prompt_ids": prompt.tolist(),
        "video_token_id": _video_token_id(target.config),
        "visual_tokens": results[0]["visual_tokens"],
        "runs": results,
        "transformers_generate": {
            "tokens": hf_tokens,
            "identical": hf_tokens == reference,
            "seconds": hf_seconds,
        },
        "all_identical": all(r["identical"] for r in results) and hf_tokens == reference,
    }


def _ids(ids: list[int], repeated: int | None = None) -> str:
    """Token ids on one line, with runs of the video token folded: `153 x64`."""
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] == ids[i]:
            j += 1
        if ids[i] == repeated and j - i > 3:
            parts.append(f"[{ids[i]} x{j - i}]")
            i = j
        else:
            parts.append(str(ids[i]))
            i += 1
    return " ".join(parts)


def format_result(result: dict[str, Any]) -> str:
    """The text report `hippo demo` prints."""
    st = result["settings"]
    lines = [
        f"hippo demo: tiny random {result['adapter']} target p and draft q ({result['dtype']}, seed {st['seed']}), "
        f"synthetic video {st['frames']} frames x {st['size']}x{st['size']} -> {result['visual_tokens']} visual tokens",
        f"greedy decoding, max_new_tokens={st['max_new_tokens']}, gamma={st['gamma']}, keep_ratio={st['keep_ratio']}",
        "",
        f"prompt token ids ({len(result['prompt_ids'])}): {_ids(result['prompt_ids'], result['video_token_id'])}",
        "",
    ]
    for r in result["runs"]:
        lines.append(f"{r['name']} output ({r['new_tokens']} tokens): {_ids(r['tokens'])}")
    lines.append("")
    header = (
        f"{'run':<17} {'draft':<13} {'kept':>7} {'γ':>2} {'new':>4} {'MAT':>5} {'p fwd':>5} "
        f"{'wall s':>7} {'speedup':>7}  identical"
    )
    lines += [header, "-" * len(header)]
    for r in result["runs"]:
        kept = "-" if r["kept_visual_tokens"] is None else f"{r['kept_visual_tokens']}/{r['visual_tokens']}"
        gamma = "-" if r["gamma"] is None else str(r["gamma"])
        same = "reference" if r["name"] == "autoregressive" else ("yes" if r["identical"] else "NO")
        if not r["repeatable"]:
            same += " (repeated runs differ!)"
        lines.append(
            f"{r['name']:<17} {r['draft']:<13} {kept:>7} {gamma:>2} {r['new_tokens']:>4} {r['mat']:>5.2f} "
            f"{r['target_forwards']:>5} {r['seconds']:>7.3f} {r['speedup']:>6.2f}x  {same}"
        )
    hf = result["transformers_generate"]
    lines += [
        "",
        f"transformers target.generate: {hf['seconds']:.3f}s, identical to the autoregressive output: "
        f"{'yes' if hf['identical'] else 'NO'}",
        "MAT: tokens emitted per target verification (accepted draft tokens + 1); p fwd: target forwards "
        "(prefill included).",
        f"wall s: best of {st['repeats']} runs. These are RANDOM models: their speedups mean nothing (tiny "
        "models on a CPU are overhead-bound, and random drafts rarely agree). This checks that the backbone "
        "decodes losslessly; run `hippo demo` without --adapter for the trained pair's real speedup.",
        "all outputs identical: "
        + ("yes" if result["all_identical"] else "NO - speculative decoding changed the output (a bug)"),
    ]
    return "\n".join(lines)
