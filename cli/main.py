"""The `hippo` command: `generate`, `chat`, `batch`, `bias`, `bench`, `eval`, `demo`, `plugins` and `check`.

Every HippoError that reaches `main`, and every usage error, becomes one line, `hippo: error:
<message>`, on stderr and exit status 2; `--debug` prints the traceback as well. `hippo demo` (and
`hippo generate --compare-ar` on a greedy output) exits 1 when an output differs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import hippo
from hippo.errors import HippoError, one_line
from hippo.plugins.auto_scheduler import KEEP_RATIOS

#: what --keep-ratio's help says `--scheduler auto` chooses among
AUTO_KEEP = f"under --scheduler auto, each question's is chosen among it and {', '.join(f'{r:g}' for r in KEEP_RATIOS)}"

EXIT_MISMATCH = 1
EXIT_ERROR = 2
#: entry-point group of the commands other packages add (`hippo bench`)
COMMANDS = "hippo.commands"


def _cmd_plugins(args: argparse.Namespace) -> int:
    from hippo.registry import autoload_disabled, inventory

    inv = inventory()
    autoload = not autoload_disabled()
    if args.json:
        print(json.dumps({"autoload": autoload, "plugins": inv}, indent=2))
        return 0
    for kind, entries in inv.items():
        print(f"{kind}:")
        if not entries:
            print("  (none)")
        width = max((len(e["name"]) for e in entries), default=0)
        src_width = max((len(e["source"]) for e in entries), default=0)
        for e in entries:
            print(f"  {e['name']:<{width}}  {e['source']:<{src_width}}  {e['class']}")
    if not autoload:
        print("\nthird-party plugins are not loaded: HIPPO_DISABLE_PLUGIN_AUTOLOAD is set")
    return 0


def _int_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The command `module.name(args) -> int`, imported when it runs (so `hippo --help` stays fast)."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), name)(args)

    return run


def _no_progress(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--no-progress", action="store_true", help="no progress bars (they only show on a terminal)"
    )


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.adapter is not None:
        return _cmd_demo_tiny(args)
    if args.frames is not None or args.size is not None:
        raise HippoError("--frames and --size apply to the random tiny pairs (--adapter NAME) only")
    from hippo.cli.demo import (
        DEFAULT_GAMMA,
        DEFAULT_KEEP_RATIO,
        DEFAULT_SCHEDULER,
        MAX_NEW_TOKENS,
        format_comparison,
        run_demo,
    )
    from hippo.cli.video_commands import check_output, quiet_transformers, text_streamer

    check_output(None if args.json == "-" else args.json, "--json")
    check_output(args.timeline, "--timeline")
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json == "-" else print
    with quiet_transformers(args.debug, progress=False):
        result = run_demo(
            seed=args.seed,
            question=args.question,
            max_new_tokens=_given(args.max_new_tokens, MAX_NEW_TOKENS),
            # --gamma fixes γ on the serial schedule; without it the planner chooses (scheduler auto)
            scheduler=DEFAULT_SCHEDULER if args.gamma is None else "serial",
            gamma=_given(args.gamma, DEFAULT_GAMMA),
            keep_ratio=_given(args.keep_ratio, DEFAULT_KEEP_RATIO),
            streamer_factory=None if args.json == "-" else text_streamer,
            timeline=args.timeline,
            compile_target=args.compile,
            log=log,
        )
    _print_result(args.json, result, format_comparison)
    return 0 if result["identical"] else EXIT_MISMATCH


def _tiny_gamma(gamma: int | str | None) -> int:
    if gamma == "auto":
        raise HippoError("--gamma auto needs the trained pair; give an integer with --adapter")
    return _given(gamma, 5)


def _cmd_demo_tiny(args: argparse.Namespace) -> int:
    from hippo.cli.demo_tiny import format_result, run_demo

    if args.timeline:
        raise HippoError("--timeline draws the trained pair's run; leave out --adapter to use it")
    if args.compile:
        raise HippoError("--compile runs on the trained pair; leave out --adapter to use it")

    result = run_demo(
        frames=_given(args.frames, 8),
        size=args.size,
        max_new_tokens=_given(args.max_new_tokens, 64),
        gamma=_tiny_gamma(args.gamma),
        keep_ratio=_given(args.keep_ratio, 0.2),
        seed=args.seed,
        adapter=args.adapter,
    )
    _print_result(args.json, result, format_result)
    return 0 if result["all_identical"] else EXIT_MISMATCH


def _print_result(json_path: str | None, result: dict, text: Any) -> None:
    """A demo's result: JSON on stdout for `--json -`, else the text report (and JSON to a file)."""
    from hippo.cli.video_commands import write_json

    if json_path == "-":
        print(json.dumps(result, indent=2))
        return
    print(text(result))
    if json_path:
        write_json(json_path, result)


def _cmd_check(args: argparse.Namespace) -> int:
    # the logic is hippo.testing.plugin_check; this is the glue (it needs hippo[testing])
    from hippo.testing._deps import require_hypothesis

    require_hypothesis()
    from hippo.testing.plugin_check import check_plugin

    result = check_plugin(
        args.name,
        args.kind,
        examples=args.examples,
        seed=args.seed,
        sampling=args.sampling,
        adapters=args.adapter,
        shrink=not args.no_shrink,
        laws=args.law,
    )
    print(result.text())
    return EXIT_MISMATCH if result.status else 0


def _check_parser(sub: Any, debug: argparse.ArgumentParser) -> None:
    c = sub.add_parser(
        "check",
        parents=[debug],
        help="prove an installed scorer, selector, drafter, verifier, scheduler or executor lossless",
        description=(
            "Run hippo.testing's lossless harness on the part registered as NAME, combined with the built-in "
            "parts it needs, on hypothesis-drawn tiny float64 target/draft pairs, videos, prompts, γ, keep "
            "ratios, corrupted draft tokens and executor timings; compare with target.generate token for token "
            "(and with --sampling, the sampled law with the target's exact law). Exit 0: lossless on every "
            "case; 1: a counterexample (its report is printed); 2: bad usage, unknown name, or a part that "
            "cannot be built with its defaults. Needs pip install 'hippo[testing]'."
        ),
    )
    c.add_argument("name", metavar="NAME", help="the part's registered name (see `hippo plugins`)")
    c.add_argument(
        "--kind",
        choices=("scheduler", "selector", "scorer", "drafter", "verifier", "executor", "adapter"),
        help="the part's kind, when NAME is registered under several",
    )
    c.add_argument("--examples", type=int, default=20, help="hypothesis examples (default: %(default)s)")
    c.add_argument("--seed", type=int, default=0, help="hypothesis seed (default: %(default)s)")
    c.add_argument(
        "--sampling",
        action="store_true",
        help="also run the sampling law test (about 2000 seeded runs: it detects any law at total variation "
        "0.05 from the target's with probability >= 0.95)",
    )
    c.add_argument(
        "--law",
        action="append",
        metavar="CONFIG",
        help="with --sampling, run the law on this configuration of the part's plan only: 'default', "
        "'conversation turn 2' or 'token trees' (repeatable; default: every one the part takes part in)",
    )
    c.add_argument(
        "--no-shrink",
        action="store_true",
        help="report the first counterexample found, not the smallest (faster)",
    )
    c.add_argument(
        "--adapter", action="append", help="draw tiny pairs of this adapter only (repeatable; default: all)"
    )
    c.set_defaults(func=_cmd_check)


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line like every other hippo error."""

    def error(self, message: str):
        self.exit(EXIT_ERROR, f"hippo: error: {message}; see '{self.prog} --help'\n")


def _video_args(p: argparse.ArgumentParser, prompt: bool = True, video: bool = True) -> None:
    g = p.add_argument_group("video")
    if video:
        g.add_argument(
            "--video",
            required=True,
            metavar="FILE",
            help="the video file (anything decord reads: mp4, mkv, ...)",
        )
    if prompt and video:
        g.add_argument(
            "--prompt", required=True, metavar="TEXT", help="the question or instruction about the video"
        )
    n = g.add_mutually_exclusive_group()
    n.add_argument(
        "--frames", type=int, metavar="N", help="sample N evenly spaced frames (default: 2 per second)"
    )
    n.add_argument("--fps", type=float, metavar="F", help="sample F frames per second of video (default: 2)")
    g.add_argument(
        "--max-pixels",
        type=int,
        metavar="N",
        help="resize frames to at most N pixels each, sides multiples of 28 (Qwen2.5-VL) or 32 (Qwen3-VL); "
        "LLaVA-OneVision always uses its vision tower's square size (default: the checkpoint processor's)",
    )


def _model_args(p: argparse.ArgumentParser, target_required: bool = False) -> argparse._ArgumentGroup:
    g = p.add_argument_group("model")
    g.add_argument(
        "--target",
        required=target_required,
        metavar="PATH",
        help="target checkpoint directory (config.json, weights, tokenizer)",
    )
    g.add_argument(
        "--backbone",
        metavar="NAME",
        help="adapter: auto (detect from config.json, the default), qwen2_5_vl, qwen3_vl, llava_onevision, "
        "video_salmonn2_plus, or any registered adapter (see 'hippo plugins')",
    )
    g.add_argument(
        "--device", metavar="DEVICE", help="cpu, cuda, cuda:1, ... (default: where the weights load)"
    )
    g.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32", "float64"),
        help="weights dtype (default: the checkpoint's)",
    )
    return g


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hippo",
        description=(
            "HIPPO: lossless speculative decoding for video-LLMs. A small draft model q proposes γ tokens "
            "from a pruned subset of the visual tokens; the target p verifies them, so the output is "
            "exactly the target's own."
        ),
        epilog=f"Errors print one line 'hippo: error: ...' and exit {EXIT_ERROR}; add --debug for the traceback.",
    )
    parser.add_argument("--version", action="version", version=f"hippo {hippo.__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    # the subcommands accept --debug too; SUPPRESS keeps them from overwriting the top-level value
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the full traceback of an error"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "plugins",
        parents=[debug],
        help="list the registered scorers, selectors, drafters, verifiers, schedulers and adapters",
        description=(
            "List every registered scorer, selector, drafter, verifier, scheduler and adapter with its "
            "source: 'built-in (hippo VERSION)' or the distribution and version that registered it "
            "through the 'hippo' entry-point group. Set HIPPO_DISABLE_PLUGIN_AUTOLOAD=1 to list "
            "the built-ins only."
        ),
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_plugins)

    d = sub.add_parser(
        "demo",
        parents=[debug],
        help="narrate a clip with the trained pair that ships with hippo: streamed, identical, and faster",
        description=(
            "Render a held-out clip of the narration task to a video file, answer --question about it with the "
            "trained Qwen2.5-VL pair that ships with hippo (through the same path as `hippo generate`: decord, "
            "the checkpoint's tokenizer and chat template), streaming the answer, then let the target alone "
            "(transformers' generate) answer the same inputs and compare: identical output, tokens/s, MAT, "
            "speedup. Exit status 1 if the outputs differ. --adapter NAME instead runs the random tiny "
            "target/draft pair of a backbone (a wiring check: random models' speedups mean nothing)."
        ),
    )
    d.add_argument(
        "--question",
        default="narrate the video .",
        help="what to ask; the pair was trained on 'narrate the video .', 'narrate the <colour> object .' and "
        "'where does the <shape> go ?' (default: %(default)r)",
    )
    d.add_argument("--seed", type=int, default=0, help="which held-out clip (default: %(default)s)")
    d.add_argument("--max-new-tokens", type=int, help="tokens to generate (default: 256; 64 with --adapter)")
    d.add_argument(
        "--gamma",
        type=_int_or_auto,
        help=(
            "draft length γ per round on the serial schedule, or 'auto' (from the cost model); without "
            "it the planner chooses the schedule and γ (5 with --adapter)"
        ),
    )
    d.add_argument(
        "--keep-ratio",
        type=float,
        help="fraction of the visual tokens the draft sees, in (0, 1] (default: 1.0, the fastest here; "
        f"0.2 with --adapter); {AUTO_KEEP}",
    )
    d.add_argument(
        "--json", metavar="FILE", help="also write the full result as JSON to FILE ('-': JSON on stdout only)"
    )
    d.add_argument(
        "--timeline",
        metavar="FILE.png",
        help="draw a Gantt chart of hippo's run: target and draft lanes, accepted/rejected drafts, idle time",
    )
    d.add_argument(
        "--compile",
        action="store_true",
        help="run the target on a static KV cache with an inductor-compiled step (PipelineBuilder.compile): "
        "faster verification, after about a minute of compiling (less once inductor's disk cache holds it)",
    )
    t = d.add_argument_group("random tiny pairs (a wiring check of a backbone; their speedups mean nothing)")
    t.add_argument(
        "--adapter",
        metavar="NAME",
        help="run the random tiny target/draft pair of this registered adapter (e.g. qwen3_vl) instead",
    )
    t.add_argument("--frames", type=int, help="video frames (default: 8)")
    t.add_argument(
        "--size",
        type=int,
        help="frame side in pixels, a multiple of the model's patch x merge size (default: the smallest >= 112)",
    )
    d.set_defaults(func=_cmd_demo)
    _generate_parser(sub, debug)
    _chat_parser(sub, debug)
    _batch_parser(sub, debug)
    _serve_parser(sub, debug)
    _bias_parser(sub, debug)
    _external_commands(sub, debug)
    _check_parser(sub, debug)
    return parser


def _external_commands(sub: Any, debug: argparse.ArgumentParser) -> None:
    """Commands other packages add through the `hippo.commands` entry-point group.

    Each entry point is a function `(subparsers, parents) -> None` that adds one subcommand whose
    `func(args) -> int` runs it (`hippo bench` is `hippo.benchmarks.command:add_parser`). A command
    that hands the arguments it does not know to another program sets `pass_through=True` among its
    defaults and finds them in `args.rest` (`hippo eval`, for lmms-eval); others reject them.
    """
    for ep in sorted(metadata.entry_points(group=COMMANDS), key=lambda ep: ep.name):
        try:
            ep.load()(sub, [debug])
        except Exception as exc:  # a broken command package must not break every other command
            message = f"the command {ep.name!r} ({ep.value}) failed to load: {exc!r}; reinstall its package"
            broken = sub.add_parser(ep.name, parents=[debug], help=f"(unavailable: {exc!r})"[:80])
            broken.add_argument("rest", nargs=argparse.REMAINDER)
            broken.set_defaults(func=lambda args, m=message: _fail(m))


def _fail(message: str) -> int:
    raise HippoError(message)


def _pipeline_args(
    g: argparse.ArgumentParser, prompt: bool = True, video: bool = True
) -> argparse._ArgumentGroup:
    """The options `generate`, `chat` and `batch` share: models, video, speculative decoding, decoding;
    returns the (empty) output group. `batch` reads the video and prompt from its records."""
    m = _model_args(g)
    m.add_argument(
        "--draft",
        metavar="PATH",
        help="draft checkpoint directory: a smaller model with the target's tokenizer",
    )
    m.add_argument(
        "--target-device-map",
        metavar="MAP",
        help="spread the target over several devices: auto, balanced, balanced_low_0, sequential "
        "(accelerate's device maps) or a JSON file of {module name: device}; not with --device",
    )
    m.add_argument(
        "--draft-device", metavar="DEVICE", help="the draft's own device, e.g. cuda:3 (default: --device)"
    )
    m.add_argument("--config", metavar="FILE", help="builder config file (JSON or TOML); flags override it")
    _video_args(g, prompt, video)
    s = g.add_argument_group("speculative decoding")
    s.add_argument(
        "--scheduler",
        metavar="NAME",
        help="auto (default: the schedule and γ from costs measured once per machine), hippo, pearl, serial, autoregressive, ...",
    )
    s.add_argument(
        "--scorer", metavar="NAME", help="visual-token scorer: holistic (default), attention, ..., none"
    )
    s.add_argument(
        "--selector", metavar="NAME", help="which tokens the draft keeps: topk (default), uniform, ..."
    )
    s.add_argument(
        "--keep-ratio",
        type=float,
        metavar="R",
        help=f"fraction of the visual tokens the draft sees, in (0, 1] (0.1); {AUTO_KEEP}",
    )
    s.add_argument(
        "--gamma",
        type=_int_or_auto,
        metavar="N",
        help="draft length γ per round, >= 1, or 'auto' (each round's γ from the cost model), for --scheduler serial, pearl or hippo",
    )
    d = g.add_argument_group("decoding")
    d.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="(default: %(default)s)")
    d.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    d.add_argument(
        "--temperature", type=float, metavar="T", help="sampling temperature > 0 (with --do-sample)"
    )
    d.add_argument(
        "--top-p", type=float, metavar="P", help="nucleus sampling mass in (0, 1] (with --do-sample)"
    )
    d.add_argument(
        "--top-k", type=int, metavar="K", help="sample among the K likeliest tokens (with --do-sample)"
    )
    d.add_argument("--seed", type=int, metavar="S", help="seed of the sampler, for reproducible samples")
    return g.add_argument_group("output")


def _generate_parser(sub: Any, debug: argparse.ArgumentParser) -> None:
    g = sub.add_parser(
        "generate",
        parents=[debug],
        help="answer a prompt about a video file with a target/draft checkpoint pair, losslessly",
        description=(
            "Read the video with decord, sample its frames, build the target's inputs with the checkpoint's "
            "tokenizer and chat template, and decode with speculative decoding: the draft q proposes γ tokens "
            "from --keep-ratio of the visual tokens (chosen by --scorer and --selector), the target p verifies "
            "them. The answer is exactly the target's own (greedy: identical tokens; sampling: the same "
            "distribution). The answer streams to stdout; progress bars (on a terminal), a one-line summary "
            "(new tokens, MAT, tokens/s, time to first token, pruning time) and the --compare-ar report go "
            "to stderr."
        ),
        epilog=(
            "--config FILE takes the builder's JSON/TOML config (PipelineConfig: target, draft, backbone, "
            "scorer, selector, drafter, verifier, scheduler, dtype, device, target_device_map, draft_device); flags given on the command line "
            "override it. Without --config the defaults are --scheduler auto --scorer holistic --selector "
            "topk --keep-ratio 0.1. Bad input (video, checkpoints, tokenizers, options, a prompt "
            "longer than the context) prints one line 'hippo: error: ...' and exits 2. Exit status 1: "
            "--compare-ar found a greedy output that differs."
        ),
    )
    o = _pipeline_args(g)
    o.add_argument(
        "--system",
        metavar="TEXT",
        help="a system message, rendered by the chat template as the system turn before the video and "
        "the prompt (as a served request's system message is)",
    )
    o.add_argument(
        "--compare-ar",
        action="store_true",
        help="also decode with the target alone (scheduler autoregressive) and report the speedup and "
        "whether the outputs are identical",
    )
    o.add_argument(
        "--json", metavar="FILE", help="write the answer, its token ids, all stats and settings as JSON"
    )
    o.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="say what the planner chose and why (--scheduler auto, --gamma auto): the schedule, the "
        "steps given to the target alone, and the predicted tokens/s of each option",
    )
    o.add_argument(
        "--timeline",
        metavar="FILE.png",
        help="draw a Gantt chart of the run (target and draft lanes: prefill, drafting, verification, idle)",
    )
    _no_progress(o)
    g.set_defaults(func=_lazy("hippo.cli.video_commands", "cmd_generate"))


def _chat_parser(sub: Any, debug: argparse.ArgumentParser) -> None:
    c = sub.add_parser(
        "chat",
        parents=[debug],
        help="ask many questions about one video: encoded once, every answer lossless",
        description=(
            "Read the video and prefill its shared prefix once (the vision encoder and the target's KV up to the "
            "end of the video), then answer questions about it with speculative decoding, each answer exactly "
            "the target's own on the whole conversation so far. Interactive: type a question and the answer "
            "streams; /stats shows the session's figures, /reset forgets the earlier turns (the video stays "
            "prepared), /quit (or end of input) leaves. With --questions FILE each line is answered on its "
            "own, with no history between them, and the session ends."
        ),
        epilog="Same model, video and decoding options as `hippo generate`; bad input exits 2 before any work.",
    )
    o = _pipeline_args(c, prompt=False)
    o.add_argument(
        "--questions",
        metavar="FILE",
        help="answer each line of FILE independently (no history between them), then exit",
    )
    o.add_argument("--json", metavar="FILE", help="write every answer's text, token ids and stats as JSON")
    _no_progress(o)
    c.set_defaults(func=_lazy("hippo.cli.chat", "cmd_chat"))


def _batch_parser(sub: Any, debug: argparse.ArgumentParser) -> None:
    b = sub.add_parser(
        "batch",
        parents=[debug],
        help="answer every record (id, video, prompt) of a JSONL file: resumable, one JSON line per answer",
        description=(
            "Answer each record of IN.jsonl, one JSON object per line: id (a string or an integer), video, "
            "prompt, and optionally frames, fps, max_pixels, max_new_tokens, do_sample, temperature, top_p, "
            "top_k, seed, which override the options below for that record. Each answer is exactly the "
            "target's own (as `hippo generate` gives it) and is appended to OUT.jsonl as one line "
            "{id, text, token_ids, prompt_tokens, stats} as soon as it is done (flushed and fsync'd). A "
            "record that cannot be answered (bad JSON, a missing field, a duplicate id, a missing or corrupt "
            "video, a prompt longer than the context) gets {id, line, error} with the message `hippo "
            "generate` prints, and the run goes on. Records are read --window ahead, sorted by prompt "
            "length (visual tokens included) and continuously batched: on the auto, serial or autoregressive "
            "schedule up to --batch-size greedy rows decode together (stacked caches, per-row rollback), a "
            "finished row's place taken by the next; other rows (sampled, or another schedule) one after another."
        ),
        epilog=(
            "Resuming: run the same command again; ids answered in OUT are skipped, so a killed run loses "
            "at most the rows in flight and answers none twice. Error lines are dropped from OUT and their "
            "records tried again, as is a last line cut short by the kill. With --ray, the driver (this "
            "process) still reads IN and writes OUT; every Ray node needs hippo installed and the "
            "checkpoints and videos at the same paths. Exit status: 0 all answered, 1 some records failed "
            "(see the summary line), 2 bad usage (missing IN, bad options or checkpoints; nothing decoded)."
        ),
    )
    b.add_argument("input", metavar="IN.jsonl", help="the records, one JSON object per line")
    b.add_argument("output", metavar="OUT.jsonl", help="the answers, appended; an existing OUT is resumed")
    o = _pipeline_args(b, video=False)
    o.add_argument("--no-progress", action="store_true", help="no progress bar (it only shows on a terminal)")
    g = b.add_argument_group("batching")
    g.add_argument(
        "--batch-size",
        type=int,
        default=4,
        metavar="N",
        help="greedy rows decoding together at most (default: %(default)s; on the auto, serial or autoregressive "
        "schedule, a finished row's place taken by the next; other rows one after another)",
    )
    g.add_argument(
        "--window",
        type=int,
        metavar="N",
        help="records read ahead and sorted by length; their inputs are held in memory (default: 4 x "
        "--batch-size); with --ray, the records each actor call takes",
    )
    r = _ray_group(
        b,
        "Ray (pip install 'hippo[ray]')",
        "actor",
        "run on Ray Data actors: alone, on a new local Ray instance; 'auto': the running cluster "
        "(RAY_ADDRESS, else the one `ray start` started here); or the cluster at ADDRESS (HOST:6379, "
        "ray://HOST:10001). Put it after IN and OUT, or write --ray=ADDRESS",
    )
    r.add_argument(
        "--ray-actors",
        type=int,
        metavar="N",
        help="actors, one pipeline each (default: as many as the cluster's CPUs or GPUs hold)",
    )
    b.set_defaults(func=_lazy("hippo.cli.batch", "cmd_batch"))


def _ray_group(parser: Any, title: str, unit: str, where: str) -> Any:
    """The Ray options' group: --ray [ADDRESS] (`where`: what it does), and --ray-num-cpus and
    --ray-num-gpus, what each Ray `unit` (actor, Serve replica) holds."""
    group = parser.add_argument_group(title)
    group.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS", help=where)
    group.add_argument(
        "--ray-num-cpus", type=float, default=1.0, metavar="N", help=f"CPUs per {unit} (default: %(default)s)"
    )
    group.add_argument(
        "--ray-num-gpus",
        type=float,
        default=0.0,
        metavar="N",
        help=f"GPUs per {unit} (default: %(default)s; with --device cuda each {unit} uses the GPU Ray gives it)",
    )
    return group


def _serve_parser(sub: Any, debug: argparse.ArgumentParser) -> None:
    from hippo.service import PREFILL_ROWS, PREFILL_SECONDS

    s = sub.add_parser(
        "serve",
        parents=[debug],
        help="serve an OpenAI-compatible chat-completions endpoint: many users at once, every answer lossless",
        description=(
            "Serve POST /v1/chat/completions (OpenAI's format: messages with text and video_url parts, "
            "file:// URLs under --media-dir), GET /v1/models, /health and /metrics (Prometheus). Requests "
            "join one batch engine between rounds (continuous batching) and leave when done or cancelled; "
            "each answer is exactly the target's own, as `hippo generate` gives it. Questions about the "
            "same video reuse its prepared prefix (an LRU cache bounded by --cache-gb). The video and "
            "decoding options below are the defaults of requests that do not set them."
        ),
        epilog=(
            "Install with pip install 'hippo[serve]'. A request's max_tokens (clamped to the context), "
            "temperature (0: greedy), top_p, top_k, repetition_penalty, seed and stop override the "
            "defaults, and frames, fps, max_pixels can be sent as extra fields; system messages, logprobs "
            "and top_logprobs are honoured, and unsupported fields refused (docs/serving-api.md). SIGTERM stops accepting, drains the requests in flight for up to --drain "
            "seconds, then exits 0."
        ),
    )
    o = _pipeline_args(s, prompt=False, video=False)
    o.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    o.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    o.add_argument(
        "--max-batch", type=int, default=8, metavar="N", help="rows decoded together (default: %(default)s)"
    )
    o.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests waiting before a 429 (default: %(default)s)",
    )
    o.add_argument(
        "--prefill-chunk",
        type=int,
        default=PREFILL_ROWS,
        metavar="TOKENS",
        help="while requests are decoding, a new video's prefill runs in pieces of this many tokens, "
        "one between two decoding rounds, so the live requests wait for a piece, not the whole video; "
        "0: in one piece (default: %(default)s)",
    )
    o.add_argument(
        "--prefill-seconds",
        type=float,
        default=PREFILL_SECONDS,
        metavar="S",
        help="while requests are decoding, a new video's preparation takes its steps (its encoding, "
        "prefill pieces) between two rounds until S seconds of them have run, at least one step: a "
        "short video is ready in fewer rounds, and the live requests wait at most S plus one step; "
        "0: one step a round (default: %(default)s)",
    )
    o.add_argument(
        "--media-dir", required=True, metavar="DIR", help="the only directory videos are read from"
    )
    o.add_argument(
        "--cache-gb",
        type=float,
        default=4.0,
        metavar="G",
        help="GiB of prepared video contexts kept, least recently used out first (default: %(default)s)",
    )
    o.add_argument(
        "--api-key",
        metavar="KEY",
        help="clients must send Authorization: Bearer KEY to /v1 (401 otherwise); default: the "
        "HIPPO_API_KEY environment variable, else no key",
    )
    o.add_argument(
        "--allowed-hosts",
        metavar="H1,H2",
        help="Host headers served, comma-separated ('*.example.com' patterns; 400 otherwise); default: any",
    )
    o.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send (default: the target's folder name)",
    )
    o.add_argument(
        "--drain",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds the requests in flight get to finish on SIGTERM (default: %(default)s)",
    )
    r = _ray_group(
        s,
        "Ray Serve (pip install 'hippo[serve-ray]')",
        "replica",
        "serve the same app from Ray Serve replicas behind Ray's HTTP proxy on --host/--port: "
        "alone, on a new local Ray instance; 'auto': the running cluster; or the cluster at ADDRESS",
    )
    r.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="replicas, one pipeline and one batch engine each (default: %(default)s)",
    )
    s.set_defaults(func=_lazy("hippo.cli.serve", "cmd_serve"))


def _bias_parser(sub: Any, debug: argparse.ArgumentParser) -> None:
    b = sub.add_parser(
        "bias",
        parents=[debug],
        help="measure the position bias of attention-only vs holistic visual-token selection on a video",
        description=(
            "Prefill the target once on a video and a prompt, keep the top --keep-ratio of the visual tokens "
            "by attention alone and by HIPPO's holistic score, and report which share of the kept tokens lies "
            "on the top/bottom --boundary of each frame's rows, against the base rate (paper §4.1, Figs. 2 "
            "and 8). Prints a table; --png writes a per-frame bar chart, --json the full result."
        ),
    )
    _model_args(b, target_required=True)
    _video_args(b)
    a = b.add_argument_group("analysis")
    a.add_argument(
        "--keep-ratio",
        type=float,
        default=0.1,
        metavar="R",
        help="fraction of tokens kept (default: %(default)s)",
    )
    a.add_argument(
        "--boundary",
        type=float,
        default=0.1,
        metavar="F",
        help="rows within F of the top or bottom edge are boundary rows (default: %(default)s)",
    )
    a.add_argument("--png", metavar="FILE", help="write the per-frame bar chart (PNG)")
    a.add_argument("--json", metavar="FILE", help="write the full result as JSON")
    _no_progress(a)
    b.set_defaults(func=_lazy("hippo.cli.video_commands", "cmd_bias"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "pass_through", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        return args.func(args)
    except HippoError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"hippo: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("hippo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
