"""`hippo demo`: the trained narration pair narrates a rendered clip, losslessly and faster.

The demo renders a held-out clip of the benchmark's narration task to a real video file (FFV1 in
Matroska, in a temporary directory) and answers a question about it through the same path as
`hippo generate`: decord reads the file, the checkpoint's tokenizer and chat template build the
prompt, the adapter builds the pixels. The answer streams as text. Then the target alone (transformers'
`generate`) answers the same inputs, and one comparison is printed: identical or not, tokens per
second of each, MAT, and the speedup. Both runs are preceded by a short warm-up generation.

The pair (`hippo.cli/pair/narrate`, loaded by `hippo.cli.pair.checkpoint`) ships inside the package, so the demo needs neither a
checkout nor a download; its target is widened function-preservingly at load time (32.1M parameters).
`--adapter NAME` runs the random tiny pair of any backbone instead (`hippo.cli.demo_tiny`).
"""

from __future__ import annotations

import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hippo.builder import PipelineBuilder
from hippo.errors import ConfigError, ModelError

DEFAULT_QUESTION = "narrate the video ."
#: the questions the pair was trained on (any text is accepted; others give untrained answers)
TRAINED_QUESTIONS = ("narrate the video .", "narrate the <colour> object .", "where does the <shape> go ?")
#: the fastest lossless configuration `hippo bench` measured on this pair on a 2-core CPU
DEFAULT_SCHEDULER = "auto"  # the schedule and γ from costs measured once per machine (--gamma N: serial)
DEFAULT_GAMMA: int | str = "auto"  # γ per round from the cost model (hippo/cost.py)
DEFAULT_KEEP_RATIO = 1.0  # 1.0: the draft sees the full video
MAX_NEW_TOKENS = 256
HELD_OUT = 10**9  # clip seeds the pair never saw in training


def _load_pair(log) -> tuple[Any, Any, Path]:
    from hippo.cli.pair.checkpoint import CHECKSUMS, NARRATE_DIR, ChecksumError, load_pair

    if not (NARRATE_DIR / CHECKSUMS).is_file():
        raise ModelError(
            f"the narration pair is missing from {NARRATE_DIR}; reinstall hippo (the pair ships with it)"
        )
    t0 = time.perf_counter()
    try:
        target, draft, _ = load_pair(directory=NARRATE_DIR)
    except ChecksumError as exc:
        raise ModelError(f"the packaged narration pair is damaged: {exc}; reinstall hippo") from None
    n = sum(p.numel() for p in target.parameters()) / 1e6
    m = sum(p.numel() for p in draft.parameters()) / 1e6
    log(
        f"loaded the narration pair in {time.perf_counter() - t0:.1f} s: target {n:.1f}M, draft {m:.1f}M parameters"
    )
    return target, draft, NARRATE_DIR


def render_clip(seed: int, directory: Path) -> tuple[Path, Any]:
    """A held-out narration clip written to `directory/clip.mkv`; returns (path, the task's sample)."""
    from hippo.cli.pair.narration import NARRATE_BENCH, narration_sample
    from hippo.media.video import write_video

    clip = narration_sample(HELD_OUT + seed, NARRATE_BENCH, ask=("all", None))
    path = write_video(directory / "clip.mkv", clip.video, clip.fps)
    return path, clip


def _validate(max_new_tokens: int, gamma: int | str, keep_ratio: float, question: str) -> None:
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if gamma != "auto" and (not isinstance(gamma, int) or gamma < 1):
        raise ConfigError(f"--gamma must be an integer >= 1 or 'auto', got {gamma!r}")
    if not 0.0 < keep_ratio <= 1.0:
        raise ConfigError(f"--keep-ratio must be in (0, 1], got {keep_ratio}")
    if not question.strip():
        raise ConfigError("--question is empty; ask e.g. 'narrate the video .'")


def run_demo(
    *,
    seed: int = 0,
    question: str = DEFAULT_QUESTION,
    max_new_tokens: int = MAX_NEW_TOKENS,
    scheduler: str = DEFAULT_SCHEDULER,
    gamma: int | str = DEFAULT_GAMMA,
    keep_ratio: float = DEFAULT_KEEP_RATIO,
    streamer_factory: Any = None,
    workdir: str | Path | None = None,
    timeline: str | Path | None = None,
    compile_target: bool = False,
    log: Any = print,
) -> dict[str, Any]:
    """Render a clip, stream hippo's answer, time the target alone, and return the comparison.

    `streamer_factory(tokenizer)` makes the streamer of hippo's answer (None: not streamed);
    `workdir` receives clip.mkv (default: a new temporary directory, kept so the clip can be reused);
    `timeline`: draw hippo's run there as a Gantt chart (`hippo.cli.timeline`).
    """
    from hippo.media.inputs import build_video_inputs, decode_video, load_tokenizer

    _validate(max_new_tokens, gamma, keep_ratio, question)
    directory = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="hippo-demo-"))
    directory.mkdir(parents=True, exist_ok=True)
    target, draft, pair_dir = _load_pair(log)
    path, sample = render_clip(seed, directory)
    frames = int(sample.video.shape[0])

    # the same path as `hippo generate`: decord, the checkpoint's tokenizer and chat template, the adapter
    tokenizer = load_tokenizer(pair_dir / "target")
    builder = PipelineBuilder().target(target).draft(draft).scorer("holistic")
    builder.selector("topk", keep_ratio=keep_ratio)
    builder.scheduler(scheduler, **({} if scheduler == "auto" else {"gamma": gamma}))
    if compile_target:
        builder.compile("target")
    pipe = builder.build()
    clip = decode_video(path, frames=frames)
    inputs = build_video_inputs(pipe.target_adapter, tokenizer, clip, question)
    L = int(inputs["input_ids"].shape[1])
    visual = int((inputs["mm_token_type_ids"] == 2).sum())
    log(
        f"clip: {path} ({frames} frames at {sample.fps:g} fps, {clip.frames.shape[2]}x{clip.frames.shape[1]} px, "
        f"{visual} visual tokens; prompt {L} tokens)"
    )
    log(f"question: {question}")

    gen = dict(max_new_tokens=max_new_tokens, do_sample=False)
    with torch.inference_mode():  # warm-up: first forwards pay one-off allocations, for both sides
        if compile_target:
            log("compiling the target's decode and verify steps (inductor; cached on disk for later runs)...")
        warm = pipe.generate(inputs, max_new_tokens=4, do_sample=False).stats.seconds_compile
        if compile_target:
            log(f"compiled in {warm:.1f} s")
        target.generate(**inputs, max_new_tokens=4, do_sample=False)
    where = "the full video" if keep_ratio >= 1.0 else f"{keep_ratio:.0%} of the visual tokens"
    if scheduler == "auto":
        how, where = (
            "schedule, γ and keep ratio from the cost model",
            f"as much as it chooses (selector: {where})",
        )
    else:
        how = f"{scheduler} schedule, " + ("γ from the cost model" if gamma == "auto" else f"γ={gamma}")
    log(f"answer (hippo, {how}; the draft sees {where}):")
    streamer = streamer_factory(tokenizer) if streamer_factory is not None else None
    t0 = time.perf_counter()
    out = pipe.generate(inputs, streamer=streamer, timeline=timeline is not None, **gen)
    hippo_s = time.perf_counter() - t0
    with torch.inference_mode():
        t0 = time.perf_counter()
        ref = target.generate(**inputs, **gen)
        target_s = time.perf_counter() - t0
    pipe.close()
    ours, theirs = out.sequences[0, L:].tolist(), ref[0, L:].tolist()
    if timeline is not None:
        from hippo.cli.timeline import draw_timeline

        title = f"hippo demo: {scheduler}, γ={gamma}, {len(ours)} tokens in {hippo_s:.2f} s"
        timeline = str(draw_timeline(out.stats, timeline, title=title))
    command = [
        "hippo", "generate", "--target", str(pair_dir / "target"), "--draft", str(pair_dir / "draft"),
        "--video", str(path), "--frames", str(frames), "--prompt", question, "--scheduler", scheduler,
        *([] if scheduler == "auto" else ["--gamma", str(gamma)]),  # auto chooses γ itself
        "--keep-ratio", str(keep_ratio), "--max-new-tokens", str(max_new_tokens), "--compare-ar",
    ]  # fmt: skip
    return {
        "pair": str(pair_dir),
        "clip": {
            "path": str(path),
            "frames": frames,
            "fps": sample.fps,
            "visual_tokens": visual,
            "seed": seed,
        },
        "question": question,
        "prompt_tokens": L,
        "settings": {
            "scheduler": scheduler,
            "gamma": gamma,
            "keep_ratio": keep_ratio,
            "compile": ["target"] if compile_target else [],
            **gen,
        },
        "seconds_compile": warm,
        "threads": torch.get_num_threads(),
        "text": tokenizer.decode(ours, skip_special_tokens=True),
        "hippo": {"tokens": ours, "seconds": hippo_s, "mat": out.stats.mat, "stats": out.stats.as_dict()},
        "target": {"tokens": theirs, "seconds": target_s},
        "identical": ours == theirs,
        "speedup": target_s / hippo_s if hippo_s > 0 else float("nan"),
        "command": shlex.join(command),
        "timeline": timeline,
    }


def format_comparison(result: dict[str, Any]) -> str:
    """The short comparison printed after the streamed answer."""
    h, t = result["hippo"], result["target"]
    rows = [
        ("target alone (transformers generate)", len(t["tokens"]), t["seconds"], 1.0, "reference"),
        (f"hippo ({result['settings']['scheduler']})", len(h["tokens"]), h["seconds"], h["mat"],
         "yes" if result["identical"] else "NO"),
    ]  # fmt: skip
    lines = [f"{'':<38} {'tokens':>6} {'seconds':>8} {'tokens/s':>9} {'MAT':>5}  identical"]
    for name, n, s, mat, same in rows:
        lines.append(f"{name:<38} {n:>6} {s:>8.2f} {n / s:>9.1f} {mat:>5.2f}  {same}")
    verdict = "identical output" if result["identical"] else "OUTPUT DIFFERS (a bug: please report it)"
    stats = h["stats"]
    lines += [
        f"speedup: {result['speedup']:.2f}x with {verdict} ({result['threads']} threads, float32, greedy)",
        f"the draft saw {stats['kept_visual_tokens']} of the {stats['visual_tokens']} visual tokens.",
        "MAT: tokens emitted per target forward in decoding (accepted draft tokens + 1).",
        "the same answer from the command line (on the checkpoint's target as trained, 1.1M parameters "
        f"without the widening: the same tokens at a fraction of the cost, so a smaller speedup):\n  {result['command']}",
    ]
    if result.get("timeline"):
        lines.append(f"timeline of hippo's run: {result['timeline']}")
    return "\n".join(lines)
