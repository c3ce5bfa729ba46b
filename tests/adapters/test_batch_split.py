"""A padded processor batch is cut into the rows it was made of, media included, for every backbone."""

from __future__ import annotations

import pytest
import torch

from hippo.errors import InputError
from hippo.padded import pad_rows, split_rows
from hippo.testing import models as hm
from hippo.testing import params as hp


def rows(adapter: str, target, frames: tuple[int, int, int]) -> list[dict]:
    """Rows of different videos and prompt lengths (LLaVA-OneVision concatenates videos of one frame
    count only, so `frames` is the same there)."""
    unit, words = hm.pixel_unit(target), hm.text_ids(target)
    grids = [(frames[0], 2 * unit, 2 * unit), (frames[1], unit, 2 * unit), (frames[2], 2 * unit, unit)]
    text = [(words[3:6], words[7:9]), (words[3:4], words[7:12]), ([], words[1:3])]
    return [hm.Prompt(adapter, target, g, i, *t).inputs for i, (g, t) in enumerate(zip(grids, text))]


@pytest.mark.parametrize("adapter", hp.adapter_params())
def test_split_batch_gives_back_each_row(adapter):
    target = hm.tiny(adapter, "target")
    a = hm.part_class("adapters", adapter)(target)
    frames = (2, 2, 2) if adapter == "llava_onevision" else (2, 1, 3)
    given = rows(adapter, target, frames)
    for side in ("left", "right"):
        for chosen in (given, given[1:], [given[2], given[0]]):
            batch = pad_rows(chosen, side)
            got = split_rows(batch, a.batch_items(batch))
            assert len(got) == len(chosen)
            for row, want in zip(got, chosen):
                assert sorted(row) == sorted({"attention_mask": None, **want})
                for key, value in want.items():
                    same = (
                        torch.equal(row[key], value) if isinstance(value, torch.Tensor) else row[key] == value
                    )
                    assert same, (side, key)


@pytest.mark.parametrize("adapter", hp.adapter_params())
def test_split_batch_refuses_media_that_do_not_match_the_placeholders(adapter):
    target = hm.tiny(adapter, "target")
    a = hm.part_class("adapters", adapter)(target)
    given = rows(adapter, target, (2, 2, 2))[:2]
    batch = pad_rows(given, "left")
    first = {
        k: v if k in ("input_ids", "attention_mask", "mm_token_type_ids") else given[0][k]
        for k, v in batch.items()
    }
    with pytest.raises(InputError, match="row 1 holds .* placeholders of token .* but its items fill 0"):
        split_rows(first, a.batch_items(first))  # the second row's media left out


@pytest.mark.parametrize("adapter", hp.adapter_params())
def test_a_text_only_row_gets_no_media(adapter):
    """A row without a video in a batch with one (a processor call on two prompts and one video) gets
    no media keys: its batch-1 output has none."""
    target = hm.tiny(adapter, "target")
    a = hm.part_class("adapters", adapter)(target)
    video = rows(adapter, target, (2, 2, 2))[0]
    seq = ("input_ids", "attention_mask", "mm_token_type_ids")
    words = torch.tensor([hm.text_ids(target)[3:7]])
    text = {k: words if k == "input_ids" else torch.zeros_like(words) for k in video if k in seq}
    text["attention_mask"] = torch.ones_like(words)
    empty = {k: v[:0] for k, v in video.items() if k not in seq}  # concatenates to the video's alone
    batch = pad_rows([video, {**text, **empty}], "left")
    got = split_rows(batch, a.batch_items(batch))
    assert sorted(got[1]) == sorted(text)
    assert all(torch.equal(got[1][k], text[k]) for k in text)
    assert all(torch.equal(got[0][k], v) for k, v in video.items())
