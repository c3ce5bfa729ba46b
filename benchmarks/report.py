"""What `hippo bench` and `hippo bench --long` share: the machine a report was measured on
(`environment`, `cpu_info`), the timer of HF generate's first token (`FirstToken`), and the
long-video section of a Markdown report (`LONG_HEADING`, `section`). Both import it; it imports
neither."""

from __future__ import annotations

import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

import hippo


class FirstToken(BaseStreamer):
    """Times HF generate's first new token inside the timed run itself: `generate` hands a streamer
    the prompt first, then each new token (on CPU a no-op `.cpu()` and one call per step)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.puts = 0
        self.seconds = 0.0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.seconds = time.perf_counter() - self.t0

    def end(self) -> None:
        pass


SIMD_FLAGS = ("sse4", "avx", "fma", "f16c", "amx")  # the instruction sets a CPU kernel's speed depends on


def cpu_info(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> dict:
    """The CPU's model name, its vector and matrix instruction sets (`lscpu`'s flags) and the kernel level
    torch dispatches to (`torch.backends.cpu.get_cpu_capability()`: "AVX2", "AVX512", ...)."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        text = Path(cpuinfo).read_text()
    except OSError:  # not Linux
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = value.split()
    return {
        "cpu_model": model,
        "cpu_flags": sorted(f for f in set(flags) if f.startswith(SIMD_FLAGS)),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def environment(seed: int, threads: int) -> dict:
    import transformers

    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        **cpu_info(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "core_split": {
            "target-alone and serial methods": f"{threads} threads in one process",
            "pearl / hippo": "target in this process, draft in its own process, 1 thread each",
        },
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hippo": hippo.__version__,
        "seed": seed,
    }


LONG_HEADING = "## Long videos (`hippo bench --long`)"


def section(text: str) -> str:
    """The long-video section of a Markdown report (from its heading to the end), or ""."""
    i = text.find(LONG_HEADING)
    return text[i:] if i >= 0 else ""
