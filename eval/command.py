"""`hippo eval`: lmms-eval on a hippo pipeline, added to `hippo` through the `hippo.commands` entry points.

    hippo eval --tasks hippo_narrate --limit 8 --baseline          # the shipped pair, no downloads
    hippo eval --tasks videomme --target /models/7B --draft /models/0.5B --baseline --output results/

The hippo flags become the `hippo` model's args (`hippo.eval.model`); the bundled tasks' folder is
added to lmms-eval's `--include_path`; every other argument goes to lmms-eval's own command line as
given (`--batch_size`, `--gen_kwargs`, `--seed`, `--verbosity`, ...). `--baseline` runs the same
tasks again in the same process with the target alone (scheduler autoregressive, the target already
loaded) and reports both metrics, whether every answer is identical, the end-to-end speedup (the
time to answer every request, video decoding included, of the target alone over hippo's) and hippo's
MAT. `--output DIR` keeps lmms-eval's results and logged samples (each answer's speed in its
`token_counts`) in DIR (the baseline's in DIR/baseline) and writes DIR/hippo_eval.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXIT_MISMATCH = 1  # a greedy answer of hippo differs from the target alone's
#: lmms-eval arguments `hippo eval` sets itself, with the flag to use instead
OWN = {
    "--model": "the model is hippo; choose its models with --target/--draft",
    "--model_args": "give the hippo flags (--target, --draft, --scheduler, ...) instead",
    "--output_path": "use --output DIR",
}
#: the flags that become model args: (flag's dest, model arg)
MODEL_FLAGS = (
    ("target", "target"),
    ("draft", "draft"),
    ("scheduler", "scheduler"),
    ("keep_ratio", "keep_ratio"),
    ("gamma", "gamma"),
    ("scorer", "scorer"),
    ("selector", "selector"),
    ("backbone", "backbone"),
    ("device", "device"),
    ("dtype", "dtype"),
    ("config", "config"),
    ("frames", "frames"),
    ("fps", "fps"),
    ("max_num_frames", "max_num_frames"),
    ("max_pixels", "max_pixels"),
)
#: what the target-alone run keeps of them (it drafts nothing)
BASELINE_KEEPS = ("target", "backbone", "device", "dtype", "config", "frames", "fps", "max_num_frames")
BASELINE_KEEPS += ("max_pixels",)


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    from hippo.cli.main import _int_or_auto

    e = sub.add_parser(
        "eval",
        parents=parents,
        help="accuracy and speed on lmms-eval's benchmarks (videomme, mlvu, lvbench, ...; pip install 'hippo[eval]')",
        description=(
            "Run lmms-eval with the hippo model (hippo.eval.model): every request's video and question through "
            "the pipeline, each answer's speed (new tokens, MAT, tokens/s, TTFT) in the logged samples. "
            "The bundled offline task hippo_narrate (the narration pair's held-out clips, rendered locally) "
            "runs anywhere; without --target the narration pair that ships with hippo answers. --baseline "
            "runs the target alone too and compares: metrics, identical answers, end-to-end speedup, MAT. "
            "Every argument not listed here goes to lmms-eval (python -m lmms_eval --help), e.g. "
            "--batch_size N (greedy requests continuously batched), --gen_kwargs, --seed, --verbosity. "
            "Needs pip install 'hippo[eval]'; see docs/eval.md."
        ),
        epilog=(
            "Exit status: 0; 1 when --baseline finds a greedy answer that differs from the target alone's; "
            "2 on bad input (one line 'hippo: error: ...'). lmms-eval's own --config and --baseline are not "
            "available here (hippo's --config is the pipeline's; use python -m lmms_eval --model hippo for them)."
        ),
    )
    e.add_argument("--tasks", required=True, metavar="TASKS", help="lmms-eval task names, comma-separated")
    m = e.add_argument_group("model (the hippo model's args)")
    m.add_argument("--target", metavar="PATH", help="target checkpoint (default: the shipped narration pair)")
    m.add_argument("--draft", metavar="PATH", help="draft checkpoint (with --target)")
    m.add_argument(
        "--scheduler", metavar="NAME", help="auto (default), hippo, pearl, serial, autoregressive, ..."
    )
    m.add_argument("--keep-ratio", type=float, metavar="R", help="fraction of visual tokens the draft sees")
    m.add_argument(
        "--gamma", type=_int_or_auto, metavar="N", help="draft length γ, or 'auto' (serial, pearl, hippo)"
    )
    m.add_argument("--scorer", metavar="NAME", help="visual-token scorer (default: holistic)")
    m.add_argument("--selector", metavar="NAME", help="which tokens the draft keeps (default: topk)")
    m.add_argument("--backbone", metavar="NAME", help="adapter (default: detected from config.json)")
    m.add_argument(
        "--device", metavar="DEVICE", help="cpu, cuda, cuda:1, ... (default: where the weights load)"
    )
    m.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float64"), help="weights dtype")
    m.add_argument("--config", metavar="FILE", help="builder config file (JSON or TOML); flags override it")
    v = e.add_argument_group(
        "video sampling (default: 2 frames a second, at most 32; a task may set its own)"
    )
    n = v.add_mutually_exclusive_group()
    n.add_argument("--frames", type=int, metavar="N", help="N evenly spaced frames per video")
    n.add_argument("--fps", type=float, metavar="F", help="F frames per second of video")
    v.add_argument(
        "--max-num-frames", type=int, metavar="N", help="at most N frames at the default rate (32)"
    )
    v.add_argument("--max-pixels", type=int, metavar="N", help="at most N pixels per frame")
    r = e.add_argument_group("run")
    r.add_argument(
        "--limit", type=float, metavar="N", help="the first N documents of each task (lmms-eval's --limit)"
    )
    r.add_argument(
        "--output",
        metavar="DIR",
        help="keep lmms-eval's results and logged samples in DIR (the baseline's in DIR/baseline); write DIR/hippo_eval.json",
    )
    r.add_argument(
        "--baseline",
        action="store_true",
        help="also run the target alone (scheduler autoregressive) in this process and compare",
    )
    e.set_defaults(func=run, pass_through=True)


def model_args(values: dict[str, Any]) -> str:
    """lmms-eval's `k=v,...` string of the given values."""
    from hippo.errors import ConfigError

    parts = []
    for key, value in values.items():
        if value is None:
            continue
        text = str(value)
        if "," in text or "=" in text:
            raise ConfigError(
                f"--{key.replace('_', '-')} {text!r}: lmms-eval's model args cannot hold ',' or '='"
            )
        parts.append(f"{key}={text}")
    return ",".join(parts)


def _lmms_args(argv: list[str]) -> argparse.Namespace:
    """lmms-eval's own parser on `argv` (it reads sys.argv)."""
    from lmms_eval.__main__ import parse_eval_args

    saved = sys.argv
    sys.argv = ["lmms-eval", *argv]
    try:
        return parse_eval_args()[1]
    finally:
        sys.argv = saved


@contextlib.contextmanager
def _output(directory: str | None) -> Iterator[Path]:
    if directory is not None:
        p = Path(directory)
        p.mkdir(parents=True, exist_ok=True)
        yield p
        return
    with tempfile.TemporaryDirectory(prefix="hippo-eval-") as tmp:  # lmms-eval logs samples only to files
        yield Path(tmp)


def _evaluate(largs: argparse.Namespace) -> tuple[dict, dict]:
    from lmms_eval.__main__ import cli_evaluate_single

    from hippo.errors import HippoError

    try:
        results, samples = cli_evaluate_single(largs)
    except HippoError:
        raise
    except ValueError as exc:  # lmms-eval's usage errors (unknown task, bad --limit, ...)
        raise HippoError(f"lmms-eval: {exc}") from None
    if results is None:
        raise HippoError("lmms-eval returned no results (not the main process?)")
    return results, samples or {}


def metrics(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}}: every numeric metric of lmms-eval's results, stderrs left out."""
    out: dict[str, dict[str, float]] = {}
    for task, row in results.get("results", {}).items():
        for key, value in row.items():
            name = key.split(",")[0]
            if name.endswith("_stderr") or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if key == "samples" or name == "alias":
                continue
            out.setdefault(task, {})[name] = value
    return out


def answers(samples: dict) -> dict[tuple[str, Any], Any]:
    """{(task, doc_id): the raw and filtered answers} of logged samples."""
    return {
        (task, s["doc_id"]): (s.get("resps"), s.get("filtered_resps"))
        for task, rows in samples.items()
        for s in rows
    }


def sampled(samples: dict) -> bool:
    """Whether any answer was sampled (its token_counts say so)."""
    return any(
        isinstance(c, dict) and c.get("do_sample")
        for rows in samples.values()
        for s in rows
        for c in s.get("token_counts") or []
    )


def compare(hippo: tuple[dict, dict], baseline: tuple[dict, dict] | None) -> dict[str, Any]:
    """The report: both runs' metrics, identical answers, the speedup and MAT (hippo_eval.json's shape)."""
    (h_results, h_samples) = hippo
    h_metrics, h_speed = metrics(h_results), h_results.get("throughput", {})
    first = next(((t, m) for t, ms in h_metrics.items() for m in ms), None)
    report: dict[str, Any] = {
        "metric": {"hippo": h_metrics[first[0]][first[1]] if first else None, "baseline": None},
        "metric_name": f"{first[0]}/{first[1]}" if first else None,
        "identical": None,
        "speedup": None,
        "mat": h_speed.get("avg_mat"),
        "samples": len(answers(h_samples)),
        "metrics": {"hippo": h_metrics, "baseline": None},
        "seconds": {"hippo": h_speed.get("total_elapsed_time"), "baseline": None},
        "new_tokens": {"hippo": h_speed.get("total_gen_tokens"), "baseline": None},
        "differing": [],
        "sampled": sampled(h_samples),
    }
    if baseline is None:
        return report
    b_results, b_samples = baseline
    b_metrics, b_speed = metrics(b_results), b_results.get("throughput", {})
    ours, theirs = answers(h_samples), answers(b_samples)
    differing = sorted({k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)}, key=str)
    h_s, b_s = h_speed.get("total_elapsed_time"), b_speed.get("total_elapsed_time")
    report.update(
        identical=not differing,
        speedup=b_s / h_s if h_s and b_s else None,
        differing=[f"{task}/{doc}" for task, doc in differing],
    )
    report["metric"]["baseline"] = b_metrics[first[0]][first[1]] if first else None
    report["metrics"]["baseline"] = b_metrics
    report["seconds"]["baseline"] = b_s
    report["new_tokens"]["baseline"] = b_speed.get("total_gen_tokens")
    return report


def format_report(report: dict[str, Any]) -> str:
    h_m, b_m = report["metrics"]["hippo"], report["metrics"]["baseline"]
    lines = [f"{'':<28} {'hippo':>10} {'target alone':>13}"]
    for task, values in h_m.items():
        for name, value in values.items():
            other = "-" if b_m is None else f"{b_m.get(task, {}).get(name, float('nan')):.4f}"
            lines.append(f"{task + '/' + name:<28} {value:>10.4f} {other:>13}")
    secs, toks = report["seconds"], report["new_tokens"]
    for run in ("hippo", "baseline"):
        if secs[run]:
            name = "hippo" if run == "hippo" else "target alone"
            lines.append(
                f"{name}: {toks[run]} new tokens in {secs[run]:.2f} s ({toks[run] / secs[run]:.1f} tok/s)"
                + (f", MAT {report['mat']:.2f}" if run == "hippo" and report["mat"] is not None else "")
            )
    if report["identical"] is not None:
        n = report["samples"]
        if report["identical"]:
            same = f"yes, all {n}"
        elif report["sampled"]:
            same = f"no, {len(report['differing'])} of {n} (expected when sampling: the same law, not the same draws)"
        else:
            same = f"NO, {len(report['differing'])} of {n} differ: {', '.join(report['differing'][:8])}"
        equal = report["metrics"]["hippo"] == report["metrics"]["baseline"]
        speed = "-" if report["speedup"] is None else f"{report['speedup']:.2f}x"
        lines.append(
            f"answers identical to the target alone's: {same} | metrics equal: {'yes' if equal else 'no'} | "
            f"end-to-end speedup {speed}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from hippo.errors import ConfigError, HippoError

    _check_pipeline(args)
    try:
        import lmms_eval  # noqa: F401
    except ImportError as exc:
        raise HippoError(f"hippo eval needs lmms-eval: pip install 'hippo[eval]' ({exc})") from None
    rest = list(getattr(args, "rest", None) or [])
    for arg in rest:
        flag = arg.split("=", 1)[0]
        if flag in OWN:
            raise ConfigError(f"{flag} is set by hippo eval: {OWN[flag]}")
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit must be > 0, got {args.limit:g}")
    if args.draft is not None and args.target is None:
        raise ConfigError("--draft needs --target (without both, the shipped narration pair answers)")
    values = {arg: getattr(args, dest) for dest, arg in MODEL_FLAGS}
    argv = ["--model", "hippo", "--tasks", args.tasks, *rest]
    if args.limit is not None:
        argv += ["--limit", f"{args.limit:g}"]
    from lmms_eval.models.model_utils.gen_metrics import reset_logged_metrics

    from hippo.cli.video_commands import quiet_transformers
    from hippo.eval import TASKS

    with _output(args.output) as out, quiet_transformers(args.debug, progress=False):
        largs = _lmms_args([*argv, "--model_args", model_args(values)])
        _configure_logging(largs.verbosity)
        largs.include_path = [largs.include_path, str(TASKS)] if largs.include_path else str(TASKS)
        largs.output_path, largs.log_samples = str(out), True
        hippo = _evaluate(largs)
        _print_table(hippo[0], "hippo")
        baseline = None
        if args.baseline:
            kept = {k: v for k, v in values.items() if k in BASELINE_KEEPS}
            base = argparse.Namespace(**vars(largs))
            base.model_args = model_args({**kept, "scheduler": "autoregressive"})
            base.output_path = str(out / "baseline")
            reset_logged_metrics()
            baseline = _evaluate(base)
            _print_table(baseline[0], "target alone (scheduler autoregressive)")
        report = compare(hippo, baseline)
        print(format_report(report), flush=True)
        if args.output is not None:
            path = out / "hippo_eval.json"
            path.write_text(json.dumps(report, indent=2) + "\n")
            print(f"report: {path}")
    if report["identical"] is False and not report["sampled"]:
        return EXIT_MISMATCH
    return 0


def _check_pipeline(args: argparse.Namespace) -> None:
    """The pipeline's names and options (and --config) checked now, before lmms-eval loads its tasks."""
    from hippo.builder import PipelineBuilder
    from hippo.cli.video_commands import pipeline_config

    keys = ("target", "draft", "scheduler", "keep_ratio", "gamma", "scorer", "selector", "backbone")
    keys += ("device", "dtype", "config")
    PipelineBuilder.from_config(pipeline_config(argparse.Namespace(**{k: getattr(args, k) for k in keys})))


def _print_table(results: dict, title: str) -> None:
    from lmms_eval.utils import make_table

    print(f"\n{title}:\n{make_table(results)}", flush=True)


def _configure_logging(verbosity: str) -> None:
    """lmms-eval's log on stderr at its --verbosity (stdout keeps the tables and the report)."""
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level=verbosity, format="{time:HH:mm:ss} | {level: <7} | {message}")
