"""`hippo generate` and `hippo bias`: a video file and a prompt through a checkpoint pair.

Order of work, so that bad input fails fast, before any model is loaded: options -> checkpoints
(config.json, weights, tokenizers, vocabularies) -> the video (and its audio, for audio-visual
backbones) -> load the models -> build the inputs -> generate. Streamed text goes to stdout; progress
bars, the summary and the comparison go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from hippo.builder import PartSpec, PipelineBuilder, PipelineConfig
from hippo.checkpoint import check_output, check_same_backbone
from hippo.conversation import Prompt
from hippo.errors import ConfigError, HippoError
from hippo.media.inputs import (
    build_video_inputs,
    check_checkpoint,
    check_device,
    check_tokenizers,
    check_vocab_sizes,
    decode_video,
    detect_backbone,
    has_tokenizer,
    load_config,
    load_tokenizer,
    needs_audio,
    read_audio_track,
)
from hippo.registry import lookup

EXIT_MISMATCH = 1

#: What `hippo generate` runs when neither a flag nor --config says otherwise.
DEFAULTS = PipelineConfig(
    scorer="holistic",
    selector=PartSpec("topk", {"keep_ratio": 0.1}),
    scheduler=PartSpec("auto"),
)


# ---- options ---------------------------------------------------------------------------------------


def _accepts(kind: str, name: str, option: str) -> bool:
    config = getattr(lookup(kind + "s", name), "Config", None)
    return attrs.has(config) and option in attrs.fields_dict(config)


def _override(kind: str, spec: PartSpec, name: str | None, option: str, value: Any) -> PartSpec:
    """`spec` with its name replaced by `name` and `option` set to `value` (flags beat the config).

    A new name starts from no options but keeps `option` (keep ratio, γ) when the new part takes it.
    """
    if name is not None and name != spec.name:
        carried = {option: spec.options[option]} if option in spec.options else {}
        spec = PartSpec(name, carried if _accepts(kind, name, option) else {})
    if value is not None:
        spec = PartSpec(spec.name, {**spec.options, option: value})
    return spec


def pipeline_config(args: argparse.Namespace) -> PipelineConfig:
    """--config FILE (else the command's defaults), then every flag given on the command line."""
    base = PipelineConfig.from_file(args.config) if getattr(args, "config", None) else DEFAULTS
    changes: dict[str, Any] = {}
    for key in ("target", "draft", "backbone", "dtype", "device", "target_device_map", "draft_device"):
        if getattr(args, key, None) is not None:
            changes[key] = getattr(args, key)
    if getattr(args, "scorer", None) is not None:
        changes["scorer"] = None if args.scorer == "none" else PartSpec(args.scorer)
    changes["selector"] = _override(
        "selector",
        base.selector,
        getattr(args, "selector", None),
        "keep_ratio",
        getattr(args, "keep_ratio", None),
    )
    changes["scheduler"] = _override(
        "scheduler", base.scheduler, getattr(args, "scheduler", None), "gamma", getattr(args, "gamma", None)
    )
    name = changes["scheduler"].name
    if getattr(args, "gamma", None) is not None and not _accepts("scheduler", name, "gamma"):
        raise ConfigError(
            f"--gamma does not apply to scheduler {name!r} (it chooses γ itself); add --scheduler serial, "
            "pearl or hippo to fix γ"
        )
    return attrs.evolve(base, **changes)


def generation_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    gen: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    for flag, key in (("--temperature", "temperature"), ("--top-p", "top_p"), ("--top-k", "top_k")):
        value = getattr(args, key)
        if value is None:
            continue
        if not args.do_sample:
            raise ConfigError(
                f"{flag} only applies when sampling; add --do-sample (greedy decoding ignores it)"
            )
        gen[key] = value
    if gen.get("temperature") is not None and not 0 < gen["temperature"] < math.inf:
        raise ConfigError(f"--temperature must be a finite number > 0, got {gen['temperature']}")
    if gen.get("top_p") is not None and not 0 < gen["top_p"] <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {gen['top_p']}")
    if gen.get("top_k") is not None and gen["top_k"] < 1:
        raise ConfigError(f"--top-k must be >= 1, got {gen['top_k']}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed must be in [0, 2**63), got {args.seed}")
    return gen


def check_video_options(args: argparse.Namespace) -> None:
    if args.frames is not None and args.frames < 1:
        raise ConfigError(f"--frames must be >= 1, got {args.frames}")
    if args.fps is not None and not 0 < args.fps < math.inf:
        raise ConfigError(f"--fps must be a finite number > 0, got {args.fps}")
    if args.max_pixels is not None and args.max_pixels < 1:
        raise ConfigError(f"--max-pixels must be >= 1, got {args.max_pixels}")


def write_json(path: str, data: Any, flag: str = "--json") -> None:
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
    except OSError as exc:
        raise HippoError(f"cannot write {flag} file {path!r}: {exc.strerror}") from exc


# ---- terminal output -------------------------------------------------------------------------------


class StageBars:
    """tqdm bars on stderr for the long steps: per-frame for the video decode, one per pipeline stage.

    `disable=None` shows them only on a terminal. Once streamed text has started they stay quiet, so
    they never cut into the answer.
    """

    def __init__(self, disable: bool | None = None, file: Any = None, streamer: Any = None):
        self.disable, self.file, self.streamer = disable, file, streamer
        self.bars: dict[str, Any] = {}

    def __call__(self, stage: str, event: str, done: int | None = None, total: int | None = None) -> None:
        from tqdm.auto import tqdm

        if self.disable is True or getattr(self.streamer, "started", False):
            return
        bar = self.bars.get(stage)
        if bar is None and event in ("start", "update"):
            frames = event == "update"  # a stage is one step; the decode counts frames
            bar = tqdm(
                total=total or 1,
                desc=stage,
                unit="frame" if frames else "step",
                bar_format=None if frames else "{desc}: {percentage:3.0f}%|{bar}| {elapsed}",
                file=self.file or sys.stderr,
                disable=self.disable,
            )
            self.bars[stage] = bar
        if bar is None:
            return
        if event == "update":
            bar.update((done or 0) - bar.n)
        if event == "end" or (event == "update" and done is not None and done >= (total or 0)):
            if event == "end":
                bar.update(bar.total - bar.n)
            bar.close()
            del self.bars[stage]

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()


def text_streamer(tokenizer: Any) -> Any:
    """transformers' TextStreamer (prompt skipped, special tokens dropped) that notes when it printed."""
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        started = False

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            self.started = self.started or bool(text)
            print(text, flush=True, end="" if not stream_end else "\n")

    return Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


@contextlib.contextmanager
def quiet_transformers(debug: bool, progress: bool) -> Iterator[None]:
    """transformers' warnings and loading bars off (unless --debug / bars shown on a terminal)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    if not debug:
        hf_logging.set_verbosity_error()
    if not (progress and sys.stderr.isatty()):
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def say(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ---- hippo generate --------------------------------------------------------------------------------


def _target_and_draft(cfg: PipelineConfig, needs_draft: bool, scheduler: str) -> tuple[Path, Path | None]:
    if not cfg.target:
        raise ConfigError('no target checkpoint: pass --target PATH (or set "target" in --config)')
    target = check_checkpoint(cfg.target)
    if not needs_draft:
        return target, None
    if not cfg.draft:
        raise ConfigError(
            f"scheduler {scheduler!r} needs a draft model: pass --draft PATH (the target's own path for "
            "self-speculation) or --scheduler autoregressive"
        )
    return target, check_checkpoint(cfg.draft)


def prepare(args: argparse.Namespace, cfg: PipelineConfig, needs_draft: bool) -> dict[str, Any]:
    """Every check that needs no model: devices, checkpoints, backbone, tokenizers, video, audio."""
    check_video_options(args)
    check_device(cfg.device)
    target, draft = _target_and_draft(cfg, needs_draft, cfg.scheduler.name)
    p_config = load_config(target)
    backbone = detect_backbone(p_config, cfg.backbone)
    tokenizer = load_tokenizer(target)
    if draft is not None:
        q_config = load_config(draft)
        check_same_backbone(backbone, detect_backbone(q_config, cfg.backbone))
        check_vocab_sizes(p_config, q_config)
        if draft != target and has_tokenizer(draft):
            check_tokenizers(tokenizer, load_tokenizer(draft), str(target), str(draft))
    return {"backbone": backbone, "config": p_config, "tokenizer": tokenizer}


def read_inputs(args: argparse.Namespace, ready: dict[str, Any], bars: StageBars) -> tuple[Any, Any]:
    clip = decode_video(args.video, frames=args.frames, fps=args.fps, progress=bars)
    audio = read_audio_track(args.video) if needs_audio(ready["backbone"], ready["config"]) else None
    return clip, audio


def _rates(rates: dict[str, float | None]) -> str:
    return ", ".join(f"{k} {v:.1f}" if v is not None else f"{k} not offered" for k, v in rates.items())


def plan_lines(plan: dict[str, Any]) -> list[str]:
    """`Stats.plan` in words: the schedule `auto` chose and γ's choices, with the predicted tokens/s."""
    if not plan:
        return ["plan: nothing was chosen (a fixed schedule and γ)"]
    lines = []
    if "schedule" in plan:
        lines.append(f"plan: schedule {plan['schedule']}: {plan['why']}")
        lines.append(f"  predicted tokens/s: {_rates(plan['tokens_per_second'])}")
        lines.append(f"  if the draft were always right: {_rates(plan['tokens_per_second_if_always_right'])}")
    measured = plan.get("measured")
    if measured:
        alpha, rate = measured["alpha"], measured["tokens_per_second"]
        lines.append(
            "  measured: "
            + ("no drafted round" if alpha is None else f"α {alpha:.2f}")
            + ("" if rate is None else f", {rate:.1f} tokens/s after the first token")
        )
    keep = plan.get("keep")
    if keep:
        options = ", ".join(
            f"{float(r):g}: {o['answer_seconds']:.2f} s (prefill {o['t_prefill']:.2f} s, then "
            f"{o['tokens_per_second']:.1f} tok/s at α {o['alpha']:.2f})"
            for r, o in keep["options"].items()
        )
        lines.append(
            f"plan: the draft keeps {keep['ratio']:g} of the visual tokens (predicted for "
            f"{keep['answer_tokens']} tokens: {options})"
        )
    g = plan.get("gamma")
    if g:
        lines.append(
            f"plan: γ per round: {g['target_steps']} steps of the target alone in {g['target_runs']} runs, "
            f"{g['probes']} probes of the draft"
        )
        if "alpha" in g:
            lines.append(
                f"  last choice γ = {g['gamma']} at α {g['alpha']:.2f}, t_decode {g['t_decode'] * 1e3:.2f} ms, "
                f"t_draft {g['t_draft'] * 1e3:.2f} ms ({'beside' if g['parallel'] else 'after'} the target); "
                f"predicted tokens/s: {_rates(g['tokens_per_second'])}"
            )
    return lines


def cmd_generate(args: argparse.Namespace) -> int:
    cfg = pipeline_config(args)
    builder = PipelineBuilder.from_config(cfg)  # names and options are validated here
    gen = generation_kwargs(args)
    check_output(args.json, "--json")
    check_output(args.timeline, "--timeline")
    needs_draft = lookup("schedulers", cfg.scheduler.name).needs_draft
    progress = not args.no_progress
    with quiet_transformers(args.debug, progress):
        ready = prepare(args, cfg, needs_draft)
        tokenizer = ready["tokenizer"]
        streamer = text_streamer(tokenizer)
        bars = StageBars(disable=None if progress else True, streamer=streamer)
        try:
            clip, audio = read_inputs(args, ready, bars)
            pipe = builder.build()
            prompt = Prompt(args.prompt, args.system) if args.system else args.prompt
            inputs = build_video_inputs(
                pipe.target_adapter, tokenizer, clip, prompt, max_pixels=args.max_pixels, audio=audio
            )
            ar_pipe = None
            if args.compare_ar:  # like with like: both warm (one untimed one-token run each, so that
                # neither timed run pays the process's one-time costs: packing, thread pools, draft start)
                ar_pipe = (
                    PipelineBuilder()
                    .target(pipe.target, backbone=pipe.target_adapter.name)
                    .scheduler("autoregressive")
                    .build()
                )
                for p in (pipe, ar_pipe):
                    p.generate(inputs, max_new_tokens=1, do_sample=False)
            out = pipe.generate(
                inputs, streamer=streamer, progress=bars, seed=args.seed, timeline=bool(args.timeline), **gen
            )
        finally:
            bars.close()
        L = int(inputs["input_ids"].shape[-1])
        new = out.sequences[0, L:].tolist()
        s = out.stats
        say(f"[{s.scheduler}] {s.summary()}")
        if args.verbose:
            for line in plan_lines(s.plan):
                say(line)
        if args.timeline:
            from hippo.cli.timeline import draw_timeline

            say(f"timeline: {draw_timeline(s, args.timeline)}")
        result: dict[str, Any] = {
            "text": tokenizer.decode(new, skip_special_tokens=True),
            "tokens": new,
            "prompt_tokens": L,
            "stats": s.as_dict(),
            "settings": _settings(cfg, ready["backbone"].name, gen, args),
            "video": _video_info(args.video, clip),
            "compare_ar": None,
        }
        rc = 0
        if ar_pipe is not None:
            ar = ar_pipe.generate(inputs, seed=args.seed, **gen)
            ar_new = ar.sequences[0, L:].tolist()
            identical = ar_new == new
            speedup = ar.stats.seconds_total / s.seconds_total if s.seconds_total > 0 else float("nan")
            say(f"[autoregressive] {ar.stats.summary()}")
            if identical:
                same = "yes"
            elif args.do_sample:
                same = (
                    "no (expected when sampling: both follow the target's distribution, not the same draws)"
                )
            else:
                same = "NO - speculative decoding changed a greedy output"
                rc = EXIT_MISMATCH
            say(f"speedup over autoregressive (both warm): {speedup:.2f}x | outputs identical: {same}")
            result["compare_ar"] = {
                "text": tokenizer.decode(ar_new, skip_special_tokens=True),
                "tokens": ar_new,
                "identical": identical,
                "speedup": speedup,
                "stats": ar.stats.as_dict(),
            }
    if args.json:
        write_json(args.json, result)
    return rc


def _settings(
    cfg: PipelineConfig, backbone: str, gen: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    parts = {k: (None if getattr(cfg, k) is None else attrs.asdict(getattr(cfg, k))) for k in (
        "scorer", "selector", "drafter", "verifier", "scheduler"
    )}  # fmt: skip
    return {
        "target": cfg.target,
        "draft": cfg.draft,
        "backbone": backbone,
        **parts,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "target_device_map": cfg.target_device_map,
        "draft_device": cfg.draft_device,
        "generation": gen,
        "seed": args.seed,
        "frames": args.frames,
        "fps": args.fps,
        "max_pixels": args.max_pixels,
        "prompt": args.prompt,
        "system": getattr(args, "system", None),
    }


def _video_info(path: str, clip: Any) -> dict[str, Any]:
    return {
        "path": str(path),
        "frames": len(clip.indices),
        "total_frames": getattr(clip, "total_frames", None),
        "fps": clip.fps,
        "height": int(clip.frames.shape[1]),
        "width": int(clip.frames.shape[2]),
        "indices": list(clip.indices),
        "timestamps": [round(float(t), 6) for t in clip.timestamps],
    }


# ---- hippo bias ------------------------------------------------------------------------------------


def cmd_bias(args: argparse.Namespace) -> int:
    from hippo.cli.bias import plot_position_bias, position_bias

    lookup("selectors", "topk").from_options(keep_ratio=args.keep_ratio)  # fails fast on a bad ratio
    if not 0.0 <= args.boundary <= 0.5:
        raise ConfigError(f"--boundary must be a fraction of the rows in [0, 0.5], got {args.boundary}")
    check_output(args.json, "--json")
    check_output(args.png, "--png")
    cfg = PipelineConfig(
        target=args.target,
        backbone=args.backbone or "auto",
        scorer="holistic",
        selector=PartSpec("topk", {"keep_ratio": args.keep_ratio}),
        scheduler="autoregressive",
        dtype=args.dtype,
        device=args.device,
    )
    progress = not args.no_progress
    with quiet_transformers(args.debug, progress):
        ready = prepare(args, cfg, needs_draft=False)
        bars = StageBars(disable=None if progress else True)
        try:
            clip, audio = read_inputs(args, ready, bars)
        finally:
            bars.close()
        pipe = PipelineBuilder.from_config(cfg).build()
        inputs = build_video_inputs(
            pipe.target_adapter,
            ready["tokenizer"],
            clip,
            args.prompt,
            max_pixels=args.max_pixels,
            audio=audio,
        )
        with torch.inference_mode():
            result = position_bias(pipe, inputs, keep_ratio=args.keep_ratio, boundary=args.boundary)
    result["video"] = _video_info(args.video, clip)
    result["target"] = args.target
    print(format_bias(result))
    if args.png:
        plot_position_bias(result, args.png)
        print(f"bar chart: {args.png}")
    if args.json:
        write_json(args.json, result)
        print(f"json: {args.json}")
    return 0


def format_bias(result: dict[str, Any]) -> str:
    """A short table: per method, the share of kept tokens on the frames' top/bottom rows vs the base rate."""
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    lines = [
        f"position bias: top {100 * result['keep_ratio']:g}% of {result['tokens']} visual tokens kept "
        f"({result['frames']} frames); boundary = top/bottom {100 * result['boundary_fraction']:g}% of rows, "
        f"base rate {pct(result['base_rate'])}",
        f"{'method':<10} {'kept':>5} {'boundary':>8} {'share':>7} {'bias':>6}  per-frame max",
    ]
    for name, m in result["methods"].items():
        bias = "-" if m["bias"] is None else f"{m['bias']:.2f}x"
        lines.append(
            f"{name:<10} {m['kept']:>5} {m['boundary_kept']:>8} {pct(m['boundary_share']):>7} {bias:>6}  "
            f"{pct(m['per_frame_max_share'])}"
        )
    lines.append("bias: boundary share / base rate (1.00x = no position bias)")
    return "\n".join(lines)
