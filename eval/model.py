"""The `hippo` model of lmms-eval: each request's video and question through a hippo pipeline.

    python -m lmms_eval --model hippo --model_args target=/models/7B,draft=/models/0.5B --tasks videomme
    hippo eval --tasks videomme --target /models/7B --draft /models/0.5B      # the same, plus --baseline

Model args (lmms-eval's `--model_args k=v,...`): `target`, `draft` (checkpoint directories; neither
given: the narration pair that ships with hippo, as `hippo demo` runs it), `scheduler`, `keep_ratio`,
`gamma`, `scorer`, `selector`, `backbone`, `device`, `dtype`, `config` (a builder config file,
JSON or TOML, as `hippo generate --config` takes; the other args override it), and the video
sampling: `frames` (N evenly spaced frames) or `fps`, else 2 frames a second and at most
`max_num_frames` (32, as lmms-eval's Qwen2.5-VL model), `max_pixels`. A task may set a video's own
sampling by giving `doc_to_visual` a qwen-vl-utils style dict, `{"type": "video", "video": PATH,
"nframes": N}` (or `"fps"`, `"max_pixels"`), instead of the path.

`generate_until` builds every request's inputs with the checkpoint's tokenizer and chat template and
decodes them with `Pipeline.map`: greedy requests are continuously batched on the engine when the
schedule has a batched form and lmms-eval's `--batch_size` is above 1, the others one after another;
each answer is exactly the target's own. Generation settings are mapped as lmms-eval's Qwen2.5-VL
model maps them: `temperature` > 0 samples (with `top_p`), else greedy; `max_new_tokens` (default
32768, capped by the target's context); `until` cuts the decoded text after generation ("\\n\\n"
ignored). Each answer carries its speed in the logged sample's `token_counts` (new tokens, MAT,
tokens/s, TTFT, seconds); the run's totals go to lmms-eval's throughput summary
(`results["throughput"]`) and its log line.

`loglikelihood` and multi-round generation are not supported (UnsupportedError): tasks scored by
likelihood need the target alone, which speculative decoding does not change.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch
from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from lmms_eval.models.model_utils.gen_metrics import log_metrics
from tqdm import tqdm

from hippo.errors import ConfigError, HippoError, InputError, ModelError, UnsupportedError

#: lmms-eval's Qwen2.5-VL defaults: frames at most, and new tokens when a task sets none
MAX_NUM_FRAMES = 32
MAX_NEW_TOKENS = 32768
#: model args that name a pipeline part or setting (the rest are video options and lmms-eval's own)
PIPELINE_ARGS = ("target", "draft", "scheduler", "keep_ratio", "gamma", "scorer", "selector", "backbone")
PIPELINE_ARGS += ("device", "dtype", "config")

#: loaded models, shared by the runs of one process (`hippo eval --baseline` reuses the target)
_MODELS: dict[tuple, Any] = {}


@dataclasses.dataclass
class SpeedCounts(TokenCounts):
    """lmms-eval's per-answer token counts plus hippo's speed figures (the logged sample's
    `token_counts`)."""

    new_tokens: int = 0
    mat: float = 0.0
    tokens_per_second: float = 0.0
    ttft_s: float = 0.0
    seconds: float = 0.0
    scheduler: str = ""
    do_sample: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.update(
            new_tokens=self.new_tokens,
            mat=round(self.mat, 4),
            tokens_per_second=round(self.tokens_per_second, 2),
            ttft_s=round(self.ttft_s, 4),
            seconds=round(self.seconds, 4),
            scheduler=self.scheduler,
            do_sample=self.do_sample,
        )
        return d


def shipped_pair(dtype: torch.dtype = torch.float32) -> tuple[Any, Any, Path]:
    """The narration pair that ships with hippo (target widened as `hippo demo` runs it), loaded once."""
    from hippo.cli.pair.checkpoint import CHECKSUMS, NARRATE_DIR, ChecksumError, load_pair

    key = ("shipped", str(NARRATE_DIR), str(dtype))
    if key not in _MODELS:
        if not (NARRATE_DIR / CHECKSUMS).is_file():
            raise ModelError(
                f"the narration pair is missing from {NARRATE_DIR}; reinstall hippo (the pair ships with it)"
            )
        try:
            target, draft, _ = load_pair(dtype, directory=NARRATE_DIR)
        except ChecksumError as exc:
            raise ModelError(f"the packaged narration pair is damaged: {exc}; reinstall hippo") from None
        _MODELS[key] = (target, draft, NARRATE_DIR)
    return _MODELS[key]


def _load(path: str, backbone: str, dtype: str | None, device: str | None) -> Any:
    from hippo.builder import _DTYPES, load_model

    key = (str(Path(path).resolve()), backbone, dtype, device)
    if key not in _MODELS:
        kwargs = {"dtype": _DTYPES[dtype]} if dtype else {}
        model, _ = load_model(path, backbone, **kwargs)
        _MODELS[key] = model if not device else model.to(device)
    return _MODELS[key]


def _int_arg(name: str, value: Any, low: int = 1) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        try:
            value = int(str(value))
        except ValueError:
            raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}") from None
        if value < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class Hippo(lmms):
    """lmms-eval's model interface on a hippo pipeline (see the module's doc for the args)."""

    is_simple = True

    def __init__(
        self,
        target: str | None = None,
        draft: str | None = None,
        scheduler: str | None = None,
        keep_ratio: float | None = None,
        gamma: int | str | None = None,
        scorer: str | None = None,
        selector: str | None = None,
        backbone: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        config: str | None = None,
        frames: int | None = None,
        fps: float | None = None,
        max_num_frames: int = MAX_NUM_FRAMES,
        max_pixels: int | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ConfigError(
                f"the hippo model does not take {', '.join(sorted(unknown))}; its model args are "
                f"{', '.join(PIPELINE_ARGS)}, frames, fps, max_num_frames, max_pixels"
            )
        self.frames = _int_arg("frames", frames)
        self.max_num_frames = _int_arg("max_num_frames", max_num_frames)
        self.max_pixels = _int_arg("max_pixels", max_pixels)
        if fps is not None and (
            isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps < math.inf
        ):
            raise ConfigError(f"fps must be a number > 0, got {fps!r}")
        if self.frames is not None and fps is not None:
            raise ConfigError("give frames or fps, not both")
        self.fps = None if fps is None else float(fps)
        self._batch_size = _int_arg("batch_size", batch_size)
        options = dict(target=target, draft=draft, scheduler=scheduler, keep_ratio=keep_ratio)
        options.update(gamma=gamma, scorer=scorer, selector=selector, backbone=backbone)
        options.update(device=device, dtype=dtype, config=config)
        self.pipe, self.tokenizer, self.settings = self._build(options)
        self.warm = False

    # ---- the pipeline ------------------------------------------------------------------------
    def _build(self, options: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
        """The pipeline, the tokenizer and the settings, with `hippo generate`'s checks and defaults."""
        from hippo.builder import PipelineBuilder
        from hippo.cli.demo import DEFAULT_KEEP_RATIO
        from hippo.cli.video_commands import pipeline_config, prepare
        from hippo.media.inputs import load_tokenizer
        from hippo.registry import lookup

        args = argparse.Namespace(**options, frames=None, fps=None, max_pixels=None)
        if isinstance(args.gamma, float) and args.gamma.is_integer():
            args.gamma = int(args.gamma)
        if args.scorer is not None and not isinstance(args.scorer, str):
            raise ConfigError(f"scorer must be a name, got {args.scorer!r}")
        from_config = bool(args.config) and bool(
            pipeline_config(argparse.Namespace(config=args.config)).target
        )
        shipped = args.target is None and not from_config
        if shipped:
            if args.draft is not None:
                raise ConfigError("draft= needs target= too (without both, the shipped narration pair runs)")
            if args.keep_ratio is None:
                args.keep_ratio = DEFAULT_KEEP_RATIO  # as `hippo demo` runs the pair
        cfg = pipeline_config(args)
        builder = PipelineBuilder.from_config(cfg)  # names and options are validated here
        needs_draft = lookup("schedulers", cfg.scheduler.name).needs_draft
        if shipped:
            from hippo.builder import _DTYPES

            target, draft, directory = shipped_pair(_DTYPES[cfg.dtype] if cfg.dtype else torch.float32)
            tokenizer = load_tokenizer(directory / "target")
            builder.target(target, backbone="qwen2_5_vl")
            if needs_draft:
                builder.draft(draft, backbone="qwen2_5_vl")
            where = {
                "target": f"{directory / 'target'} (shipped, widened)",
                "draft": str(directory / "draft"),
            }
        else:
            ready = prepare(args, cfg, needs_draft)  # checkpoints, backbone, tokenizers: before loading
            tokenizer = ready["tokenizer"]
            backbone = ready["backbone"].name
            builder.target(_load(cfg.target, backbone, cfg.dtype, cfg.device), backbone=backbone)
            if needs_draft:
                builder.draft(_load(cfg.draft, backbone, cfg.dtype, cfg.device), backbone=backbone)
            where = {"target": cfg.target, "draft": cfg.draft}
        pipe = builder.build()
        settings = {
            **where,
            "draft": where["draft"] if needs_draft else None,
            "scheduler": cfg.scheduler.name,
            "scheduler_options": dict(cfg.scheduler.options),
            "selector": cfg.selector.name,
            "selector_options": dict(cfg.selector.options),
        }
        return pipe, tokenizer, settings

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return next(self.pipe.target.parameters()).device

    # ---- requests ----------------------------------------------------------------------------
    def _video(self, visuals: Any, where: str) -> tuple[str, dict[str, Any]]:
        """The request's video file and its sampling options."""
        if isinstance(visuals, str | dict):
            visuals = [visuals]
        videos = [v for v in (visuals or []) if isinstance(v, str | dict)]
        if len(videos) != 1 or len(videos) != len(visuals or []):
            kinds = ", ".join(type(v).__name__ for v in (visuals or [])) or "none"
            raise UnsupportedError(
                f"{where}: the hippo model answers about exactly one video (a file path, or a dict with "
                f"'video'), got {kinds}; image and text-only tasks are not supported"
            )
        video = videos[0]
        opts: dict[str, Any] = {}
        if isinstance(video, dict):
            if not isinstance(video.get("video"), str):
                raise InputError(f"{where}: a video dict needs 'video': a file path, got {video!r}")
            given = {
                "frames": video.get("nframes"),
                "fps": video.get("fps"),
                "max_pixels": video.get("max_pixels"),
            }
            opts = {k: v for k, v in given.items() if v is not None}
            video = video["video"]
        if "frames" not in opts and "fps" not in opts:
            if self.frames is not None:
                opts["frames"] = self.frames
            elif self.fps is not None:
                opts["fps"] = self.fps
            else:
                opts["frames"] = self._capped_frames(video)
        if "max_pixels" not in opts and self.max_pixels is not None:
            opts["max_pixels"] = self.max_pixels
        return video, opts

    def _capped_frames(self, path: str) -> int:
        """2 frames a second (hippo's default), at most `max_num_frames` evenly spaced."""
        from hippo.media.inputs import native_stderr_silenced
        from hippo.media.video import open_sampled

        with native_stderr_silenced():
            _, idx, _ = open_sampled(path, None, None)
        return min(len(idx), self.max_num_frames)

    def _generation(self, gen_kwargs: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
        """lmms-eval's generation kwargs mapped as its Qwen2.5-VL model maps them: (settings, until)."""
        eos = self.tokenizer.eos_token_id
        until = gen_kwargs.get("until", [self.tokenizer.decode(eos)] if eos is not None else [])
        if isinstance(until, str):
            until = [until]
        elif until is None:
            until = []
        elif not isinstance(until, list):
            raise InputError(f"{where}: 'until' must be a string or a list, got {type(until).__name__}")
        until = [u for u in until if u != "\n\n"]  # as lmms-eval's Qwen2.5-VL: no cut at blank lines
        if int(gen_kwargs.get("num_beams") or 1) > 1:
            raise UnsupportedError(
                f"{where}: num_beams={gen_kwargs['num_beams']}: beam search is not speculative decoding's "
                "output; set num_beams=1"
            )
        gen: dict[str, Any] = {"max_new_tokens": int(gen_kwargs.get("max_new_tokens") or MAX_NEW_TOKENS)}
        temperature = float(gen_kwargs.get("temperature") or 0.0)
        if temperature > 0:
            gen.update(do_sample=True, temperature=temperature)
            if gen_kwargs.get("top_p") is not None:
                gen["top_p"] = float(gen_kwargs["top_p"])
        else:
            gen["do_sample"] = False
        return gen, until

    def _cap(self, gen: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
        """`max_new_tokens` within the target's context (lmms-eval's default of 32768 is a "no limit")."""
        room = self.pipe.target_adapter.context_length() - int(inputs["input_ids"].shape[-1])
        return {**gen, "max_new_tokens": max(1, min(gen["max_new_tokens"], room))}

    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        if not requests:
            return []
        prepared = []
        for req in requests:
            context, gen_kwargs, doc_to_visual, doc_id, task, split = req.args
            where = f"{task} document {doc_id}"
            video, opts = self._video(doc_to_visual(self.task_dict[task][split][doc_id]), where)
            gen, until = self._generation(dict(gen_kwargs), where)
            prepared.append((where, video, context, opts, gen, until))
        first = self._record(0, prepared[0])
        if not self.warm:  # one untimed token: the process's one-off costs are paid before the clock
            self.pipe.generate(first.inputs, max_new_tokens=1, do_sample=False)
            self.warm = True

        def records() -> Any:  # built as Pipeline.map reads ahead, not all videos at once
            yield first
            for i in range(1, len(prepared)):
                yield self._record(i, prepared[i])

        answers: dict[int, Any] = {}
        desc = f"hippo [{self.settings['scheduler']}]"
        bar = tqdm(total=len(prepared), desc=desc, disable=self.rank != 0)
        t0 = time.perf_counter()
        try:
            for result in self.pipe.map(records(), tokenizer=self.tokenizer, batch_size=self.batch_size):
                if result.error is not None:
                    raise InputError(f"{prepared[result.id][0]}: {result.error}")
                answers[result.id] = result
                bar.update(1)
        finally:
            bar.close()
        seconds = time.perf_counter() - t0
        out = [self._answer(answers[i], p[4], p[5]) for i, p in enumerate(prepared)]
        self._log_totals([answers[i] for i in range(len(prepared))], seconds)
        return out

    def _record(self, i: int, request: tuple) -> Any:
        """The i-th request's Record: its inputs built (video decoded, prompt templated) and settings."""
        from hippo.records import Record

        where, video, context, opts, gen, _ = request
        try:
            inputs = self.pipe.video_inputs(video, context, tokenizer=self.tokenizer, **opts)
        except HippoError as exc:
            raise type(exc)(f"{where}: {exc}") from None
        return Record(i, inputs=inputs, generation=self._cap(gen, inputs))

    def _answer(self, result: Any, gen: dict[str, Any], until: list[str]) -> GenerationResult:
        text = self.tokenizer.decode(
            result.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        for term in until:
            if term:
                text = text.split(term)[0]
        s = result.stats
        counts = SpeedCounts(
            input_tokens=result.prompt_tokens,
            output_tokens=len(result.token_ids),
            new_tokens=s.new_tokens,
            mat=s.mat,
            tokens_per_second=s.tokens_per_second,
            ttft_s=s.seconds_ttft,
            seconds=s.seconds_total,
            scheduler=s.scheduler,
            do_sample=bool(gen.get("do_sample")),
        )
        return GenerationResult(text=text, token_counts=counts)

    def _log_totals(self, results: list[Any], seconds: float) -> None:
        """The run's aggregate line: lmms-eval's throughput log (its `results["throughput"]`)."""
        stats = [r.stats for r in results]
        tokens = sum(s.new_tokens for s in stats)
        rounds = sum(len(s.emitted_per_round) for s in stats)
        mat = sum(sum(s.emitted_per_round) for s in stats) / rounds if rounds else 1.0
        log_metrics(
            total_elapsed_time=seconds,
            total_gen_tokens=tokens,
            avg_speed=tokens / seconds if seconds > 0 else 0.0,
            additional_metrics={
                "total_requests": len(stats),
                "mat": mat,
                "ttft_s": sum(s.seconds_ttft for s in stats) / len(stats),
                "scheduler": self.settings["scheduler"],
            },
        )

    # ---- what hippo does not do --------------------------------------------------------------
    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise UnsupportedError(
            "the hippo model generates answers; tasks scored by log-likelihood (multiple-choice by "
            "likelihood) are not supported: speculative decoding does not change the target's "
            "likelihoods, so evaluate those with the target alone (e.g. --model qwen2_5_vl)"
        )

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise UnsupportedError(
            "the hippo model does not run lmms-eval's multi-round tasks; use single-turn generate_until tasks"
        )
