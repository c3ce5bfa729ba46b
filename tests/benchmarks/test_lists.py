"""The needle-lists task (`hippo.cli.pair.lists`): four questions about one clip, answers of one word
per needle in temporal order, every word read from the video; and `widen`'s `kv` option, which widens
a one-KV-head model without copying its key/value heads (grouped-query attention like a 72B)."""

from __future__ import annotations

import pytest
import torch

from hippo.benchmarks.tokenizer import build_tokenizer, caption_ids
from hippo.cli.pair.lists import MAIN, QUESTIONS, field_scores, lists_sample
from hippo.cli.pair.niah import NiahConfig, needle_rows
from hippo.cli.pair.task import COLOURS, MOTIONS, SHAPES

SMALL = NiahConfig(size=112, frames=40)


@pytest.mark.parametrize("seed", range(4))
def test_each_question_lists_one_attribute_of_every_needle_in_order(seed: int) -> None:
    tok = build_tokenizer()
    answers = {q: lists_sample(seed, SMALL, q) for q in QUESTIONS}
    main = answers[MAIN]
    assert all(torch.equal(a.video, main.video) for a in answers.values())  # one clip, four questions
    for q, smp in answers.items():
        words = smp.caption.split()
        assert words[-1] == "." and len(words) == len(smp.needles) + 1
        ids = caption_ids(tok, smp.caption)[:-1]
        assert tok.unk_token_id not in ids and len(ids) == len(smp.attend)
        assert smp.question == q and tok.unk_token_id not in tok(q)["input_ids"]
    assert main.caption.split()[:-1] == [COLOURS[n.obj.colour] for n in main.needles]
    assert answers["what objects ?"].caption.split()[:-1] == [SHAPES[n.obj.shape] for n in main.needles]
    assert answers["where does the object go ?"].caption.split()[:-1] == [
        MOTIONS[n.obj.motion] for n in main.needles
    ]
    # the i-th word's attention target is needle i (its colour and order) in its cell; the full stop: every needle
    assert main.attend[:-1] == [(n.obj.colour + 1, i + 1, n.cell + 1) for i, n in enumerate(main.needles)]
    assert main.attend[-1] == (-1, 0, 0)


def test_needles_are_large_and_every_needle_shows_on_some_token() -> None:
    for seed in range(6):
        smp = lists_sample(seed, SMALL)
        assert min(n.obj.radius for n in smp.needles) >= 11
        shown = set(smp.token_labels["step"][needle_rows(smp)].tolist())
        assert shown == set(range(1, len(smp.needles) + 1))


def test_question_weights_choose_the_questions_batches_ask() -> None:
    import random

    from hippo.cli.pair.lists import WEIGHTS, draw_question

    default = [draw_question(random.Random(s)) for s in range(50)]
    assert default == [draw_question(random.Random(s), tuple(WEIGHTS.values())) for s in range(50)]
    assert {draw_question(random.Random(s), (0, 1, 0, 0)) for s in range(20)} == {"what objects ?"}
    for bad in ((1, 1, 1), (0, 0, 0, 0), (1, -1, 1, 1)):
        with pytest.raises(ValueError, match="4 non-negative numbers"):
            draw_question(random.Random(0), bad)


def test_field_scores_and_bad_questions() -> None:
    assert field_scores("red blue .", "red green .") == [1, 2]
    assert field_scores("", "red green .") == [0, 2]
    with pytest.raises(ValueError, match="unknown question"):
        lists_sample(0, SMALL, "how many ?")


def test_widening_without_copying_key_value_heads_keeps_the_logits_in_float64() -> None:
    from hippo.benchmarks.models import new_model
    from hippo.benchmarks.tokenizer import processor_inputs
    from hippo.cli.pair.widen import max_logit_difference, norms_in_input_dtype, widen

    model = new_model("target", seed=0).double().eval()
    assert model.config.text_config.num_key_value_heads == 1
    inputs = processor_inputs(build_tokenizer(), lists_sample(1, SMALL).video, MAIN, dtype=torch.float64)
    for kv in (1, 2):
        wide = widen(model, k=4, m=2, kv=kv)  # powers of two: exact scalings
        t = wide.config.text_config
        assert (t.num_attention_heads, t.num_key_value_heads) == (4 * 2, kv)
        assert wide.model.language_model.layers[0].self_attn.k_proj.weight.shape[0] == kv * 64
        with norms_in_input_dtype():
            assert max_logit_difference(model, wide, inputs) < 1e-10
    with pytest.raises(ValueError, match="one key/value head"):
        widen(widen(model, k=2, m=1), k=2, m=1, kv=1)  # two KV heads: only copies of all of them


def test_the_committed_pair_is_shaped_like_72b_and_7b() -> None:
    """`benchmarks/pair_lists/` as `hippo bench --long` loads it (checksums checked): the target's query
    heads share one key/value head 8 to 1 (Qwen2.5-72B: 64 to 8) and its KV cache at 8k visual tokens
    is at most 10% of a decode step's bytes; the draft, widened function-preservingly (float64),
    reads about 1/10 of the target's weights and prefill FLOPs (its KV per token: 1/4; the real
    7B/72B: 0.175; `docs/long-video.md`)."""
    from hippo.benchmarks.pair import DRAFT_WIDEN, LISTS_DIR, cost_ratios, decode_cost, prefill_flops
    from hippo.benchmarks.tokenizer import processor_inputs
    from hippo.cli.pair.checkpoint import load_model, load_pair
    from hippo.cli.pair.niah import FPS
    from hippo.cli.pair.widen import max_logit_difference, norms_in_input_dtype, widen

    target, _, tokenizer = load_pair(directory=LISTS_DIR)
    t = target.config.text_config
    assert (t.num_attention_heads, t.num_key_value_heads) == (8, 1)
    cost = decode_cost(target)
    kv_8k = cost["kv_per_token"] * 8208
    assert kv_8k / (kv_8k + cost["weights"]) <= 0.10
    draft = load_model(LISTS_DIR / "draft", torch.float64)
    wide = widen(draft, **DRAFT_WIDEN[LISTS_DIR.name])
    inputs = processor_inputs(tokenizer, lists_sample(0, SMALL).video, MAIN, fps=FPS, dtype=torch.float64)
    with norms_in_input_dtype():
        assert max_logit_difference(draft, wide, inputs) < 1e-6
    ratios = cost_ratios(target, wide)
    assert 0.08 <= ratios["weights"] <= 0.12 and ratios["kv_per_token"] == 0.25, ratios
    assert 0.08 <= prefill_flops(wide, 8208) / prefill_flops(target, 8208) <= 0.13
