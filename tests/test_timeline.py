"""The event record (`generate(..., timeline=True)`, hippo.events) and its drawing (cli/timeline.py).

Events must come from where the work happens under every scheduler and executor, be ordered and
non-overlapping within a lane, agree with the round statistics, and cost nothing when off.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

import hippo
import hippo.events
from hippo.adapters.qwen2_5_vl_tiny import synthetic_inputs, tiny_model
from hippo.events import Event, label

ROOT = Path(__file__).resolve().parents[1]
_MODELS: dict = {}


def timeline_module():
    import hippo.cli.timeline

    return hippo.cli.timeline


def models():
    if not _MODELS:
        _MODELS["target"] = tiny_model("target", seed=0, dtype=torch.float64)
        _MODELS["draft"] = tiny_model("draft", seed=1, dtype=torch.float64)
    return _MODELS["target"], _MODELS["draft"]


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target, _ = models()
    text = torch.randint(3, 140, (6,), generator=g).tolist()
    return synthetic_inputs(target, torch.rand(2, 28, 28, 3, generator=g), [1, *text[:3]], text[3:])


def run(scheduler: str, timeline: bool = True, new: int = 24, drafter: str = "chain", **options):
    target, draft = models()
    b = (
        hippo.PipelineBuilder()
        .target(target)
        .draft(draft)
        .selector("uniform", keep_ratio=0.3)
        .drafter(drafter)
    )
    with b.scheduler(scheduler, **options).build() as pipe:
        return pipe.generate(inputs(), max_new_tokens=new, timeline=timeline).stats


THREAD = {"executor": "inline", "executor_options": {"overlap": "thread"}}
CASES = {
    "serial": ("serial", {}, "chain"),
    "serial-tree": ("serial_tree", {}, "tree"),
    "hippo-inline": ("hippo", {"executor": "inline", "executor_options": {"overlap": "off"}}, "chain"),
    "hippo-thread": ("hippo", THREAD, "chain"),
    "pearl-thread": ("pearl", THREAD, "chain"),
    "hippo-process": ("hippo", {"executor": "process"}, "chain"),
}


def check_record(s) -> None:
    ev = s.events
    assert ev == sorted(ev, key=lambda e: (e.start, e.end))
    for lane in ("target", "draft"):
        mine = [e for e in ev if e.lane == lane]
        assert mine, lane
        for a, b in zip(mine, mine[1:]):
            assert a.end <= b.start + 1e-6, (a, b)  # one piece of work at a time per model
    assert all(0.0 <= e.start <= e.end <= s.seconds_total + 1e-6 for e in ev)
    verify = [e for e in ev if e.kind == "verify"]
    drafts = [e for e in ev if e.lane == "draft" and e.kind in ("draft", "buffer")]
    assert len(verify) == s.rounds
    assert [e.accepted for e in verify] == s.accepted_per_round
    assert [e.n for e in verify] == s.drafted_per_round
    assert sum(e.emitted for e in ev if e.kind in ("verify", "step")) == s.new_tokens
    # every verified position is booked on exactly the drafting that made it
    assert sum(e.accepted for e in drafts) == sum(e.accepted for e in verify)
    assert sum(e.rejected for e in drafts) == sum(e.rejected for e in verify)
    assert all(e.accepted + e.rejected <= e.depth for e in drafts)
    assert sum(e.kind == "prefill" and e.lane == "target" for e in ev) == 1
    assert any(e.kind == "prefill" and e.lane == "draft" for e in ev)
    assert not any(e.stopped for e in ev if e.lane == "target")


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=[pytest.mark.slow, pytest.mark.xdist_group("processes")])
        if "process" in c
        else c
        for c in CASES
    ],
)
def test_event_record(case):
    scheduler, options, drafter = CASES[case]
    s = run(scheduler, drafter=drafter, **options)
    check_record(s)
    buffers = [e for e in s.events if e.kind == "buffer"]
    assert len(buffers) == (1 if scheduler == "hippo" else 0)  # the synchronous-prefill buffer
    if buffers and buffers[0].depth:  # drafted before the first token, which p takes from its prefill
        first = next(e for e in s.events if e.kind in ("verify", "step"))
        assert first.kind == "step" and first.pos == buffers[0].pos
        # the buffer's rest (where its first token was p's) is verified in the first round
        assert next(e for e in s.events if e.kind == "verify").pos == buffers[0].pos + 1


@pytest.mark.parametrize("case", ["serial", "hippo-thread"])
def test_off_by_default_makes_no_event(case, monkeypatch):
    made = []
    monkeypatch.setattr(hippo.events.EventLog, "add", lambda self, *a, **k: made.append(a))
    monkeypatch.setattr(hippo.events.EventLog, "__init__", lambda self: made.append("log"))
    scheduler, options, drafter = CASES[case]
    s = run(scheduler, timeline=False, new=8, drafter=drafter, **options)
    assert s.events == [] and made == [] and s.rounds > 0


def test_label_books_positions_on_the_latest_drafting():
    e = Event
    events = [
        e("target", "prefill", 0.0, 1.0),
        e("draft", "draft", 0.5, 0.9, pos=10, n=3, depth=3, gamma=32),  # buffer: before the first token
        e("target", "verify", 1.0, 1.2, pos=10, n=3, depth=3, accepted=3),
        e("draft", "draft", 1.0, 1.1, pos=13, n=3, depth=3, gamma=3),
        e("target", "verify", 1.2, 1.4, pos=13, n=3, depth=3, accepted=1, rejected=2, emitted=2),
        e("draft", "draft", 1.2, 1.3, pos=16, n=2, depth=2, gamma=3, stopped=True),  # aborted
        e("draft", "draft", 1.4, 1.5, pos=15, n=1, depth=1, gamma=1),  # re-drafts position 15
        e("target", "verify", 1.5, 1.6, pos=15, n=1, depth=1, accepted=1, emitted=1),
    ]
    got = label(events[::-1], prompt_length=10, origin=0.5)
    assert [x.start for x in got] == sorted(x.start - 0.5 for x in events)
    assert [x.kind for x in got][:2] == ["prefill", "buffer"]
    drafts = [x for x in got if x.lane == "draft"]
    assert [(x.accepted, x.rejected, x.unverified) for x in drafts] == [
        (3, 0, 0),
        (1, 2, 0),
        (0, 0, 2),
        (1, 0, 0),
    ]
    assert [x.aborted for x in drafts] == [False, False, True, False]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_draw_timeline_writes_a_png(tmp_path):
    tl = timeline_module()
    s = run("hippo", new=40, **THREAD)
    path = tl.draw_timeline(s, tmp_path / "timeline.png")
    w, h = png_size(path)
    assert 1200 <= w <= 2400 and 500 <= h <= 1200 and path.stat().st_size > 20_000
    assert 0.0 <= tl.hidden_fraction(s.events) <= 1.0
    with pytest.raises(ValueError, match="timeline=True"):
        tl.draw_timeline(hippo.types.Stats(), tmp_path / "empty.png")
