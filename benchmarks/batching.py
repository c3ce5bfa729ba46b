"""Batches of task samples as the language model sees them, with optional visual-token pruning.

Training does not go through `model.forward`: it embeds the prompt, scatters the vision encoder's
features into the `<|video_pad|>` rows, and runs the language model on `inputs_embeds` with
explicit 3-D positions, the prompt's from `get_rope_index` and the caption's from the prompt's
last position + 1 on, which is what `generate()` does in transformers 5.23 (not max(position) + 1:
the two differ when the video's time positions run past the text after it, as in the narration
clips, and a pair trained on max + 1 narrates nonsense through `generate`). A pruned draft gets only the kept
visual rows, each with its original position, as hippo's Qwen2.5-VL adapter passes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hippo.adapters.qwen2_5_vl import frames_to_pixel_values
from hippo.benchmarks.tokenizer import caption_ids, prompt_ids, seconds_per_grid
from hippo.cli.pair.narration import attention_targets
from hippo.cli.pair.task import CLIP_SECONDS, Sample

IGNORE = -100


@dataclass
class Batch:
    pixels: torch.Tensor  # [B * P, 1176]
    grid: torch.Tensor  # [B, 3]
    prompt: torch.Tensor  # [Lp] the same for every sample
    video_rows: torch.Tensor  # [N] rows of the prompt holding <|video_pad|>
    captions: torch.Tensor  # [B, Lc] caption ids and <|im_end|>, padded
    labels: torch.Tensor  # [B, Lc] the same, IGNORE on padding
    token_labels: dict[str, torch.Tensor]  # name -> [B, N] per visual token, 0 = background
    seconds_per_grid: float = 1.0  # second_per_grid_ts of every video in the batch
    #: [B, Lc, 3] per answer token, the object, step and cell it describes, (colour + 1, step + 1,
    #: cell + 1) as the visual tokens' labels (`narration.attention_targets`; 0: none); narration only
    attend: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.captions.shape[0]


def make_batch(tokenizer, samples: list[Sample]) -> Batch:
    pix, grids = zip(*(frames_to_pixel_values(s.video) for s in samples))
    grid = torch.cat(grids)
    assert bool((grid == grid[:1]).all()), "a batch holds videos of one size"
    n = int(grid[0].prod()) // 4
    assert all(s.question == samples[0].question and s.fps == samples[0].fps for s in samples), (
        "a batch holds one question and one frame rate"
    )
    prompt = torch.tensor(prompt_ids(tokenizer, n, samples[0].question))
    video_rows = (prompt == tokenizer.convert_tokens_to_ids("<|video_pad|>")).nonzero().flatten()
    caps = [caption_ids(tokenizer, s.caption) for s in samples]
    Lc = max(map(len, caps))
    captions = torch.full((len(caps), Lc), tokenizer.pad_token_id)
    labels = torch.full((len(caps), Lc), IGNORE)
    for i, c in enumerate(caps):
        captions[i, : len(c)] = torch.tensor(c)
        labels[i, : len(c)] = torch.tensor(c)
    names = samples[0].token_labels.keys()
    token_labels = {k: torch.stack([s.token_labels[k] for s in samples]) for k in names}
    spg = seconds_per_grid(samples[0].fps or samples[0].video.shape[0] / CLIP_SECONDS)
    attend = None
    if "step" in names:  # narration: each answer word is one token (the benchmark tokenizer)
        attend = torch.zeros(len(caps), Lc, 3, dtype=torch.long)
        for i, s in enumerate(samples):
            targets = s.attend if getattr(s, "attend", None) is not None else attention_targets(s)
            if targets and len(targets) == len(caps[i]) - 1:  # else the answer is not one token per word
                attend[i, : len(targets)] = torch.tensor(targets)
    return Batch(torch.cat(pix), grid, prompt, video_rows, captions, labels, token_labels, spg, attend)


def prompt_positions(model, batch: Batch) -> tuple[torch.Tensor, int]:
    """-> ([3, Lp] M-RoPE positions of the prompt, the first generated token's position)."""
    ids = batch.prompt[None]
    types = torch.zeros_like(ids)
    types[0, batch.video_rows] = 2
    pos, _ = model.model.get_rope_index(
        ids,
        mm_token_type_ids=types,
        video_grid_thw=batch.grid[:1],
        second_per_grid_ts=torch.tensor([batch.seconds_per_grid]),
    )
    return pos[:, 0], int(pos[:, 0, -1].max()) + 1


def select_kept(
    n: int, k: int, strategy: str, labels: torch.Tensor | None, gen: torch.Generator
) -> torch.Tensor:  # -> [k] sorted visual indices
    """Visual tokens a pruned draft keeps in training: random, uniform stride, or salient (most of the
    object tokens, as a good scorer keeps, topped up at random)."""
    if strategy == "uniform":
        offset = float(torch.rand(1, generator=gen)) * n / k
        return (torch.arange(k) * (n / k) + offset).long().clamp(max=n - 1)  # strictly increasing: n / k >= 1
    score = torch.rand(n, generator=gen)
    if strategy == "salient" and labels is not None:
        keep_obj = torch.rand(n, generator=gen) < 0.85
        score = score + 2.0 * ((labels > 0) & keep_obj).float()
    return score.topk(k).indices.sort().values


def lm_inputs(
    model,
    batch: Batch,
    keep: torch.Tensor | None = None,  # [B, k] kept visual indices, or None for all
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (inputs_embeds [B, L, D], positions [3, B, L], rows of the visual tokens [k'], visual features [B, N, D]).

    The sequence is the prompt (pruned if `keep` is given) followed by the teacher-forced caption.
    """
    core = model.model
    B = batch.size
    feats = core.visual(batch.pixels.to(model.dtype), grid_thw=batch.grid).pooler_output  # [B * N, D]
    N = batch.video_rows.numel()
    feats = feats.view(B, N, -1)
    prompt_pos, first = prompt_positions(model, batch)
    embeds = core.get_input_embeddings()(batch.prompt).expand(B, -1, -1).clone()  # [B, Lp, D]
    embeds[:, batch.video_rows] = feats
    positions = prompt_pos[:, None].expand(3, B, -1)  # [3, B, Lp]
    vis_rows = batch.video_rows
    if keep is not None:
        Lp = batch.prompt.numel()
        before = int(batch.video_rows[0])  # text before the video, then the video, then text
        rows = torch.cat(
            [
                torch.arange(before).expand(B, -1),
                batch.video_rows[keep],  # [B, k]
                torch.arange(int(batch.video_rows[-1]) + 1, Lp).expand(B, -1),
            ],
            dim=1,
        )  # [B, L']
        embeds = embeds.gather(1, rows[..., None].expand(-1, -1, embeds.shape[-1]))
        positions = prompt_pos[:, rows]  # [3, B, L']
        vis_rows = torch.arange(before, before + keep.shape[1])
    Lc = batch.captions.shape[1]
    cap_embeds = core.get_input_embeddings()(batch.captions)  # [B, Lc, D]
    cap_pos = (torch.arange(Lc) + first).view(1, 1, Lc).expand(3, B, Lc)
    return torch.cat([embeds, cap_embeds], 1), torch.cat([positions, cap_pos], 2), vis_rows, feats
