"""Pruning bookkeeping, checked directly: what the draft's prefill really receives, and where.

For each backbone: the draft's KV cache holds exactly (prompt - pruned visual) entries, the kept
visual rows carry the adapter's promised positions, and decoding continues at the full prompt's next
position. Sessions hand the model its cache under this transformers release's argument name, so
no deprecation warning is raised. Also: every backbone's checkpoint loads back through
`from_pretrained(local_dir)`.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hippo
from hippo.compat import CACHE_ARG
from hippo.registry import lookup

BACKBONES = {
    "qwen2_5_vl": (4, 56, 84),
    "qwen3_vl": (4, 64, 96),
    "llava_onevision": (3, 112, 112),
    "video_salmonn2_plus": (4, 56, 84),
}


def _setup(name: str):
    cls = lookup("adapters", name)
    model = cls.tiny_model("target", seed=0, dtype=torch.float64)
    t, h, w = BACKBONES[name]
    inputs = cls.synthetic_inputs(
        model, torch.rand(t, h, w, 3, generator=torch.Generator().manual_seed(0)), [1, 10, 11], [13, 14, 15]
    )
    return cls, model, inputs


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_draft_prefill_sees_exactly_the_kept_tokens(name, monkeypatch):
    cls, model, inputs = _setup(name)
    adapter = cls(model)
    enc = adapter.encode(inputs)
    n, L = enc.visual.n, enc.length
    assert n > 4 and enc.visual.embeds.shape[0] == n
    keep = torch.tensor([0, 2, n - 1])
    seen = {}
    original = model.forward

    def spy(*args, **kwargs):
        if kwargs.get(CACHE_ARG) is not None and kwargs[CACHE_ARG].get_seq_length() == 0:
            seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    session = adapter.prefill(enc, keep)
    monkeypatch.undo()
    # the cache holds every text/timestamp/newline token plus exactly the 3 kept visual tokens
    assert session.cache.get_seq_length() == L - n + 3
    assert session.length == L  # logical length is the full prompt's
    pos = seen["position_ids"]
    rows = torch.ones(L, dtype=torch.bool)
    rows[enc.visual.seq_index] = False
    rows[enc.visual.seq_index[keep]] = True
    expected = enc.positions[:, rows]
    assert torch.equal(pos.reshape(pos.shape[0], -1), expected)  # original positions kept
    if "input_ids" in seen and seen["input_ids"] is not None:  # Qwen3-VL: pruned placeholders removed
        assert torch.equal(seen["input_ids"][0], enc.input_ids[rows])
        ds = seen["mm_encoder_outputs"]["video"].deepstack_features
        full = [torch.cat(f) for f in enc.extras["video"].deepstack_features]
        assert all(torch.equal(d[0], f[keep]) for d, f in zip(ds, full))
    else:
        assert torch.equal(seen["inputs_embeds"][0], enc.embeds[rows])
    # decoding continues at the full prompt's next position
    nxt = session.positions(L, 1).reshape(-1)
    assert bool((nxt == enc.next_position).all())


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_sessions_pass_the_cache_as_this_release_names_it(name):
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40):
    prefill, decoding, a masked block and rollback use the current name, without a warning."""
    cls, model, inputs = _setup(name)
    adapter = cls(model)
    enc = adapter.encode(inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for keep in (None, torch.tensor([0, 2])):
            session = adapter.prefill(enc, keep)
            session.forward(torch.tensor([1, 2]))
            session.forward_masked(torch.tensor([3, 4]), torch.tensor([0, 1]), torch.ones(2, 2).tril().bool())
            session.rollback(session.length - 1)
    assert [str(w.message) for w in caught if "past_key_values" in str(w.message)] == []


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_steps_through_the_decoder_give_the_models_own_logits(name):
    """Each stock adapter vouches that its model's logits are head(decoder(...)) (`direct_steps`):
    its sessions' steps skip the multimodal wrapper, with the wrapper's own logits."""
    cls, model, inputs = _setup(name)
    adapter = cls(model)
    assert cls.direct_steps
    session = adapter.prefill(adapter.encode(inputs), None)
    assert session.direct == (model.get_decoder(), model.get_output_embeddings())
    L = session.length
    direct = session.forward(torch.tensor([1, 2, 3]))  # [3, V]
    session.rollback(L)
    session.direct = None
    assert torch.equal(session.forward(torch.tensor([1, 2, 3])), direct)


def test_llava_compact_positions_renumber():
    cls, model, inputs = _setup("llava_onevision")
    adapter = cls(model, positions="compact")
    enc = adapter.encode(inputs)
    session = adapter.prefill(enc, torch.tensor([1, 3]))
    kept_len = session.cache.get_seq_length()
    assert int(session.positions(enc.length, 1)) == kept_len


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_from_pretrained_round_trip(name, tmp_path):
    cls, model, inputs = _setup(name)
    draft = cls.tiny_model("draft", seed=1, dtype=torch.float64)
    model.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    ref = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    pipe = (
        hippo.PipelineBuilder()
        .target(str(tmp_path / "target"), dtype=torch.float64)
        .draft(str(tmp_path / "draft"), dtype=torch.float64)
        .selector("uniform", keep_ratio=0.5)
        .scheduler("serial", gamma=3)
        .build()
    )
    assert type(pipe.target_adapter).name == name  # detected from the saved config
    out = pipe.generate(inputs, max_new_tokens=8, do_sample=False)
    assert torch.equal(out.sequences, ref)
