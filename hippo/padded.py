"""The rows of a padded processor batch, each as the batch-1 mapping its processor would return.

A processor called on several prompts pads `input_ids` [B, L] (left or right; `attention_mask`
marks the real tokens) and concatenates the rows' media along their first dimension: Qwen's pixel
patches, LLaVA's videos, audio chunks. The rows are cut apart by counting placeholder tokens: each
medium is a run of items in batch order, item i fills `tokens[i]` placeholders of `token` in its
row's ids and takes `extent[key][i]` entries of each of its tensors. The adapter that knows the
layout names the items (`Adapter.batch_items`); this module does the cutting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

import torch

from hippo.errors import InputError
from hippo.types import Items

#: keys aligned with input_ids ([B, L]) that are cut along with it
SEQUENCE_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


def split_rows(inputs: Mapping[str, Any], media: Sequence[Items]) -> list[dict[str, Any]]:
    """Cut a padded batch into its rows: each row's real tokens (the attention mask's ones, which must
    be one run) and its own items of every medium. Any other key is refused rather than guessed at."""
    ids = inputs.get("input_ids")  # [B, L]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise InputError(f"input_ids must be a [B, L] tensor, got {shape}")
    mask = inputs.get("attention_mask")  # [B, L] or None
    if mask is None:
        mask = torch.ones_like(ids)
    if tuple(mask.shape) != tuple(ids.shape):
        raise InputError(f"attention_mask is {tuple(mask.shape)} but input_ids is {tuple(ids.shape)}")
    known = set(SEQUENCE_KEYS) | {key for m in media for key in m.extent}
    unknown = sorted(k for k, v in inputs.items() if k not in known and v is not None)
    if unknown:
        raise InputError(
            f"cannot split the padded batch's {', '.join(unknown)} by row; pass one processor output "
            "per row (a list) instead"
        )
    keys = [key for key in SEQUENCE_KEYS if inputs.get(key) is not None]
    rows = []
    for b in range(ids.shape[0]):
        first, last = _tokens(mask[b], b)
        rows.append({key: inputs[key][b : b + 1, first:last] for key in keys})
    for m in media:
        counts = [int((row["input_ids"] == m.token).sum()) for row in rows]
        spans = _assign(list(m.tokens), counts, m.token)
        for key, extent in m.extent.items():
            value = inputs.get(key)
            if value is None:
                continue
            if len(extent) != len(m.tokens):
                raise InputError(f"{key} describes {len(extent)} items but there are {len(m.tokens)}")
            starts = [0, *accumulate(int(n) for n in extent)]
            if len(value) != starts[-1]:
                raise InputError(f"{key} has {len(value)} entries but its items take {starts[-1]}")
            for row, (first, last) in zip(rows, spans):
                if first == last:  # none of this medium in the row: its batch-1 output has no such key
                    continue
                part = value[starts[first] : starts[last]]
                row[key] = part if isinstance(value, torch.Tensor) else list(part)
    return rows


def _tokens(real: torch.Tensor, b: int) -> tuple[int, int]:  # real [L] -> [first, last) of row b's tokens
    where = real.nonzero().flatten()
    if where.numel() == 0:
        raise InputError(f"row {b} of the batch has no tokens (its attention_mask is all zeros)")
    first, last = int(where[0]), int(where[-1]) + 1
    if where.numel() != last - first:
        raise InputError(f"row {b}'s attention_mask has holes; only left or right padding can be cut")
    return first, last


def _assign(tokens: list[int], counts: list[int], token: int) -> list[tuple[int, int]]:
    """Items [first, last) of each row: consecutive items whose placeholders add up to the row's."""
    spans, i = [], 0
    for b, want in enumerate(counts):
        first, got = i, 0
        while got < want and i < len(tokens):
            got += tokens[i]
            i += 1
        if got != want:
            raise InputError(
                f"row {b} holds {want} placeholders of token {token} but its items fill {got}; "
                "build the batch's ids and media with one processor call"
            )
        spans.append((first, i))
    if i != len(tokens):
        raise InputError(f"the batch has {len(tokens)} items for token {token} but its rows place {i}")
    return spans


def pad_rows(rows: list[dict[str, Any]], side: str = "left", pad_id: int = 0) -> dict[str, Any] | None:
    """`split_rows` undone: the batch a processor returns for these batch-1 rows, the prompt's keys
    padded to the longest on `side` (attention_mask 0 there; input_ids `pad_id`), every other tensor
    concatenated along dim 0 and lists joined. None when the rows cannot be one batch (their media
    differ in shape past dim 0, or the rows have different keys)."""
    rows = [{"attention_mask": torch.ones_like(r["input_ids"]), **r} for r in rows]
    keys = set(rows[0])
    if any(set(r) != keys for r in rows):
        return None
    L = max(int(r["input_ids"].shape[1]) for r in rows)
    batch: dict[str, Any] = {}
    for key in sorted(keys):
        values = [r[key] for r in rows]
        if key in SEQUENCE_KEYS:  # padded with the prompt; the rest is concatenated
            fill = pad_id if key == "input_ids" else 0
            out = torch.full((len(rows), L), fill, dtype=values[0].dtype)
            for b, v in enumerate(values):
                n = v.shape[1]
                out[b, slice(L - n, L) if side == "left" else slice(0, n)] = v[0]
            batch[key] = out
        elif isinstance(values[0], torch.Tensor):
            if len({tuple(v.shape[1:]) for v in values}) > 1:
                return None
            batch[key] = torch.cat(values)
        else:
            batch[key] = [x for v in values for x in v]
    return batch
