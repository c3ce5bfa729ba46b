"""`hippo.testing.prefill.shared_prefill`: a law check's runs share one prefill, and draw exactly what
they draw without it."""

from __future__ import annotations

import torch

from hippo.testing.drafters import corrupting_plugin
from hippo.testing.prefill import shared_prefill
from hippo.testing.sampling import LAW_CONFIGS, config_build, generation, sampling_case


def _draws(pipe, case, gen, seeds):
    return [pipe.generate(case.inputs, seed=s, **gen) for s in seeds]


def test_runs_on_a_shared_prefill_draw_what_fresh_runs_draw():
    """Seed by seed, the same tokens and rounds with and without the shared prefill (serial and the
    parallel hippo schedule, the target drafting for itself and a separate draft); the prefills are
    really shared (`hits`), and the adapters are their own again after the block."""
    gen = generation(0.05, 4, None, None, 6)
    for cfg, draft in ((LAW_CONFIGS["qwen2_5_vl pearl chain"], "self"), ({}, "draft")):
        case = sampling_case(draft=draft)
        with corrupting_plugin():
            pipe = config_build(cfg)(case).build()
            try:
                fresh = _draws(pipe, case, gen, range(12))
                with shared_prefill(pipe) as memos:
                    shared = _draws(pipe, case, gen, range(12))
                assert all(m.hits >= 11 for m in memos), [m.hits for m in memos]
                assert len(memos) == (1 if draft == "self" else 2)
                assert "prefill" not in vars(pipe.target_adapter) and "encode" not in vars(
                    pipe.target_adapter
                )
                again = _draws(pipe, case, gen, range(12))
            finally:
                pipe.close()
        for a, b, c in zip(fresh, shared, again):
            assert torch.equal(a.sequences, b.sequences) and torch.equal(a.sequences, c.sequences)
            assert a.stats.accepted_per_round == b.stats.accepted_per_round


def test_a_static_session_or_a_scorer_keeps_its_own_prefill():
    """Sessions a static (or compiled) session kind copies are not shared, nor p's prefill when a
    scorer reads it; q's prefill under a scorer is, and packed sessions (the default) are."""
    case = sampling_case(draft="draft")
    with corrupting_plugin():
        static = case.builder("serial").compile("target", "draft", mode="eager").build()
        scored = case.builder("serial", scorer="attention", selector="topk").build()
        try:
            with shared_prefill(static) as memos:
                assert [m.share for m in memos] == [False, False]
            with shared_prefill(scored) as memos:
                assert [m.share for m in memos] == [False, True]
                gen = generation(0.05, 4, None, None, 4)
                outs = _draws(scored, case, gen, range(3))
            assert all(o.sequences.shape[1] == case.prompt.length + 4 for o in outs)
        finally:
            static.close(), scored.close()


def test_replayed_forwards_draw_what_fresh_runs_draw():
    """`shared_prefill(replay=True)`: seed by seed, the same tokens and rounds as fresh runs (chains on
    the serial and the parallel hippo schedule, a static token tree's masked blocks and kept rows, the
    target drafting for itself and a separate draft), on a flat law (many histories) and on the law
    checks' peaked one, where most forwards are replayed; a draft on its own thread turns the replay
    off (`threaded`)."""
    flat, peaked = generation(0.05, 4, None, None, 6), generation(0.01, 2, None, None, 4)
    configs = [
        ({}, "draft"),
        ({"scheduler": "hippo"}, "self"),
        (LAW_CONFIGS["qwen2_5_vl serial_tree static tree"], "flat"),
        (LAW_CONFIGS["qwen2_5_vl hippo dynamic tree on a thread"], "draft"),
    ]
    for cfg, draft in configs:
        executor = cfg.get("executor", "inline")
        case = sampling_case(draft=draft, keep_ratio=cfg.get("keep_ratio", 0.5), executor=executor)
        threaded = executor == "thread"
        with corrupting_plugin():
            pipe = config_build(cfg)(case).build()
            try:
                fresh = _draws(pipe, case, flat, range(16)) + _draws(pipe, case, peaked, range(40))
                with shared_prefill(pipe, replay=True) as memos:
                    replayed = _draws(pipe, case, flat, range(16))
                    replays = [r for m in memos for r in m.replays]
                    hits, misses = sum(r.hits for r in replays), sum(r.misses for r in replays)
                    replayed += _draws(pipe, case, peaked, range(40))
                    hits = sum(r.hits for r in replays) - hits
                    misses = sum(r.misses for r in replays) - misses
            finally:
                pipe.close()
        assert replays and all(r.owner.threaded is threaded for r in replays), cfg
        if threaded:  # what a thread drafts depends on timing: the same draws are not promised
            continue
        for a, b in zip(fresh, replayed, strict=True):
            assert torch.equal(a.sequences, b.sequences), cfg
            assert a.stats.accepted_per_round == b.stats.accepted_per_round, cfg
            assert a.stats.drafted_per_round == b.stats.drafted_per_round, cfg
        assert hits > 4 * misses, (cfg, hits, misses)


def test_a_later_turn_replayed_draws_what_it_draws_fresh():
    """`shared_prefill(replay=True, turns=True)` on a conversation's turn 2 asked again and again from
    one context (`second_turn_check`'s runs): seed by seed the same tokens and rounds as fresh asks,
    q's prefill shared and p's forwards replayed."""
    from hippo.context import Turn
    from hippo.testing import sampling as hs

    case, answer, second, question, gen = hs._second_turn_setup(None)
    own = Turn.target_encoded, Turn.prefill_target
    with corrupting_plugin() as corrupting:
        pipe = hs._second_turn_pipeline(case, corrupting, None, None, None)
        try:
            run = hs._second_turn_run(
                hs._second_turn_conversation(pipe, case, answer, None, ""), question, second, gen
            )
            fresh = [run(s) for s in range(30)]
            with shared_prefill(pipe, replay=True, turns=True) as memos:
                replayed = [run(s) for s in range(30)]
        finally:
            pipe.close()
    assert (Turn.target_encoded, Turn.prefill_target) == own  # restored
    assert memos[0].hits >= 29 and memos[0].replays[0].hits > 4 * memos[0].replays[0].misses
    for (a, sa), (b, sb) in zip(fresh, replayed, strict=True):
        assert a == b and sa.accepted_per_round == sb.accepted_per_round
