"""Training's batches prepared in worker processes (`train.phase_batches`) are the ones the training
process prepares itself, the distillation teacher's answers included, so `--workers` does not change
the checkpoints."""

from __future__ import annotations

import dataclasses

import torch

from hippo.benchmarks.tokenizer import build_tokenizer
from hippo.benchmarks.train import Phase, TrainConfig, phase_batches
from hippo.cli.pair.checkpoint import NARRATE_DIR


def _fields(batch) -> dict:
    out = {k: v for k, v in dataclasses.asdict(batch).items() if k != "token_labels"}
    return {**out, **{f"label {k}": v for k, v in batch.token_labels.items()}}


def test_batches_from_workers_equal_the_in_process_ones():
    teacher = str(NARRATE_DIR / "target")
    phase = Phase("distil", 2, [(112, 32, 2), (112, 32, 1)], task="narrate", teacher=teacher)
    cfg = TrainConfig(role="draft", phases=[phase])
    tokenizer = build_tokenizer()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers take this process's thread count
    try:
        with phase_batches(cfg, 0, 0, tokenizer) as here:
            expected = [_fields(b) for b in here]
        with phase_batches(cfg, 0, 1, tokenizer) as ahead:
            got = [_fields(b) for b in ahead]
    finally:
        torch.set_num_threads(threads)
    assert [b["captions"].shape[0] for b in expected] == [2, 1]
    answers = [tokenizer.decode(row[:12]) for b in expected for row in b["captions"]]
    assert all(a.startswith("step one :") for a in answers), answers  # the teacher's narration
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for k in e:
            assert torch.equal(g[k], e[k]) if isinstance(e[k], torch.Tensor) else g[k] == e[k], k


def test_attention_loss_reads_the_models_own_attention():
    """`train.attention_loss` recomputes one head's attention from the layer's inputs: it must be the
    attention the model itself computes (eager attention, float64), on the right answer positions,
    with the visual tokens pruned or not."""
    from hippo.benchmarks.batching import lm_inputs, make_batch, select_kept
    from hippo.benchmarks.models import new_model
    from hippo.benchmarks.train import AuxHeads, step_loss
    from hippo.cli.pair.narration import narration_config, narration_sample

    model = new_model("target", seed=0).double()
    model.set_attn_implementation("eager")
    tokenizer = build_tokenizer()
    cfg = TrainConfig(attend_at=(2, 1))
    samples = [narration_sample(s, narration_config(84, 8), ask=("all", None)) for s in (3, 4)]
    batch = make_batch(tokenizer, samples)
    batch.pixels = batch.pixels.double()
    aux = AuxHeads(model.config.text_config.hidden_size, cues=True).double()
    gen = torch.Generator().manual_seed(0)
    N = batch.video_rows.numel()
    for keep in (
        None,
        torch.stack(
            [select_kept(N, N // 2, "salient", batch.token_labels["colour"][b], gen) for b in range(2)]
        ),
    ):
        loss = step_loss(model, aux, batch, cfg, keep, attend=True)[3]
        embeds, positions, vis_rows, _ = lm_inputs(model, batch, keep)
        out = model.model.language_model(inputs_embeds=embeds, position_ids=positions, output_attentions=True)
        probs = out.attentions[2][:, 1]  # [B, L, L]
        Lc = batch.captions.shape[1]
        labels = {k: v if keep is None else v.gather(1, keep) for k, v in batch.token_labels.items()}
        masses = []
        for b in range(2):
            for i in range(Lc):
                colour, step, cell = batch.attend[b, i].tolist()
                on = (labels["colour"][b] == colour) & (labels["step"][b] == step)
                if bool((on & (labels["cell"][b] == cell)).any()):
                    on = on & (labels["cell"][b] == cell)  # the object's tokens in the named cell
                if colour and bool(on.any()):
                    masses.append(probs[b, probs.shape[1] - Lc - 1 + i, vis_rows[on]].sum())
        assert len(masses) > 20
        # eager attention takes its softmax in float32: agreement to ~1e-8, where a wrong head,
        # position or token set is off by far more
        assert abs(float(loss + torch.stack(masses).log().mean())) < 1e-6


def test_needle_loss_reads_each_needles_mean_vision_feature():
    """`train.needle_loss`: the vision shape head on each needle's mean feature over its tokens of
    known shape, one cross-entropy term per needle; per-label weights of 1 leave the auxiliary loss as
    it was."""
    from hippo.benchmarks.train import AuxHeads, needle_loss

    torch.manual_seed(0)
    aux = AuxHeads(8, cues=True, global_labels=("step",)).double()
    step = torch.tensor([[0, 1, 1, 1, 2, 2, 0, 3]])
    shape = torch.tensor([[0, 2, 2, -1, 3, 3, 0, -1]])  # needle 3: no token of known shape
    labels = {"step": step, "shape": shape, "colour": (step > 0).long(), "motion": step.clamp(max=1)}
    feats = torch.randn(1, 8, 8, dtype=torch.float64)
    head = aux.heads["vision_shape"]
    pooled = torch.stack([feats[0, 1:3].mean(0), feats[0, 4:6].mean(0)])
    expected = torch.nn.functional.cross_entropy(head(pooled), torch.tensor([2, 3]))
    assert torch.allclose(needle_loss(aux, feats, labels), expected)
    plain = aux.loss("vision", feats, labels, 4.0)
    assert torch.equal(aux.loss("vision", feats, labels, 4.0, {"shape": 1.0}), plain)
    assert not torch.allclose(aux.loss("vision", feats, labels, 4.0, {"shape": 8.0}), plain)


def test_deepened_vision_encoder_computes_the_same_features_and_reloads(tmp_path):
    """`train.deepen_vision`: new blocks first, each an identity until trained; the config follows."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from hippo.benchmarks.batching import make_batch
    from hippo.benchmarks.train import deepen_vision
    from hippo.cli.pair.lists import lists_sample
    from hippo.cli.pair.niah import NiahConfig

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(NARRATE_DIR / "target", dtype=torch.float32)
    batch = make_batch(build_tokenizer(), [lists_sample(1, NiahConfig(size=84, frames=32))])
    with torch.no_grad():
        before = model.model.visual(batch.pixels, grid_thw=batch.grid).pooler_output
        depth = len(model.model.visual.blocks)
        deepen_vision(model, depth + 2)
        after = model.model.visual(batch.pixels, grid_thw=batch.grid).pooler_output
        model.save_pretrained(tmp_path)
        again = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
        reloaded = again.model.visual(batch.pixels, grid_thw=batch.grid).pooler_output
    assert len(again.model.visual.blocks) == depth + 2
    assert torch.equal(after, before) and torch.equal(reloaded, before)
