"""The media path against the target's prefill: what a long video costs before the model sees it.

    python -m hippo.benchmarks.media                       # 64 and 128 frames of a 720p clip
    python -m hippo.benchmarks.media --frames 128 --no-prefill

A synthetic 1280x720 H.264 clip (a drifting texture and a moving square, written with PyAV) is read
the way `hippo generate` reads a file: `decode_video` (decord) and `build_video_inputs` (the adapter
lays the frames out at `--max-pixels` per frame; 448x448 gives ~8k visual tokens at 64 frames, ~16k
at 128). Each is timed `--repeats` times (median), then the narration target (widened, as `hippo demo`
loads it) prefills the inputs once, and the media path is reported as a share of that prefill.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def write_clip(path: Path, frames: int, height: int = 720, width: int = 1280, fps: int = 4) -> Path:
    """A `frames`-frame H.264 clip: a smooth texture drifting by a few pixels a frame, and a red square."""
    import av
    import numpy as np

    g = torch.Generator().manual_seed(0)
    base = torch.rand(1, 3, height // 40, width // 40, generator=g)
    img = torch.nn.functional.interpolate(base, size=(height, width), mode="bilinear")[0]
    img = (img.permute(1, 2, 0) * 255).to(torch.uint8).numpy()  # [H, W, 3]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for t in range(frames):
            f = np.roll(img, (5 * t, 7 * t), axis=(0, 1)).copy()
            y, x = (100 + 4 * t) % (height - 60), (200 + 9 * t) % (width - 60)
            f[y : y + 60, x : x + 60] = (230, 40, 20)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())
    return path


def _median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def measure(frames: int, max_pixels: int, repeats: int, prefill: bool, directory: Path) -> dict:
    import hippo
    from hippo.cli.pair.checkpoint import NARRATE_DIR, load_pair
    from hippo.media.inputs import build_video_inputs, decode_video, load_tokenizer

    target, draft, _ = load_pair(directory=NARRATE_DIR, wide=prefill)  # the widening only costs prefill
    pipe = hippo.PipelineBuilder().target(target).draft(draft).scheduler("autoregressive").build()
    tokenizer = load_tokenizer(NARRATE_DIR / "target")
    path = write_clip(directory / f"clip{frames}.mp4", frames)
    decode, clip = _median_seconds(lambda: decode_video(path, frames=frames), repeats)
    build, inputs = _median_seconds(
        lambda: build_video_inputs(
            pipe.target_adapter, tokenizer, clip, "narrate the video .", max_pixels=max_pixels
        ),
        repeats,
    )
    row = {
        "frames": frames,
        "visual_tokens": int((inputs["input_ids"] == target.config.video_token_id).sum()),
        "decode_s": decode,
        "build_s": build,
    }
    if prefill:
        out = pipe.generate(inputs, max_new_tokens=1, do_sample=False)
        row["prefill_s"] = out.stats.seconds_target_prefill
        row["media_share"] = (decode + build) / row["prefill_s"]
    pipe.close()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m hippo.benchmarks.media", description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--max-pixels", type=int, default=448 * 448, help="pixels per frame (default 448x448)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-prefill", action="store_true", help="time the media path only")
    args = ap.parse_args(argv)
    rows = []
    print("| frames | visual tokens | decode s | build s | target prefill s | media / prefill |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="hippo-media-") as d:
        for n in args.frames:
            r = measure(n, args.max_pixels, args.repeats, not args.no_prefill, Path(d))
            rows.append(r)
            prefill = f"{r['prefill_s']:.2f} | {r['media_share']:.1%}" if "prefill_s" in r else "- | -"
            print(f"| {n} | {r['visual_tokens']} | {r['decode_s']:.2f} | {r['build_s']:.2f} | {prefill} |")
    return rows


if __name__ == "__main__":
    main()
