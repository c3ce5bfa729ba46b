"""PipelineBuilder: bad configurations fail early with clear messages; configs and checkpoints load.

Everything runs on the tiny random Qwen2.5-VL pair in float64.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import hippo
from hippo import PartSpec, PipelineBuilder, PipelineConfig
from hippo.errors import ConfigError, InputError, ModelError, PluginError
from hippo.interfaces import Selector
from hippo.padded import pad_rows
from hippo.registry import build_plugin_manager, lookup

ADAPTER = lookup("adapters", "qwen2_5_vl")
NEW = 12


@pytest.fixture(scope="module")
def pair():
    target = ADAPTER.tiny_model("target", seed=0, dtype=torch.float64)
    draft = ADAPTER.tiny_model("draft", seed=1, dtype=torch.float64)
    return target, draft


@pytest.fixture(scope="module")
def inputs(pair):
    g = torch.Generator().manual_seed(3)
    return ADAPTER.synthetic_inputs(pair[0], torch.rand(4, 56, 56, 3, generator=g), [1, 17, 42], [61, 19])


@pytest.fixture(scope="module")
def reference(pair, inputs) -> torch.Tensor:
    with torch.inference_mode():
        return pair[0].generate(**inputs, max_new_tokens=NEW, do_sample=False)


@pytest.fixture(scope="module")
def checkpoints(pair, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    for role, model in zip(("target", "draft"), pair):
        model.save_pretrained(root / role)
    return root / "target", root / "draft"


def builder(pair) -> PipelineBuilder:
    return PipelineBuilder().target(pair[0]).draft(pair[1])


# ---- option values fail when they are set, before any model is touched ----------------------------


@pytest.mark.parametrize("ratio", [0, 0.0, 1.5, -0.1, True])
def test_keep_ratio_out_of_range(ratio) -> None:
    with pytest.raises(ConfigError, match=r"selector 'uniform'.*keep_ratio must be a number in \(0, 1\]"):
        PipelineBuilder().selector("uniform", keep_ratio=ratio)


@pytest.mark.parametrize("gamma", [0, -1, 2.5])
def test_gamma_must_be_a_positive_int(gamma) -> None:
    with pytest.raises(ConfigError, match=r"scheduler 'serial'.*gamma must be an integer >= 1"):
        PipelineBuilder().scheduler("serial", gamma=gamma)


def test_unknown_option_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        PipelineBuilder().selector("uniform", keepratio=0.1)
    msg = str(info.value)
    assert "unknown option(s) keepratio" in msg and "valid options: keep_ratio" in msg
    with pytest.raises(ConfigError, match="unknown option"):
        PipelineBuilder().scheduler("autoregressive", gamma=3)


@pytest.mark.parametrize(
    "kind,name",
    [("selector", "unifrom"), ("scheduler", "seriall"), ("drafter", "tree?"), ("verifier", "exact")],
)
def test_unknown_plugin_name_lists_the_registered_ones(kind: str, name: str) -> None:
    with pytest.raises(PluginError) as info:
        getattr(PipelineBuilder(), kind)(name)
    msg = str(info.value)
    assert f"unknown {kind} {name!r}" in msg
    assert f"registered {kind}s:" in msg
    known = {"selector": "uniform", "scheduler": "serial", "drafter": "chain", "verifier": "greedy"}[kind]
    assert known in msg


def test_unknown_adapter_backbone() -> None:
    with pytest.raises(PluginError, match="unknown adapter 'qwen9'.*qwen2_5_vl"):
        PipelineBuilder().target(torch.nn.Linear(1, 1), backbone="qwen9").build()


# ---- build-time checks ---------------------------------------------------------------------------


def test_build_needs_a_target() -> None:
    with pytest.raises(ConfigError, match=r"no target model: call \.target"):
        PipelineBuilder().build()


def test_speculative_schedule_needs_a_draft(pair) -> None:
    with pytest.raises(ConfigError, match="needs a draft model"):
        PipelineBuilder().target(pair[0]).scheduler("serial").build()
    PipelineBuilder().target(pair[0]).scheduler("autoregressive").build()  # the target alone is fine


def test_model_that_is_not_a_model(pair) -> None:
    with pytest.raises(ConfigError, match="target must be a transformers model or a checkpoint path"):
        PipelineBuilder().target(42).build()
    with pytest.raises(ConfigError, match="draft must be a model or a checkpoint path, got None"):
        PipelineBuilder().draft(None)


def test_draft_vocabulary_mismatch(pair) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from hippo.adapters.qwen2_5_vl_tiny import tiny_config
    from hippo.adapters.tiny import VOCAB

    cfg = tiny_config("draft")
    cfg.text_config.vocab_size = VOCAB + 10
    torch.manual_seed(0)
    other = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float64).eval()
    with pytest.raises(ModelError) as info:
        PipelineBuilder().target(pair[0]).draft(other).build()
    msg = str(info.value)
    assert f"draft vocabulary ({VOCAB + 10}) differs from the target's ({VOCAB})" in msg


class NeedsScores(Selector):
    needs_scores = True

    def select(self, visual, scores, generator):  # pragma: no cover - never run
        return torch.arange(visual.n)


class NeedsScoresPlugin:
    @staticmethod
    @hippo.hookimpl
    def hippo_register_selectors():
        return {"needs_scores_example": NeedsScores}


def test_score_ranking_selector_without_a_scorer(pair) -> None:
    pm = build_plugin_manager(autoload=False, plugins=[NeedsScoresPlugin])
    b = PipelineBuilder(pm).target(pair[0]).draft(pair[1]).selector("needs_scores_example")
    with pytest.raises(ConfigError, match="'needs_scores_example' ranks tokens by score: add a scorer"):
        b.build()


# ---- generation-time checks (before any decoding) ------------------------------------------------


def test_greedy_verifier_refuses_sampling(pair, inputs) -> None:
    pipe = builder(pair).verifier("greedy").build()
    with pytest.raises(ConfigError, match=r"'greedy' is exact only for greedy decoding but do_sample=True"):
        pipe.generate(inputs, max_new_tokens=4, do_sample=True, seed=0)


def test_prompt_longer_than_the_context(inputs) -> None:
    short = ADAPTER.tiny_model("target", seed=0, dtype=torch.float64)
    L = inputs["input_ids"].shape[1]
    short.config.get_text_config().max_position_embeddings = L - 1
    pipe = PipelineBuilder().target(short).scheduler("autoregressive").build()
    with pytest.raises(InputError, match=f"the prompt has {L} tokens but the target's context is {L - 1}"):
        pipe.generate(inputs, max_new_tokens=4, do_sample=False)


def test_several_prompts_give_each_row_its_own_generate(pair, inputs) -> None:
    """A list, or one padded batch (left or right), gives one output per row: the target's own
    `generate` on that row alone, decoded by the batched engine (each row's notes say so); one prompt
    that arrives padded is cut to its tokens."""
    from hippo.testing.reference import reference

    g = torch.Generator().manual_seed(1)
    other = ADAPTER.synthetic_inputs(pair[0], torch.rand(2, 56, 28, 3, generator=g), [5], [61, 19, 23, 7])
    pipe = builder(pair).build()
    assert pipe.can_batch()  # the default schedule has a batched form: the rows go through it
    gen = {"max_new_tokens": 6, "do_sample": False}
    alone = [reference(pair[0], x, **gen) for x in (inputs, other)]  # target.generate, row by row
    for batch in (
        [inputs, other],
        pad_rows([inputs, other], "left"),
        pad_rows([inputs, other], "right"),
    ):
        outs = pipe.generate(batch, **gen)
        assert [o.sequences.tolist() for o in outs] == [a.tolist() for a in alone]
        for o in outs:
            assert any("batch of 2" in n for n in o.stats.notes), o.stats.notes
    padded = pad_rows([inputs, other], "left")  # `other` is the shorter: its row starts with padding
    one = {**other, **{k: padded[k][1:] for k in ("input_ids", "attention_mask", "mm_token_type_ids")}}
    assert pipe.generate(one, **gen).sequences.tolist() == alone[1].tolist()
    with pytest.raises(InputError, match="seed apply to one prompt but 2 were given"):
        pipe.generate([inputs, other], seed=0, **gen)


def test_a_batch_that_cannot_be_cut_is_refused(pair, inputs) -> None:
    holed = dict(inputs)
    mask = inputs["attention_mask"].clone()
    mask[0, 2] = 0
    holed["attention_mask"] = mask
    with pytest.raises(InputError, match="row 0's attention_mask has holes; only left or right padding"):
        builder(pair).build().generate(holed, max_new_tokens=4, do_sample=False)
    two = {k: torch.cat([v, v]) for k, v in inputs.items()}
    two["pixel_values_videos"] = inputs["pixel_values_videos"]  # one video for two rows that show one each
    two["video_grid_thw"] = inputs["video_grid_thw"]
    two["second_per_grid_ts"] = inputs["second_per_grid_ts"]
    with pytest.raises(InputError, match="row 1 holds .* placeholders of token .* but its items fill 0"):
        builder(pair).build().generate(two, max_new_tokens=4, do_sample=False)
    with pytest.raises(InputError, match="cannot split the padded batch's extra_key by row"):
        builder(pair).build().generate({**two, "extra_key": torch.zeros(2)}, max_new_tokens=4)


def test_missing_mm_token_type_ids_is_refused(pair, inputs) -> None:
    missing = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
    with pytest.raises(InputError, match="no mm_token_type_ids"):
        builder(pair).build().generate(missing, max_new_tokens=4, do_sample=False)


def test_inputs_without_input_ids(pair) -> None:
    with pytest.raises(InputError, match="with input_ids"):
        builder(pair).build().generate({"pixel_values_videos": torch.zeros(1)}, max_new_tokens=4)


# ---- PipelineBuilder.from_config -----------------------------------------------------------------

CONFIG = {
    "selector": {"name": "random", "keep_ratio": 0.3, "seed": 7},
    "scheduler": {"name": "serial", "options": {"gamma": 3}},
    "drafter": "chain",
    "verifier": "rejection",
}


def _choices(pipe: hippo.Pipeline) -> dict:
    parts = ("scorer", "selector", "drafter", "verifier", "scheduler")
    return {
        "names": dict(pipe.names),
        **{k: (type(getattr(pipe, k)), getattr(getattr(pipe, k), "config", None)) for k in parts},
    }


def test_from_config_dict_object_and_file_agree(pair, inputs, tmp_path: Path) -> None:
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(CONFIG))
    config = PipelineConfig(
        selector=PartSpec("random", {"keep_ratio": 0.3, "seed": 7}),
        scheduler=PartSpec("serial", {"gamma": 3}),
        drafter="chain",
        verifier="rejection",
    )
    pipes = [
        PipelineBuilder.from_config(src).target(pair[0]).draft(pair[1]).build()
        for src in (CONFIG, config, path, str(path))
    ]
    choices = [_choices(p) for p in pipes]
    assert all(c == choices[0] for c in choices[1:])
    assert choices[0]["names"] == {
        "scorer": "auto",
        "selector": "random",
        "drafter": "chain",
        "verifier": "rejection",
        "scheduler": "serial",
    }
    assert pipes[0].selector.config.keep_ratio == 0.3 and pipes[0].scheduler.config.gamma == 3
    outs = [p.generate(inputs, max_new_tokens=NEW, do_sample=False).sequences for p in pipes]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_from_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown option.*selectr"):
        PipelineBuilder.from_config({"selectr": "uniform"})
    with pytest.raises(ConfigError, match=r"selector 'uniform'.*keep_ratio"):
        PipelineBuilder.from_config({"selector": {"name": "uniform", "keep_ratio": 2}})
    with pytest.raises(ConfigError, match="needs a 'name' key"):
        PipelineBuilder.from_config({"selector": {"keep_ratio": 0.2}})
    with pytest.raises(ConfigError, match="does not exist"):
        PipelineBuilder.from_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{selector: uniform")
    with pytest.raises(ConfigError, match="is not valid json"):
        PipelineBuilder.from_config(bad)
    with pytest.raises(ConfigError, match="dtype 'float8'"):
        PipelineBuilder.from_config({"dtype": "float8"})


# ---- checkpoints (save_pretrained -> from_pretrained) --------------------------------------------


def test_checkpoint_round_trip(pair, inputs, reference, checkpoints) -> None:
    target_dir, draft_dir = checkpoints
    in_memory = builder(pair).selector("uniform", keep_ratio=0.5).scheduler("serial", gamma=3).build()
    from_disk = (
        PipelineBuilder()
        .target(str(target_dir))
        .draft(draft_dir)
        .selector("uniform", keep_ratio=0.5)
        .scheduler("serial", gamma=3)
        .build()
    )
    assert from_disk.target.dtype == torch.float64
    a = in_memory.generate(inputs, max_new_tokens=NEW, do_sample=False).sequences
    b = from_disk.generate(inputs, max_new_tokens=NEW, do_sample=False).sequences
    assert torch.equal(a, b) and torch.equal(a, reference)


def test_checkpoint_paths_in_a_config_file(inputs, reference, checkpoints, tmp_path: Path) -> None:
    target_dir, draft_dir = checkpoints
    path = tmp_path / "pipeline.json"
    path.write_text(
        json.dumps({**CONFIG, "target": str(target_dir), "draft": str(draft_dir), "dtype": "float64"})
    )
    pipe = PipelineBuilder.from_config(path).build()
    assert pipe.target.dtype == torch.float64 and pipe.draft.dtype == torch.float64
    assert torch.equal(pipe.generate(inputs, max_new_tokens=NEW, do_sample=False).sequences, reference)


def test_checkpoint_without_weights(checkpoints, tmp_path: Path) -> None:
    bare = tmp_path / "no-weights"
    bare.mkdir()
    shutil.copy(checkpoints[0] / "config.json", bare / "config.json")
    with pytest.raises(ModelError, match=r"has no weights \(\*\.safetensors or \*\.bin\)"):
        PipelineBuilder().target(bare).scheduler("autoregressive").build()


def test_checkpoint_without_config(checkpoints, tmp_path: Path) -> None:
    bare = tmp_path / "no-config"
    bare.mkdir()
    for f in checkpoints[0].glob("*.safetensors"):
        shutil.copy(f, bare / f.name)
    with pytest.raises(ModelError, match="has no config.json"):
        PipelineBuilder().target(bare).scheduler("autoregressive").build()


def test_checkpoint_path_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="is not a directory"):
        PipelineBuilder().target(tmp_path / "nowhere").scheduler("autoregressive").build()


@pytest.mark.xdist_group("processes")
def test_draft_vocabulary_padded_differently_is_accepted():
    """Real pairs differ only by embedding padding (Qwen2.5-VL 3B: 151936 rows, 7B: 152064)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from hippo.adapters.qwen2_5_vl_tiny import synthetic_inputs, tiny_config, tiny_model

    target = tiny_model("target", dtype=torch.float64)
    for rows in (161, 159):  # padded beyond, and short of, the target's 160
        cfg = tiny_config("draft")
        cfg.text_config.vocab_size = rows
        torch.manual_seed(1)
        draft = Qwen2_5_VLForConditionalGeneration(cfg).double().eval()
        inputs = synthetic_inputs(target, torch.rand(2, 56, 56, 3), [1, 10], [13])
        ref = target.generate(**inputs, max_new_tokens=10, do_sample=False)
        if rows < 160:  # p may emit an id q has no row for: q's session feeds it as its last id
            adapter = lookup("adapters", "qwen2_5_vl")(draft)
            session = adapter.prefill(adapter.encode(inputs), None)
            start = session.length
            missing = session.forward(torch.tensor([159]))  # [1, V]
            session.rollback(start)
            assert torch.equal(missing, session.forward(torch.tensor([rows - 1])))
        for scheduler, options in (("serial", {}), ("pearl", {}), ("hippo", {"executor": "process"})):
            pipe = hippo.PipelineBuilder().target(target).draft(draft).scheduler(scheduler, **options).build()
            try:
                assert torch.equal(pipe.generate(inputs, max_new_tokens=10, do_sample=False).sequences, ref)
                # sampling compares p and q row by row: both must be over the target's 160 ids
                out = pipe.generate(inputs, max_new_tokens=10, do_sample=True, seed=0)
                assert int(out.sequences.max()) < 160 and not out.stats.fallback  # no padding id of the draft
            finally:
                pipe.close()
