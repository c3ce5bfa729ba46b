"""A decoder with its KV cache, addressed by logical sequence positions."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from hippo.interfaces import ModelSession

#: (start, k) -> position ids [P, 1, k] for the logical tokens start .. start+k-1 after the prompt
PositionFn = Callable[[int, int], torch.Tensor]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class KVSession(ModelSession):
    """Feeds tokens to a prefilled transformers model and crops its cache on rollback.

    The cache may hold fewer entries than `length` (a pruned draft): `length - cache_len` is fixed
    at prefill time, and every later token adds one entry to both.
    """

    def __init__(
        self,
        model: Any,
        cache: Any,  # transformers Cache
        last_logits: torch.Tensor,  # [V]
        length: int,  # logical prompt length
        prompt_length: int,
        positions: PositionFn,
    ):
        self.model = model
        self.cache = cache
        self.prompt_logits = last_logits
        self.last_logits = last_logits
        self.length = length
        self.prompt_length = prompt_length
        self.positions = positions
        self.device = last_logits.device
        self.generated: list[int] = []
        self.seconds_decode = 0.0
        self.forwards = 0

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [k] -> [k, V]
        t0 = time.perf_counter()
        ids = tokens.to(self.device, torch.long).view(1, -1)
        pos = self.positions(self.length, ids.shape[1]).to(self.device)
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True)
        logits = out.logits[0]
        self.length += ids.shape[1]
        self.generated.extend(ids[0].tolist())
        self.last_logits = logits[-1]
        synchronize(self.device)
        self.seconds_decode += time.perf_counter() - t0
        self.forwards += 1
        return logits

    def rollback(self, length: int) -> None:
        if length < self.prompt_length:
            raise ValueError(f"cannot roll back into the prompt ({length} < {self.prompt_length})")
        drop = self.length - length
        if drop < 0:
            raise ValueError(f"cannot roll forward: session has {self.length} tokens, asked for {length}")
        if drop:
            self.cache.crop(-drop)
            self.length = length
            del self.generated[length - self.prompt_length :]
            # logits after an earlier token are not kept: only the prompt's are known again
            self.last_logits = self.prompt_logits if length == self.prompt_length else None

    def close(self) -> None:
        self.cache = None
