"""`hippo bench`, added to the `hippo` command through the `hippo.commands` entry-point group."""

from __future__ import annotations

import argparse
import sys
from typing import Any

DEFAULT_OUT = "results/bench"  # where the results go unless --out names a directory
EXIT_MISMATCH = 1  # an output differs from HF generate's


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    b = sub.add_parser(
        "bench",
        parents=parents,
        help="the paper's Tables 1 and 2 in miniature: every method side by side on a trained pair",
        description=(
            "Run HF generate, HF assisted generation, HF prompt lookup and hippo's schedulers and selectors on "
            "the same pair, videos and prompts; report medians over repeats of MAT, speedup over HF generate, "
            "tokens/s, TTFT, the time breakdown, the share of draft time hidden behind the target, and the MAT "
            "bound. Every output is checked against HF generate's; a differing one is flagged (exit 1). Writes "
            "table.md (the Markdown report: machine, CPU flags, versions, date, tables), results.json and PNG "
            "plots to --out, or the report to --out FILE.md (and the rest to results/bench). The target-alone baselines get all --threads "
            "cores; pearl/hippo run the draft in its own process, one core per model."
        ),
    )
    b.add_argument("--quick", action="store_true", help="the main rows only, small videos (under 5 minutes)")
    b.add_argument(
        "--long",
        action="store_true",
        help="long videos: the long-video pair on needle-in-a-haystack clips of 576 to 16k visual tokens, every "
        "selector at keep ratios 5/10/25%%, one cold question and four questions on one prepared video, and "
        "the paper's claims (with --quick: N = 576 and 8k, keep 10%%, under 15 minutes); --out DIR, or FILE.md: "
        "the report's long-video section goes there (replacing its own) and the rest to results/bench-long",
    )
    b.add_argument(
        "--pair",
        choices=("narrate", "caption", "tiny"),
        default="narrate",
        help="the committed narration pair (long answers, the paper's regime), the captioning pair (short "
        "answers), or a random tiny pair for smoke runs (default: %(default)s)",
    )
    b.add_argument("--videos", type=int, metavar="N", help="held-out videos (default: 2 quick, 4 full)")
    b.add_argument("--repeats", type=int, metavar="N", help="timed runs per video (default: 1 quick, 2 full)")
    b.add_argument(
        "--max-new-tokens", type=int, metavar="N", help="default: 256 (narrate), 48 (caption, tiny)"
    )
    b.add_argument(
        "--min-new-tokens",
        type=int,
        default=0,
        metavar="N",
        help="suppress EOS until N new tokens (fixed-length runs, as serving benchmarks do; default: off)",
    )
    b.add_argument("--keep-ratio", type=float, default=0.1, metavar="R", help="default: %(default)s")
    b.add_argument("--gamma", type=int, default=5, metavar="N", help="draft length γ (default: %(default)s)")
    b.add_argument(
        "--frames", type=int, metavar="N", help="frames per video (default: 32 narrate, 16 caption)"
    )
    b.add_argument(
        "--size", type=int, metavar="PX", help="frame side in pixels (default: 168 narrate, 448 caption)"
    )
    b.add_argument("--threads", type=int, default=2, metavar="N", help="cores for the target-alone runs")
    b.add_argument(
        "--no-compile",
        action="store_true",
        help="leave out the compiled rows (HF static cache + torch.compile, hippo's compiled target): compiling takes a minute or more",
    )
    b.add_argument("--seed", type=int, default=0, help="held-out video seed offset (default: %(default)s)")
    b.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR|FILE.md",
        help="results directory (default: %(default)s); or a .md file such as benchmarks/RESULTS.md: the "
        f"Markdown report goes there, results.json and the plots to {DEFAULT_OUT}",
    )
    b.add_argument(
        "--timeline",
        metavar="FILE.png",
        help="also draw a Gantt chart of the hippo row's run on the first video (one extra, untimed run)",
    )
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hippo.benchmarks.bench import main as bench
    from hippo.checkpoint import check_output

    if args.long:
        return run_long(args)

    check_output(args.timeline, "--timeline")
    if args.out.endswith(".md"):
        check_output(args.out, "--out")

    summary = bench(
        quick=args.quick,
        pair=args.pair,
        videos=args.videos,
        repeats=args.repeats,
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.min_new_tokens,
        keep_ratio=args.keep_ratio,
        gamma=args.gamma,
        frames=args.frames,
        size=args.size,
        threads=args.threads,
        compiled=not args.no_compile,
        seed=args.seed,
        out=args.out,
        timeline=args.timeline,
        log=lambda line: print(line, file=sys.stderr),
    )
    bad = [r["name"] for r in summary["rows"] if "error" not in r and not r["identical"]]
    if bad:
        print(f"hippo: outputs differ from HF generate for: {', '.join(bad)}", file=sys.stderr)
    return EXIT_MISMATCH if bad else 0


def run_long(args: argparse.Namespace) -> int:
    from hippo.benchmarks.long import main as long_bench
    from hippo.checkpoint import check_output

    if args.out.endswith(".md"):
        check_output(args.out, "--out")
    out = "results/bench-long" if args.out == DEFAULT_OUT else args.out
    summary = long_bench(
        quick=args.quick,
        out=out,
        gamma=args.gamma,
        max_new_tokens=args.max_new_tokens or 96,
        threads=args.threads,
        seed=args.seed,
        log=lambda line: print(line, file=sys.stderr),
    )
    bad = sorted(
        {
            f"{r['method']} {r['selector'] or ''} at N={r['visual_tokens']}"
            for r in summary["rows"]
            if not r["identical"]
        }
    )
    if bad:
        print(f"hippo: outputs differ from HF generate for: {', '.join(bad)}", file=sys.stderr)
    return EXIT_MISMATCH if bad else 0
