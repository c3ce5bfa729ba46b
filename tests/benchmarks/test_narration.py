"""The narration task: long answers that follow every time step, a pure function of the seed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hippo.benchmarks.tokenizer import build_tokenizer, processor_inputs
from hippo.cli.pair.narration import (
    FIELDS,
    NARRATE_BENCH,
    answer_lengths,
    field_scores,
    narrate,
    narration_config,
    narration_sample,
    split_steps,
    step_token_score,
)
from hippo.cli.pair.task import TEMPORAL

SEEDS = range(10**9, 10**9 + 12)


def test_deterministic_and_in_vocabulary():
    tok = build_tokenizer()
    for s in SEEDS[:8]:
        a, b = narration_sample(s), narration_sample(s)
        assert a.caption == b.caption and a.question == b.question and torch.equal(a.video, b.video)
        ids = tok(f"{a.question} {a.caption}")["input_ids"]
        assert tok.unk_token_id not in ids, a.caption


def test_every_step_is_narrated_and_answers_are_long():
    steps = NARRATE_BENCH.frames // TEMPORAL
    for s in SEEDS:
        smp = narration_sample(s, ask=("all", None))
        assert len(split_steps(smp.caption)) == steps
    lengths = answer_lengths(SEEDS, ask=("all", None)).float()
    assert lengths.median() >= 256  # the paper's 256-token regime: narrating everything runs past it
    assert answer_lengths(SEEDS).float().mean() > 150  # over the mix of questions too


def test_one_step_of_video_changes_that_step_only():
    """A moving object's cell follows its own time step: an object moved at one step changes that
    step's clause and no other (what a draft that loses one frame's tokens gets wrong)."""
    cfg = narration_config(168, 32, min_objects=1, max_objects=1)
    for s in SEEDS:
        smp = narration_sample(s, cfg, ask=("all", None))
        obj = smp.objects[0]
        if obj.motion >= 4:  # appears / disappears: stands still
            continue
        shifted = type(obj)(**{**obj.__dict__, "centres": obj.centres.clone()})
        j = 3
        shifted.centres[TEMPORAL * j : TEMPORAL * (j + 1)] = torch.tensor([1.0, 1.0])  # top left corner
        before, after = split_steps(smp.caption), split_steps(narrate([shifted], cfg))
        changed = [k for k in before if before[k] != after[k]]
        assert changed in ([], ["four"])  # step four (index 3), unless it already was top left
        if changed:
            return
    pytest.fail("no moving object found to shift")


def test_question_kinds_ask_for_different_answers():
    s = SEEDS[0]
    full = narration_sample(s, ask=("all", None))
    colour = narration_sample(s, ask=("colour", "red"))
    shape = narration_sample(s, ask=("shape", "circle"))
    assert len({full.question, colour.question, shape.question}) == 3
    assert torch.equal(full.video, colour.video)
    assert "moves" not in shape.caption and "still" not in shape.caption  # cells only
    absent = next(c for c in ("red", "green", "blue", "yellow") if c not in full.caption)
    assert set(narration_sample(s, ask=("colour", absent)).caption.split()) <= {
        "step",
        ":",
        "nothing",
        ".",
        *"one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen".split(),
    }


def test_step_token_score_aligns_per_step():
    ref = "step one : red circle top left moves right . step two : red circle top center moves right ."
    assert step_token_score(ref, ref) == (22, 22)
    slip = "step one : red circle top left moves right . green square . step two : red circle top center moves right ."
    right, total = step_token_score(slip, ref)
    assert total == 22 and right == 22  # an extra clause at the end of a step does not shift the next
    missing = "step one : red circle top left moves right ."
    assert step_token_score(missing, ref) == (11, 22)


def test_cues_are_read_exactly_from_every_background_patch():
    """The step, row and column codes come out of a linear read-out of any 14 px patch, whatever
    the background's noise: the property that lets a small vision encoder tell time and place."""
    from hippo.cli.pair.task import CUE_AXES, _angle_cues, _background

    cfg = narration_config(168, 4)  # cells of 56 px: four patches each
    video = _angle_cues(_background(cfg, torch.Generator().manual_seed(3)).expand(4, 168, 168, 3), cfg)
    rg, by = CUE_AXES
    sign = 1.0 - 2.0 * (torch.arange(14) % 2).float()
    patterns = {"row": sign[:, None], "column": sign[None, :], "step": sign[:, None] * sign[None, :]}
    for t in range(4):
        for i in range(1, 11):  # patches off the white border
            for j in range(1, 11):
                patch = video[t, 14 * i : 14 * i + 14, 14 * j : 14 * j + 14]  # [14, 14, 3]
                want = {"row": (i // 4, 3), "column": (j // 4, 3), "step": (t // 2, 16)}
                for name, pattern in patterns.items():
                    code = (patch * pattern[..., None]).mean((0, 1))  # [3]
                    value, n = want[name]
                    off = torch.atan2(code @ by, code @ rg) - 2 * torch.pi * value / n
                    assert abs(float(torch.remainder(off + torch.pi, 2 * torch.pi) - torch.pi)) < 0.05


def test_binary_cues_are_read_exactly_from_every_patch_objects_included():
    """The binary design: the step's bits, row and column come out of a linear read-out of any 14 px
    patch, on an object or not: the property that lets a small vision encoder tell the time and
    place of the very tokens a clause describes."""
    from hippo.cli.pair.task import CUE_AXES, LUMINANCE, cue_patterns, step_code

    cfg = narration_config(168, 8, cue_design="binary")  # cells of 56 px: four patches each
    rg, by = CUE_AXES
    pat = {k: v[:14, :14, None] for k, v in cue_patterns(168).items()}
    on_objects = 0
    for seed in SEEDS[:3]:
        smp = narration_sample(seed, cfg)
        for f in range(cfg.frames):
            for i in range(1, 11):  # patches off the white border
                for j in range(1, 11):
                    patch = smp.video[f, 14 * i : 14 * i + 14, 14 * j : 14 * j + 14]  # [14, 14, 3]
                    code = {k: (patch * v).mean((0, 1)) for k, v in pat.items()}  # name -> [3]
                    for name, value in (("rows", i // 4), ("columns", j // 4)):
                        off = torch.atan2(code[name] @ by, code[name] @ rg) - 2 * torch.pi * value / 3
                        assert abs(float(torch.remainder(off + torch.pi, 2 * torch.pi) - torch.pi)) < 0.05
                    bits = torch.stack(
                        [code["checker"] @ a for a in (rg, by, LUMINANCE)] + [code["rows"] @ LUMINANCE]
                    )
                    assert torch.equal(bits.sign(), step_code(torch.tensor(f // TEMPORAL)))
                    token = ((f // TEMPORAL) * 6 + i // 2) * 6 + j // 2
                    on_objects += int(smp.token_labels["colour"][token] > 0)
    assert on_objects > 100  # the read-out was checked on objects, not only on the background
    with pytest.raises(ValueError, match="cue_design must be one of"):
        narration_config(56, 8, cue_design="hue")


def test_attention_targets_name_each_clause_object_and_step():
    from hippo.cli.pair.narration import COLUMNS, ROWS, attention_targets
    from hippo.cli.pair.task import COLOURS, SHAPES

    for seed in SEEDS[:4]:
        smp = narration_sample(seed, ask=("all", None))
        words, targets = smp.caption.split(), attention_targets(smp)
        steps = split_steps(smp.caption)
        assert len(targets) == len(words)
        step = -1
        for i, (w, (colour, at, cell)) in enumerate(zip(words, targets)):
            step += w == "step"
            start = max(k for k in range(i + 1) if k == 0 or words[k - 1] in (".", ":"))
            if words[start] in COLOURS and 0 < i - start <= 4 and w != ".":
                row, column = ROWS.index(words[start + 2]), COLUMNS.index(words[start + 3])
                assert (colour, at, cell) == (COLOURS.index(words[start]) + 1, step + 1, 3 * row + column + 1)
                labels = smp.token_labels
                assert bool(((labels["colour"] == colour) & (labels["step"] == at)).any())  # on screen
            else:
                assert (colour, at, cell) == (0, 0, 0), (i, w)
        assert step + 1 == len(steps)
        shape = next(
            SHAPES[o.shape] for o in smp.objects if sum(p.shape == o.shape for p in smp.objects) == 1
        )
        where = narration_sample(seed, ask=("shape", shape))
        obj = next(o for o in where.objects if SHAPES[o.shape] == shape)
        cells = [t for w, t in zip(where.caption.split(), attention_targets(where)) if t != (0, 0, 0)]
        assert cells and all(c == obj.colour + 1 and cell > 0 for c, _, cell in cells)  # that object's
        assert len(cells) == 2 * sum(w in ("top", "middle", "bottom") for w in where.caption.split())
    # a teacher's answer need not be well formed: every word still gets a target, and none loops
    for text in ("step step one : red", "step one : red circle step", "step . step", "step"):
        assert len(attention_targets(replace(smp, caption=text))) == len(text.split())


def test_field_scores_name_what_is_wrong():
    ref = (
        "step one : red circle top left moves right . blue square middle center still . step two : nothing ."
    )
    assert field_scores(ref, ref) == {f: [2, 2] for f in FIELDS}
    one = "step one : red square top center moves right . step two : blue square top left still ."
    assert field_scores(one, ref) == {
        "clauses": [0, 2],
        "colour": [1, 2],
        "shape": [0, 2],
        "cell": [0, 2],
        "doing": [1, 2],
    }
    where = "step one : top left . step two : middle center ."
    assert field_scores("step one : top left . step two : top left .", where)["cell"] == [1, 2]


def test_processor_inputs_at_4_fps_give_one_temporal_position_per_step():
    smp = narration_sample(SEEDS[0], narration_config(56, 8))
    inputs = processor_inputs(build_tokenizer(), smp.video, smp.question, fps=smp.fps)
    assert float(inputs["second_per_grid_ts"]) == 0.5  # x tokens_per_second 2 = one position per step
    assert int(inputs["video_grid_thw"][0, 0]) == 4


def test_frames_beyond_sixteen_steps_are_refused():
    with pytest.raises(ValueError, match="at most 32"):
        narration_config(112, 34)
