"""The `hippo` command: `hippo plugins` and `hippo demo`.

Every HippoError that reaches `main` becomes one line, `hippo: error: <message>`, on stderr and exit
status 2; `--debug` prints the traceback as well. `hippo demo` exits 1 when an output differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence

import hippo
from hippo.errors import HippoError

EXIT_MISMATCH = 1
EXIT_ERROR = 2


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


def _cmd_demo(args: argparse.Namespace) -> int:
    from hippo.demo import format_result, run_demo

    result = run_demo(
        frames=args.frames,
        size=args.size,
        max_new_tokens=args.max_new_tokens,
        gamma=args.gamma,
        keep_ratio=args.keep_ratio,
        seed=args.seed,
        adapter=args.adapter,
    )
    if args.json == "-":
        print(json.dumps(result, indent=2))
    else:
        print(format_result(result))
        if args.json:
            try:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=2)
            except OSError as exc:
                raise HippoError(f"cannot write --json file {args.json!r}: {exc.strerror}") from exc
    return 0 if result["all_identical"] else EXIT_MISMATCH


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
        help="run lossless speculative decoding on a tiny random video-LLM (no downloads)",
        description=(
            "Build the tiny random Qwen2.5-VL (or --adapter) target/draft pair in float32, make a synthetic video "
            "(textured background, bright border, two moving squares) and decode it greedily three ways: "
            "autoregressive (the target alone), serial speculative decoding with the tiny draft, and "
            "self-speculation (the target drafts for itself from --keep-ratio of the video). Prints the "
            "prompt token ids, each output, whether it is identical to the autoregressive output (and to "
            "transformers' generate), MAT, wall times and speedups. Exit status 1 if any output differs."
        ),
    )
    d.add_argument("--frames", type=int, default=8, help="video frames (default: %(default)s)")
    d.add_argument(
        "--size",
        type=int,
        default=None,
        help="frame height and width in pixels, a multiple of the model's patch x merge size (28 for "
        "qwen2_5_vl; default: the smallest valid size >= 112, i.e. 112 for qwen2_5_vl)",
    )
    d.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate per run (default: %(default)s)"
    )
    d.add_argument("--gamma", type=int, default=5, help="draft length γ per round (default: %(default)s)")
    d.add_argument(
        "--keep-ratio",
        type=float,
        default=0.2,
        help="fraction of the visual tokens the draft sees, in (0, 1] (default: %(default)s)",
    )
    d.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights and the video (default: %(default)s)"
    )
    d.add_argument(
        "--adapter",
        default="qwen2_5_vl",
        help="registered adapter whose tiny random target/draft pair to use (default: %(default)s)",
    )
    d.add_argument(
        "--json", metavar="FILE", help="also write the full result as JSON to FILE ('-': JSON on stdout only)"
    )
    d.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HippoError as exc:
        if args.debug:
            traceback.print_exc()
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"hippo: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("hippo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
