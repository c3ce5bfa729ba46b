"""A long video arriving while another request decodes: what the live request waits for.

    python -m hippo.benchmarks.serve_stall                          # an 8k-token video; pieces of 256, 512, whole
    python -m hippo.benchmarks.serve_stall --tokens 16384 --prefill-chunk 0 256 --repeats 3 --out stall.md

The long-video pair (`hippo bench --long`'s, both widened), the default pipeline, `hippo.service` in
process (the loop `hippo serve` runs; no HTTP). One request decodes on a 576-token needle clip; once
it has streamed 20 tokens, a request about a new clip of `--tokens` visual tokens arrives, and its
video is read, encoded and prefilled between the live request's rounds: in pieces of
`--prefill-chunk` tokens (0: in one piece). Both clips are video files (lossless FFV1), read as a
server reads them. Per setting, from the new request's arrival to its first token: the live
request's longest wait between two streamed chunks, its tokens/s, and the new request's TTFT (its
ratio to the one-piece setting's). Settings alternate (one order, then the reverse) after an
untimed warm-up; the table gives medians over `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LIVE_TOKENS = 576  # the live request's clip
STREAMED = 20  # chunks the live request streams before the new request arrives


def _clip_file(directory: Path, tokens: int, seed: int) -> tuple[str, dict[str, Any]]:
    """(path, video options) of a held-out needle clip of about `tokens` visual tokens."""
    from hippo.cli.pair.niah import FPS, config_for, niah_sample
    from hippo.media.video import write_video

    cfg = config_for(tokens)
    smp = niah_sample(10**9 + seed, cfg)
    path = write_video(directory / f"clip{tokens}_{seed}.mkv", smp.video, FPS)
    return str(path), {"frames": cfg.frames, "max_pixels": cfg.size * cfg.size}


def one(service: Any, live: Any, new: Any) -> dict[str, float]:
    """The live request, then the new one once the live one has streamed; cancelled at the new one's
    first token."""
    chunks: list[tuple[float, int]] = []  # (time, tokens) of the live request's chunks
    first: list[float] = []
    errors: list[BaseException] = []

    def on_live(event: tuple) -> None:
        if event[0] == "delta":
            chunks.append((time.perf_counter(), len(event[2])))
        elif event[0] == "error":
            errors.append(event[1])

    def on_new(event: tuple) -> None:
        if event[0] == "delta" and not first:
            first.append(time.perf_counter())
        elif event[0] == "error":
            errors.append(event[1])

    def wait(done: Any) -> None:
        while not done():
            if errors:
                raise RuntimeError(f"a request failed: {errors[0]}")
            time.sleep(0.005)

    a = service.submit(live, on_live)
    wait(lambda: len(chunks) >= STREAMED)
    t0 = time.perf_counter()
    service.submit(new, on_new)
    wait(lambda: first)
    service.cancel(a)
    t1 = first[0]
    during = [t0] + [t for t, _ in chunks if t0 <= t <= t1] + [t1]
    tokens = sum(n for t, n in chunks if t0 <= t <= t1)
    return {
        "longest_wait_s": max(b - a for a, b in zip(during, during[1:])),
        "live_tok_s": tokens / (t1 - t0),
        "ttft_s": t1 - t0,
    }


def run(tokens: int, chunks: list[int | None], repeats: int, threads: int, directory: Path) -> dict:
    import hippo
    from hippo.service import Request, Service

    from .long import load_long_pair

    torch.set_num_threads(threads)
    target, draft, tok = load_long_pair()
    pipe = hippo.PipelineBuilder().target(target).draft(draft).build()
    question = [("what happens ?", None)]
    live_path, live_opts = _clip_file(directory, LIVE_TOKENS, 1)
    live = Request(live_path, question, live_opts, {"max_new_tokens": 4000, "min_new_tokens": 4000})
    rows: dict[str, list[dict]] = {_name(c): [] for c in chunks}
    for r in range(repeats + 1):  # the first pass is the warm-up
        new_path, new_opts = _clip_file(directory, tokens if r else LIVE_TOKENS, 2 + r)
        new = Request(new_path, question, new_opts, {"max_new_tokens": 4})
        for chunk in chunks if r % 2 == 0 else chunks[::-1]:
            service = Service(pipe, tok, prefill_rows=chunk)
            try:
                got = one(service, live, new)
                got["visual_tokens"] = max(c.encoded.visual.n for c in service.contexts.entries.values())
            finally:
                service.close(0)
            if r:
                rows[_name(chunk)].append(got)
                print(f"repeat {r}, prefill pieces of {_name(chunk)}: " + _fmt(got), flush=True)
    medians = {name: {k: statistics.median(g[k] for g in got) for k in got[0]} for name, got in rows.items()}
    return {"tokens": tokens, "repeats": repeats, "threads": threads, "runs": rows, "medians": medians}


def _name(chunk: int | None) -> str:
    return "whole" if chunk is None else f"{chunk} tokens"


def _fmt(got: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items())


def _visual(result: dict) -> str:
    return "/".join(sorted({str(g["visual_tokens"]) for got in result["runs"].values() for g in got}))


def markdown(result: dict) -> str:
    from .tables import markdown_table

    med = result["medians"]
    whole = med.get("whole", {}).get("ttft_s")
    rows = [
        [
            name,
            f"{m['longest_wait_s']:.2f}",
            f"{m['live_tok_s']:.1f}",
            f"{m['ttft_s']:.1f}",
            f"{m['ttft_s'] / whole:.2f}" if whole else "-",
        ]
        for name, m in med.items()
    ]
    head = [
        "prefill pieces",
        "live request's longest wait (s)",
        "its tok/s meanwhile",
        "new TTFT (s)",
        "/ whole",
    ]
    return "\n".join(
        [
            f"A request about a new video of {_visual(result)} visual tokens arrives while one decodes (medians of "
            f"{result['repeats']}, {result['threads']} threads).",
            "",
            *markdown_table(head, rows),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tokens", type=int, default=8192, help="visual tokens of the new video (default: %(default)s)"
    )
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        nargs="+",
        default=[256, 512, 0],
        metavar="TOKENS",
        help="the server's prefill pieces to compare (0: whole; default: %(default)s)",
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", metavar="FILE.md", help="write the table there, the runs beside it (.json)")
    args = ap.parse_args(argv)
    if any(c < 0 for c in args.prefill_chunk) or args.repeats < 1 or args.tokens < LIVE_TOKENS:
        ap.error(f"--prefill-chunk takes token counts >= 0, --repeats >= 1, --tokens >= {LIVE_TOKENS}")
    if args.out:
        from hippo.checkpoint import check_output

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        check_output(args.out, "--out")
    with tempfile.TemporaryDirectory() as tmp:
        result = run(
            args.tokens, [c or None for c in args.prefill_chunk], args.repeats, args.threads, Path(tmp)
        )
    text = markdown(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
