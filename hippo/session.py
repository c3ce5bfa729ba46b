"""A decoder with its KV cache, addressed by logical sequence positions, and `PackedSessions`, the session
kind that runs its few-token forwards on packed linear weights (`hippo.packed`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import attrs
import torch

from hippo.errors import ConfigError, UnsupportedError
from hippo.forward import embeddable, embedding_rows, step_logits
from hippo.gqa import grouped_query_sdpa
from hippo.interfaces import ModelSession
from hippo.kvcache import keep_rows
from hippo.packed import MAX_ROWS, PackedLinears
from hippo.placement import input_device, output_device

#: (start, k) -> position ids [P, 1, k] for the logical tokens start .. start+k-1 after the prompt
PositionFn = Callable[[int, int], torch.Tensor]


def synchronize(device: torch.device) -> None:
    """Wait for this thread's work on `device`: its current CUDA stream only. A draft on a side
    stream (`inline`'s thread overlap) then never waits for the target's kernels, nor they for it
    (`torch.cuda.synchronize` would wait for every stream of the device)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


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
        direct: bool = False,  # the adapter's `direct_steps`: logits = head(decoder(...))
    ):
        self.model = model
        self.cache = cache
        # every logits row of the session on one device, the head's: a target spread by a device map
        # may return its prefill's logits to the inputs' device (accelerate's io_same_device)
        self.logits_device = output_device(model)
        last_logits = last_logits.to(self.logits_device)
        self.prompt_logits = last_logits
        self.last_logits = last_logits
        self.length = length
        self.prompt_length = prompt_length
        self.positions = positions
        self.device = input_device(model)  # where inputs go; logits come from the head's device
        self.generated: list[int] = []
        self.seconds_decode = 0.0
        self.forwards = 0
        self.tokens_forwarded = 0  # tokens fed by the forwards after the prefill (k per forward)
        self._block: tuple[int, torch.Tensor, torch.Tensor] | None = None  # forward_masked, until keep
        self.packed: PackedLinears | None = None  # packed linear weights (set by PackedSessions) ...
        self.packed_rows = 0  # ... for forwards of up to packed_rows tokens
        self.embedding_rows = embedding_rows(model)  # ids past them are fed as the last (`embeddable`)
        self.direct = (model.get_decoder(), model.get_output_embeddings()) if direct else None

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor | Sequence[int], record: bool = True
    ) -> torch.Tensor:  # [k] -> [k, V]
        """Feed `tokens` (a tensor, or ints the caller holds on the host). A tensor on the host is read
        before it is moved, so a device's copy is never read back. `record=False`: a tensor is fed
        as it is, never read, and not added to `generated` (a caller that tracks the tokens itself,
        `hippo.stacked.SessionRow`; `sync` is then not for this session)."""
        t0 = time.perf_counter()
        if isinstance(tokens, torch.Tensor):
            host = tokens.reshape(-1).tolist() if record and tokens.device.type == "cpu" else None
        else:
            host = [int(t) for t in tokens]
        ids = (torch.tensor(host) if host is not None else tokens).to(self.device, torch.long).view(1, -1)
        pos = self.positions(self.length, ids.shape[1]).to(self.device)
        self._reserve(ids.shape[1])
        logits = self._step(embeddable(ids, self.embedding_rows), pos)
        self.length += ids.shape[1]
        if record:
            self.generated.extend(host if host is not None else ids[0].tolist())
        self.last_logits = logits[-1]
        synchronize(logits.device)  # the last device of a target spread over several
        self.seconds_decode += time.perf_counter() - t0
        self.forwards += 1
        self.tokens_forwarded += ids.shape[1]
        return logits

    def _step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # ids [1, k] -> logits [k, V]
        with self._kernels(ids.shape[1]), grouped_query_sdpa(self.device):
            return self._logits(input_ids=ids, position_ids=pos)[0].to(self.logits_device)

    def _logits(self, **inputs: Any) -> torch.Tensor:  # -> [1, k, V]
        return step_logits(self.model, self.direct, self.cache, **inputs)

    def _kernels(self, rows: int) -> Any:
        """Where a forward of `rows` tokens runs its linear layers (`hippo.packed`)."""
        return nullcontext() if self.packed is None else self.packed.rows(rows, self.packed_rows)

    def _reserve(self, k: int) -> None:
        """Make room for k more cache entries before a forward (a dynamic cache grows by itself)."""

    def cache_len(self) -> int:
        """KV entries held (fewer than `length` for a pruned draft)."""
        return int(self.cache.get_seq_length())

    def _block_mask(self, past: int, visible: torch.Tensor) -> torch.Tensor:  # [k, k] -> [k, past + k]
        k = visible.shape[0]
        allowed = torch.ones(k, past + k, dtype=torch.bool)
        allowed[:, past:] = visible
        return allowed

    @torch.inference_mode()
    def forward_masked(
        self,
        tokens: torch.Tensor,  # [k] long
        offsets: torch.Tensor,  # [k] long: logical position length + offsets[i]
        visible: torch.Tensor,  # [k, k] bool: [i, j] = token i attends to block token j
    ) -> torch.Tensor:  # -> [k, V]
        t0 = time.perf_counter()
        k = int(tokens.shape[0])
        past = self.cache_len()
        span = int(offsets.max()) + 1 if k else 0
        pos = self.positions(self.length, span)[..., offsets]  # [P, 1, k] or [1, k]
        dtype = next(self.model.parameters()).dtype
        self._reserve(k)
        allowed = self._block_mask(past, visible)  # [k, kv]
        mask = torch.zeros(allowed.shape, dtype=dtype)  # [k, kv] additive
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        with self._kernels(k), grouped_query_sdpa(self.device):
            logits = self._logits(
                input_ids=embeddable(tokens.to(self.device, torch.long).view(1, -1), self.embedding_rows),
                position_ids=pos.to(self.device),
                attention_mask=mask[None, None].to(self.device),
            )[0].to(self.logits_device)
        synchronize(logits.device)
        self.seconds_decode += time.perf_counter() - t0
        self.forwards += 1
        self.tokens_forwarded += k
        self._block = (past, tokens.cpu(), logits)
        return logits

    @torch.inference_mode()
    def keep(self, rows: Sequence[int]) -> None:
        past, tokens, logits = self._block
        self._block = None
        layers = getattr(self.cache, "layers", None)
        if layers is None:
            raise UnsupportedError("keeping rows of a masked block needs a transformers Cache with `.layers`")
        rows = torch.as_tensor(list(rows), dtype=torch.long)  # [r]
        self._compact(past, rows)
        if rows.numel():
            self.length += int(rows.shape[0])
            self.generated.extend(tokens[rows].tolist())
            self.last_logits = logits[int(rows[-1])]

    def _compact(self, past: int, rows: torch.Tensor) -> None:  # rows [r]: block rows to keep, in order
        keep_rows(self.cache, past, rows)

    def extend_prompt(self, tokens: torch.Tensor) -> None:  # tokens [k]
        """Feed `tokens` as more prompt (a question after a cached video prefix): afterwards the
        prompt ends after them, and their forward counts as prefill, not decoding."""
        if self.generated:
            raise ValueError("extend_prompt must come before any generated token")
        if tokens.numel():
            self.forward(tokens)
        self.prompt_length, self.prompt_logits = self.length, self.last_logits
        self.generated, self.seconds_decode, self.forwards = [], 0.0, 0

    def rollback(self, length: int) -> None:
        if length < self.prompt_length:
            raise ValueError(f"cannot roll back into the prompt ({length} < {self.prompt_length})")
        drop = self.length - length
        if drop < 0:
            raise ValueError(f"cannot roll forward: session has {self.length} tokens, asked for {length}")
        if drop:
            self._crop(drop)
            self.length = length
            del self.generated[length - self.prompt_length :]
            # logits after an earlier token are not kept: only the prompt's are known again
            self.last_logits = self.prompt_logits if length == self.prompt_length else None

    def _crop(self, drop: int) -> None:
        self.cache.crop(-drop)

    def close(self) -> None:
        self.cache = None


@attrs.frozen
class PackedSessions:
    """Run a role's prefill, and its sessions' forwards of 2..`max_rows` tokens, on packed linear weights.

    `open` gives a prefilled `KVSession` its model's packing; a model it cannot pack (not CPU fp32,
    no oneDNN) or another kind of session runs as before, so the default costs nothing there.
    `then`: the role's static-cache kind (`hippo.static`), applied first.
    """

    max_rows: int = attrs.field(default=MAX_ROWS)
    then: Any = None

    @max_rows.validator
    def _max_rows(self, _attr, value):
        if not isinstance(value, int) or isinstance(value, bool) or value < 2:
            raise ConfigError(f"pack max_rows must be an int >= 2 (tokens of one forward), got {value!r}")

    def prefilling(self, model: torch.nn.Module) -> Any:
        """The context the role's prefill runs in: on the packed weights too (`PackedLinears.prefill`)."""
        return PackedLinears.of(model).prefill()

    def open(self, session: Any, new_tokens: int) -> Any:
        if self.then is not None:
            session = self.then.open(session, new_tokens)
        if isinstance(session, KVSession):  # another session kind (a plugin's) runs as it is
            session.packed, session.packed_rows = PackedLinears.of(session.model), self.max_rows
        return session
