"""Load on `hippo serve`: K concurrent clients over loopback HTTP, against HF `generate` serving the
same requests one by one and `hippo batch` (`Pipeline.map`) answering them offline, in one run.

    python -m hippo.benchmarks.serve_load                     # K = 1, 2, 4, 8; 8 clips x 2 questions
    python -m hippo.benchmarks.serve_load --clients 1 4 --max-tokens 64 --out serve.md

The narration pair as `hippo demo` loads it (target widened), the default pipeline (`auto`, holistic
top-10%), on held-out clips written to video files. The server is the real app (`hippo.cli.serve`:
FastAPI + uvicorn, the engine's loop thread) on 127.0.0.1; the clients are threads in this process
that stream their answers, each on one kept HTTP connection (an `httpx.Client`, as the `openai`
client keeps one) and taking the next request of a fixed list, so every K answers the same requests. Every method's answers are checked against HF `generate`'s, token for token.

Figures: tokens/s of the whole list at each K; TTFT and latency p50/p99; the live batch size over
time (sampled every 50 ms; a plot with --out); a second question on a prepared video (TTFT against
the first's); one client's latency against the in-process `generate` on the same request; the
stalls: each step of work that ran between two rounds while rows were live (they wait for it: a new
video's reading, its encoding, one prefill piece of `--prefill-chunk` tokens, a question's prefill;
at most `--prepares-per-round` new videos are in preparation while rows are live). Each
method runs once after an untimed warm-up of the whole list (so `auto` has measured its costs and
the video cache is cold again for every timed run: it is cleared between runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hippo.service import PREFILL_ROWS

N_CLIPS = 8
QUESTIONS = ("narrate the video .", "what happens ?")


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def workload(directory: Path, n: int) -> tuple[Any, Any, Any, list[dict], int]:
    """(target, draft, tokenizer, requests, frames): n held-out narration clips written to files,
    each asked the two questions."""
    from hippo.cli.demo import HELD_OUT
    from hippo.cli.pair.checkpoint import NARRATE_DIR, load_pair
    from hippo.cli.pair.narration import NARRATE_BENCH, narration_sample
    from hippo.media.video import write_video

    target, draft, tok = load_pair(directory=NARRATE_DIR)
    requests = []
    for i in range(n):
        clip = narration_sample(HELD_OUT + 100 + i, NARRATE_BENCH, ask=("all", None))
        path = write_video(directory / f"clip{i}.mkv", clip.video, clip.fps)
        requests += [{"video": str(path), "question": q} for q in QUESTIONS]
    return target, draft, tok, requests, NARRATE_BENCH.frames


class LiveServer:
    """The `hippo serve` app for `pipe` on a free loopback port, in a thread."""

    def __init__(
        self,
        pipe: Any,
        tokenizer: Any,
        media: Path,
        frames: int,
        max_batch: int,
        prepares_per_round: int | None = 1,
        prefill_rows: int | None = PREFILL_ROWS,
    ):
        import socket

        import uvicorn

        from hippo.cli.serve import create_app
        from hippo.service import Service

        self.service = Service(
            pipe,
            tokenizer,
            max_batch=max_batch,
            max_queue=256,
            prepares_per_round=prepares_per_round,
            prefill_rows=prefill_rows,
        )
        app = create_app(self.service, "narrate", str(media), 5.0, {"do_sample": False}, {"frames": frames})
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}/v1/chat/completions"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join()


def stream_one(url: str, request: dict, max_tokens: int, http: Any) -> dict:
    """One streamed request on `http` (an `httpx.Client`, kept for many requests as the `openai`
    client keeps one: a new one costs a TLS context, ~16 ms of CPU, even for http://): its token ids,
    TTFT and latency (seconds, client side)."""
    body = {
        "model": "narrate",
        "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": f"file://{request['video']}"}},
            {"type": "text", "text": request["question"]}]}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True,
    }  # fmt: skip
    t0, ttft, last = time.perf_counter(), None, None
    with http.stream("POST", url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            last = chunk
    return {"ids": last["hippo"]["token_ids"], "ttft": ttft, "latency": time.perf_counter() - t0}


def load(server: LiveServer, requests: list[dict], clients: int, max_tokens: int) -> dict:
    """All `requests` through `clients` concurrent streaming clients; the batch size sampled meanwhile."""
    import httpx

    todo, lock, results = list(enumerate(requests)), threading.Lock(), {}
    sizes: list[tuple[float, int]] = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def sample() -> None:
        while not stop.is_set():
            sizes.append((time.perf_counter() - t0, server.service.batch_size))
            time.sleep(0.05)

    def client() -> None:
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    if not todo:
                        return
                    i, req = todo.pop(0)
                results[i] = stream_one(server.url, req, max_tokens, http)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    out = [results[i] for i in range(len(requests))]
    tokens = sum(len(r["ids"]) for r in out)
    return {
        "clients": clients,
        "seconds": seconds,
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "ttft": [r["ttft"] for r in out],
        "latency": [r["latency"] for r in out],
        "ids": [r["ids"] for r in out],
        "batch_sizes": sizes,
        "mean_batch": statistics.fmean(s for _, s in sizes if s) if any(s for _, s in sizes) else 0.0,
    }


def run(
    clients: list[int],
    n_clips: int,
    max_tokens: int,
    threads: int,
    directory: Path,
    prepares: list[int | None] | None = None,
    chunks: list[int | None] | None = None,
) -> dict:
    import hippo

    torch.set_num_threads(threads)
    media = directory / "media"
    media.mkdir(parents=True, exist_ok=True)
    target, draft, tok, requests, frames = workload(media, n_clips)
    pipe = hippo.PipelineBuilder().target(target).draft(draft).build()  # the default pipeline
    gen = {"max_new_tokens": max_tokens, "do_sample": False}
    result: dict[str, Any] = {"requests": len(requests), "max_tokens": max_tokens, "threads": threads}

    # HF generate, one request after another (the inputs built per request, as a server would)
    def hf_all() -> tuple[list[list[int]], float]:
        t0, ids = time.perf_counter(), []
        for r in requests:
            x = pipe.video_inputs(r["video"], r["question"], tokenizer=tok, frames=frames)
            with torch.inference_mode():
                out = target.generate(**x, **gen)
            ids.append(out[0, x["input_ids"].shape[1] :].tolist())
        return ids, time.perf_counter() - t0

    hf_all()  # warm
    reference, hf_s = hf_all()
    tokens = sum(map(len, reference))
    result["hf_generate_one_by_one"] = {"seconds": hf_s, "tok_s": tokens / hf_s}
    print(f"HF generate one by one: {tokens / hf_s:.1f} tok/s ({tokens} tokens, {hf_s:.1f} s)", flush=True)

    # hippo batch, offline (Pipeline.map on the same records)
    records = [
        {"id": i, "video": r["video"], "prompt": r["question"], "frames": frames}
        for i, r in enumerate(requests)
    ]

    def offline() -> tuple[list[list[int]], float]:
        t0 = time.perf_counter()
        got = {res.id: res.token_ids for res in pipe.map(records, tokenizer=tok, batch_size=4, **gen)}
        return [got[i] for i in range(len(records))], time.perf_counter() - t0

    offline()
    ids, off_s = offline()
    result["hippo_batch_offline"] = {"seconds": off_s, "tok_s": tokens / off_s, "identical": ids == reference}
    print(
        f"hippo batch offline (batch 4): {tokens / off_s:.1f} tok/s, identical {ids == reference}", flush=True
    )

    result["serve"] = []
    variants = [(k, p, c) for k in clients for p in (prepares or [1]) for c in (chunks or [PREFILL_ROWS])]
    for k, ppr, chunk in variants:
        server = LiveServer(
            pipe, tok, media, frames, max_batch=max(8, k), prepares_per_round=ppr, prefill_rows=chunk
        )
        try:
            load(server, requests, k, max_tokens)  # warm: auto's costs at this batch size, allocations
            server.service.contexts.clear()  # every timed run starts with a cold video cache
            server.service.stall_seconds.clear()
            row = load(server, requests, k, max_tokens)
            row["stalls"] = list(server.service.stall_seconds)  # prefills the live rows waited for
            if k == 1:
                import httpx

                # one client, like with like: each request through the server on a cold video cache
                # against the in-process generate_from_video (which reads the video too), the order of
                # the two alternated (the second of a pair runs on caches the first warmed)
                def alone(r: dict) -> float:
                    t0 = time.perf_counter()
                    pipe.generate_from_video(r["video"], r["question"], tokenizer=tok, frames=frames, **gen)
                    return time.perf_counter() - t0

                ratios = []
                with httpx.Client(timeout=600) as http:
                    for i, r in enumerate(requests):
                        server.service.contexts.clear()
                        before = alone(r) if i % 2 else None
                        served = stream_one(server.url, r, max_tokens, http)["latency"]
                        ratios.append(served / (before if before is not None else alone(r)))
                    row["latency_over_generate"] = statistics.median(ratios)
                    # a second question on a prepared video: TTFT against the first's
                    server.service.contexts.clear()
                    first = stream_one(server.url, requests[0], max_tokens, http)["ttft"]
                    again = requests[0] | {"question": QUESTIONS[1]}
                    row["second_question_ttft_ratio"] = (
                        stream_one(server.url, again, max_tokens, http)["ttft"] / first
                    )
        finally:
            server.close()
            server.service.close(0)
        row["identical"] = row.pop("ids") == reference
        row["prepares_per_round"], row["prefill_chunk"] = ppr, chunk
        result["serve"].append(row)
        print(
            f"serve, {k} clients, new videos per round {_ppr(ppr)}, prefill pieces of {_chunk(chunk)}: "
            f"{row['tok_s']:.1f} tok/s, TTFT p50 {_percentile(row['ttft'], 0.5):.2f} s "
            f"p99 {_percentile(row['ttft'], 0.99):.2f} s, latency p50 {_percentile(row['latency'], 0.5):.2f} s "
            f"p99 {_percentile(row['latency'], 0.99):.2f} s, mean batch {row['mean_batch']:.2f}, "
            f"stalls {_stalls(row['stalls'])}, identical {row['identical']}",
            flush=True,
        )
    pipe.close()
    return result


def markdown(result: dict) -> str:
    from .tables import markdown_table

    hf, off = result["hf_generate_one_by_one"]["tok_s"], result["hippo_batch_offline"]["tok_s"]
    lone = next((r for r in result["serve"] if r["clients"] == 1), None)
    several = len({r.get("prepares_per_round", 1) for r in result["serve"]}) > 1
    pieces = len({r.get("prefill_chunk") for r in result["serve"]}) > 1
    rows = []
    for r in result["serve"]:
        ttft_ratio = _percentile(r["ttft"], 0.99) / _percentile(lone["ttft"], 0.5) if lone else float("nan")
        rows.append([
            r["clients"], *([_ppr(r.get("prepares_per_round", 1))] if several else []),
            *([_chunk(r.get("prefill_chunk"))] if pieces else []), f"{r['tok_s']:.1f}", f"{r['tok_s'] / hf:.2f}x", f"{r['tok_s'] / off:.2f}",
            f"{_percentile(r['ttft'], 0.5):.2f} / {_percentile(r['ttft'], 0.99):.2f}", f"{ttft_ratio:.2f}",
            f"{_percentile(r['latency'], 0.5):.2f} / {_percentile(r['latency'], 0.99):.2f}",
            f"{r['mean_batch']:.2f}", _stalls(r["stalls"]), "yes" if r["identical"] else "NO",
        ])  # fmt: skip
    head = ["clients", *(["new videos per round"] if several else []), *(["prefill pieces"] if pieces else []), "tok/s", "/ HF one by one", "/ hippo batch", "TTFT p50 / p99 (s)",
            "TTFT p99 / lone p50", "latency p50 / p99 (s)", "mean live batch",
            "stalls: n, median / max (s)", "identical"]  # fmt: skip
    lines = [
        f"{result['requests']} requests, {result['max_tokens']} tokens max each; HF generate one by one "
        f"{hf:.1f} tok/s; hippo batch offline {off:.1f} tok/s.",
        "",
        *markdown_table(head, rows),
    ]
    if lone is not None:
        lines += [
            "",
            f"One client, cold video cache: latency through the server / in-process `generate_from_video`, median "
            f"{lone['latency_over_generate']:.2f}; second question on a prepared video, TTFT / the first's "
            f"{lone['second_question_ttft_ratio']:.2f}.",
        ]
    return "\n".join(lines)


def _ppr(value: int | None) -> str:
    return "all" if value is None else str(value)


def _chunk(value: int | None) -> str:
    return "whole" if value is None else f"{value} tokens"


def _stalls(xs: list[float]) -> str:
    return f"{len(xs)}, {statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "0"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    for r in result["serve"]:
        ax.step(
            [t for t, _ in r["batch_sizes"]],
            [s for _, s in r["batch_sizes"]],
            label=f"{r['clients']} clients, new videos per round {_ppr(r.get('prepares_per_round', 1))}, "
            f"prefill pieces of {_chunk(r.get('prefill_chunk'))}",
        )
    ax.set_xlabel("seconds")
    ax.set_ylabel("live batch size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--clips", type=int, default=N_CLIPS, help="clips (each asked two questions)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--prepares-per-round",
        nargs="+",
        default=["1"],
        metavar="N|all",
        help="the server's new videos prepared between two rounds while rows are live; several: "
        "each K runs each, one after the other (default: 1)",
    )
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        nargs="+",
        default=[PREFILL_ROWS],
        metavar="TOKENS",
        help="the server's prefill pieces while rows are live (0: whole); several: each K runs each, "
        "one after the other (default: %(default)s)",
    )
    ap.add_argument("--out", metavar="FILE.md", help="write the table there, the plot beside it")
    args = ap.parse_args(argv)
    try:
        prepares = [None if v == "all" else int(v) for v in args.prepares_per_round]
    except ValueError:
        ap.error(f"--prepares-per-round takes numbers or 'all', got {args.prepares_per_round}")
    if any(c < 0 for c in args.prefill_chunk):
        ap.error(f"--prefill-chunk takes token counts >= 0 (0: whole), got {args.prefill_chunk}")
    chunks = [c or None for c in args.prefill_chunk]
    if args.out:  # checked before the run, not after it
        from hippo.checkpoint import check_output

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        check_output(args.out, "--out")
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.clients, args.clips, args.max_tokens, args.threads, Path(tmp), prepares, chunks)
    text = markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.write_text(text + "\n")
        plot(result, out.with_suffix(".png"))
        out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
