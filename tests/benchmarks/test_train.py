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
