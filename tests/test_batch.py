"""`Pipeline.map`: many records through one pipeline, each answer exactly the target's own.

Float64 tiny Qwen2.5-VL target/draft, records of different video lengths and token budgets; the
oracle is `target.generate` on each record alone. Bad records must yield error results with the
message the CLI prints for the same error, and the others must still be answered.
"""

from __future__ import annotations

import pytest
from tiny_checkpoint import tiny_tokenizer

from hippo.errors import ConfigError, VideoError, one_line
from hippo.records import Record, Result, group_by_length
from hippo.testing.models import Prompt, pixel_unit, text_ids
from hippo.testing.reference import build_pipeline, reference

ADAPTER = "qwen2_5_vl"


@pytest.fixture(scope="module")
def pair(tiny):
    return tiny(ADAPTER), tiny(ADAPTER, "draft", seed=1)


def prompts(target, frames: list[int]) -> list[Prompt]:
    unit, words = pixel_unit(target), text_ids(target)
    return [
        Prompt(ADAPTER, target, (t, 2 * unit, 2 * unit), seed, words[10 + seed : 13], words[20:22])
        for seed, t in enumerate(frames)
    ]


def oracle(target, inputs, max_new: int) -> list[int]:
    L = inputs["input_ids"].shape[1]
    return reference(target, inputs, do_sample=False, max_new_tokens=max_new)[0, L:].tolist()


def test_group_by_length_sorts_each_window_and_cuts_batches():
    items = [("a", 5), ("b", 1), ("c", 3), ("d", 1), ("e", 9)]
    batches = group_by_length(items, lambda x: x[1], 2)
    assert [[k for k, _ in b] for b in batches] == [["b", "d"], ["c", "a"], ["e"]]
    assert group_by_length([], len, 3) == []


def test_map_answers_equal_target_generate_per_record(pair):
    target, draft = pair
    ps = prompts(target, [3, 1, 2, 1, 3])
    budgets = [6, 9, 4, 7, 5]
    records = [
        Record(f"r{i}", inputs=p.inputs, generation={"max_new_tokens": n})
        for i, (p, n) in enumerate(zip(ps, budgets))
    ]
    pipe = build_pipeline(target, draft, scheduler="serial", gamma=3)
    results = list(pipe.map(records, batch_size=2, window=4, max_new_tokens=99, do_sample=False))

    assert sorted(r.id for r in results) == [f"r{i}" for i in range(5)]  # each once
    by_id = {r.id: r for r in results}
    for i, (p, n) in enumerate(zip(ps, budgets)):
        r = by_id[f"r{i}"]
        assert r.ok and r.prompt_tokens == p.length
        assert r.token_ids == oracle(target, p.inputs, n), r.id  # the record's budget beat the map's
        assert r.stats.new_tokens == len(r.token_ids) and r.stats.scheduler == "serial"
        assert r.text is None  # no tokenizer: the tiny models have no checkpoint directory
    # the first window (r0..r3) is decoded continuously with its two shortest prompts joining first, so
    # one of them finishes first; r4 forms the last window on its own
    first = [r.id for r in results[:4]]
    shortest = sorted(first, key=lambda rid: by_id[rid].prompt_tokens)[:2]
    assert sorted(first) == ["r0", "r1", "r2", "r3"] and first[0] in shortest and results[-1].id == "r4"


def test_map_takes_json_records_and_map_wide_settings(pair):
    """Mappings as `hippo batch` reads them; a record's settings override the map's."""
    target, draft = pair
    (p,) = prompts(target, [2])
    pipe = build_pipeline(target, draft, scheduler="serial", gamma=2)
    rec = Record("x", inputs=p.inputs)
    (r,) = pipe.map([rec], max_new_tokens=5, do_sample=False)
    assert r.token_ids == oracle(target, p.inputs, 5)
    (s,) = pipe.map(
        [Record("y", inputs=p.inputs, generation={"do_sample": True, "seed": 7})], max_new_tokens=5
    )
    # plumbing, not losslessness: the record's seed reaches generate
    want = pipe.generate(p.inputs, seed=7, do_sample=True, max_new_tokens=5)
    assert s.token_ids == want.sequences[0, p.length :].tolist()


def test_bad_records_get_error_results_and_the_run_goes_on(pair, tmp_path):
    target, draft = pair
    (p,) = prompts(target, [1])
    pipe = build_pipeline(target, draft, scheduler="serial", gamma=2)
    missing = tmp_path / "missing.mp4"
    with pytest.raises(VideoError) as video_error:  # what `hippo generate --video missing.mp4` prints
        pipe.video_inputs(missing, "describe", tokenizer=tiny_tokenizer())
    good = Record("ok", inputs=p.inputs)
    records = [
        good,
        {"id": "no_prompt", "video": "v.mp4"},
        {"id": "typo", "video": "v.mp4", "prompt": "p", "max_new_token": 3},
        {"id": "hot", "video": "v.mp4", "prompt": "p", "temperature": 0},
        {"id": "greedy_t", "video": "v.mp4", "prompt": "p", "temperature": 0.5},
        {"video": "v.mp4", "prompt": "p"},
        {"id": True, "video": "v.mp4", "prompt": "p"},
        Record("ok", inputs=p.inputs),
        Record("gone", video=missing, prompt="describe"),
        Record("both", video=missing, prompt="x", inputs=p.inputs),
        "not a record",
        Record("no_ids", inputs={"pixel_values_videos": None}),
    ]
    results = list(pipe.map(records, tokenizer=tiny_tokenizer(), max_new_tokens=4, do_sample=False))
    errors = [(r.id, r.error) for r in results if not r.ok]
    assert [r.id for r in results if r.ok] == ["ok"]
    assert results[-1].id == "ok" and results[-1].token_ids == oracle(target, p.inputs, 4)
    assert results[-1].text == tiny_tokenizer().decode(results[-1].token_ids, skip_special_tokens=True)
    assert errors == [
        ("no_prompt", "record 'no_prompt': \"prompt\" must be a non-empty string, got None"),
        (
            "typo",
            "record 'typo': unknown field(s) 'max_new_token'; a record takes id, video, prompt, frames, fps, "
            "max_pixels, max_new_tokens, do_sample, temperature, top_p, top_k, seed",
        ),
        ("hot", "record 'hot': \"temperature\" must be a number > 0, got 0"),
        (
            "greedy_t",
            'record \'greedy_t\': "temperature" only applies when sampling, but "do_sample" is false; set '
            '"do_sample": true or remove it',
        ),
        (None, 'a record needs an "id": a non-empty string or an integer, got None'),
        (None, 'a record needs an "id": a non-empty string or an integer, got True'),
        ("ok", "record 'ok': duplicate id; each id is answered once"),
        ("gone", one_line(video_error.value)),
        ("both", "record 'both': give either video and prompt, or inputs"),
        (None, "a record must be a JSON object with id, video and prompt, got str"),
        ("no_ids", "inputs must be the mapping a Hugging Face processor returns, with input_ids"),
    ]
    assert all("\n" not in e for _, e in errors)


def test_result_as_dict_is_json_ready(pair):
    import json

    target, draft = pair
    (p,) = prompts(target, [1])
    pipe = build_pipeline(target, draft, scheduler="serial", gamma=2)
    (r,) = pipe.map([Record(3, inputs=p.inputs)], max_new_tokens=3, do_sample=False)
    d = json.loads(json.dumps(r.as_dict()))
    assert d["id"] == 3 and d["token_ids"] == r.token_ids and d["stats"]["new_tokens"] == 3
    assert Result("e", error="boom").as_dict() == {"id": "e", "error": "boom"}


@pytest.mark.parametrize("kw", [{"batch_size": 0}, {"batch_size": 4, "window": 2}, {"batch_size": True}])
def test_bad_batch_settings_raise_before_any_work(pair, kw):
    pipe = build_pipeline(*pair, scheduler="serial")
    with pytest.raises(ConfigError):
        pipe.map([], **kw)  # at the call, not at the first result
