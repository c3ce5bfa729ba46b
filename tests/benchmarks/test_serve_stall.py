"""`python -m hippo.benchmarks.serve_stall`'s measurement: the live request's longest wait between two
streamed chunks from the new request's arrival to its first token, against a scripted service."""

from __future__ import annotations

import threading
import time

from hippo.benchmarks.serve_stall import STREAMED, markdown, one


class ScriptedService:
    """Streams the live request a chunk of 2 tokens every 10 ms; a new request stalls it for 0.3 s
    (its prefill), then streams its own first token and lets the live one go on."""

    def __init__(self):
        self.stop = threading.Event()
        self.stall = threading.Event()

    def submit(self, request, notify):
        if request == "live":
            threading.Thread(target=self._live, args=(notify,), daemon=True).start()
        else:
            self.stall.set()
            threading.Thread(target=self._new, args=(notify,), daemon=True).start()

    def _live(self, notify):
        while not self.stop.is_set():
            if self.stall.is_set():
                time.sleep(0.3)
                self.stall.clear()
            notify(("delta", "ab", [1, 2]))
            time.sleep(0.01)

    def _new(self, notify):
        time.sleep(0.3)
        notify(("delta", "c", [3]))

    def cancel(self, ticket):
        self.stop.set()


def test_the_longest_wait_is_the_stall_and_the_ttft_spans_it():
    got = one(ScriptedService(), "live", "new")
    assert 0.25 < got["longest_wait_s"] <= got["ttft_s"] < 1.0
    assert got["live_tok_s"] < 2 * STREAMED / 0.3  # hardly any chunk while it stalled


def test_the_table_gives_each_setting_against_the_whole_prefill():
    runs = {
        "256 tokens": [{"longest_wait_s": 1.0, "live_tok_s": 2.0, "ttft_s": 24.0, "visual_tokens": 8208}],
        "whole": [{"longest_wait_s": 20.0, "live_tok_s": 0.1, "ttft_s": 20.0, "visual_tokens": 8208}],
    }
    medians = {k: {m: v[0][m] for m in v[0]} for k, v in runs.items()}
    text = markdown({"tokens": 8192, "repeats": 1, "threads": 2, "runs": runs, "medians": medians})
    assert "8208 visual tokens" in text
    assert (
        "| 256 tokens | 1.00 | 2.0 | 24.0 | 1.20 |" in text
        and "| whole | 20.00 | 0.1 | 20.0 | 1.00 |" in text
    )
