"""B rows' KV caches of one model stacked on the batch dimension, for the batch engine (`hippo.engine`).

Notation: B = rows, S = cache slots, W = tokens one forward feeds per row, V = vocabulary, P =
position rows (3 for M-RoPE, 1 otherwise).

Each row is prefilled on its own as `generate` prefills it; its batch-1 cache is then copied into
the stack, padded to the longest and carried with a per-row validity mask of the slots:

- a forward feeds W tokens per row (rows with fewer are padded with masked dummy tokens), each row at
  its own positions (its adapter's `positions` function), under a 4-D additive mask [B, 1, W, S + W]
  (the row's valid slots, causal inside the block);
- keys are stored after their rotary embedding, so the order of slots does not matter: a row rolls
  back by marking its rejected slots invalid (no crop), and the cache is compacted (each row's valid
  slots gathered to the front) once the holes pass a threshold;
- a row joins at any time (`join`: its cache is written into the next spare row of the slab,
  `hippo.kvcache.SlabLayer.stack`, padded with zeros) and a finished or cancelled row leaves at once
  (`select`: the kept rows move to the front in place), so a row only costs compute while it is live;
- slots at the end that no row holds any more (rolled back in every row) are cropped, and a forward
  whose rows are all full, with every slot valid, runs without a mask, as a session does: so a
  batch of one row never has holes. The narration pair's serial γ = 5 at batch 1 took 1.095x the
  time of `generate` with holes and a mask, 0.98x without (2-core AMD EPYC, AVX2, 5 alternated
  repeats).

Ragged rows are padded (as BASS pads), not flattened into one sequence of all rows' tokens (as
vLLM feeds its rejection sampler): flattening needs a variable-length attention kernel over paged
caches, while padding keeps the backbone's own transformers forward, which every adapter's
exactness already rests on; the padding costs little because a round feeds at most γ + 1 tokens per
row.

The target's packed linear weights (`hippo.packed`) serve the batched forwards; static-cache
compiled sessions (`hippo.static`) do not: a batch runs on dynamic caches. A job decoded alone keeps
its own session, packed or compiled, as a one-row stack (`SessionRow`: the same calls, one row).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from hippo.cost import VerifyCurve, measure_verify_curve, time_widths
from hippo.errors import UnsupportedError
from hippo.forward import embeddable, step_logits
from hippo.gqa import grouped_query_sdpa
from hippo.interfaces import ModelSession
from hippo.kvcache import SlabLayer
from hippo.packed import PackedLinears

#: compact when at least this share of the cache's slots (beyond the longest row) are holes ...
COMPACT_SHARE = 0.125
#: ... and at least this many
COMPACT_MIN = 16


class BatchedCache:
    """B rows' KV caches of one model, stacked on the batch dimension, each slot valid or not.

    Built from prefilled batch-1 `KVSession`s (their caches are copied; close them afterwards).
    Row b holds `lengths[b]` logical tokens; its prompt fills slots 0 .. `base[b]` - 1 (never rolled
    back) and `slots[b]` lists the cache slot of each token it consumed after its prompt, in order
    (rollback invalidates slots from the end). So the slots a row holds are known on the host, and
    rollback, cropping and compaction read nothing back from `valid`.
    """

    def __init__(
        self, sessions: Sequence[ModelSession], packed: PackedLinears | None = None, max_rows: int = 0
    ):
        if not sessions:
            raise ValueError("a batched cache needs at least one row")
        _check(sessions)
        first = sessions[0]
        self.model, self.device, self.direct = first.model, first.device, first.direct
        self.logits_device = first.logits_device  # the head's: see KVSession
        self.dtype = next(self.model.parameters()).dtype
        self.packed, self.max_rows = packed, max_rows
        self.embedding_rows = first.embedding_rows  # ids past them are fed as the last (`embeddable`)
        self.cache = first.cache  # its layer objects get the stacked tensors (the sessions are spent)
        self.positions: list = []
        self.lengths: list[int] = []
        self.slots: list[list[int]] = []
        self.base: list[int] = []  # each row's prompt slots: 0 .. base[b] - 1
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [B, S]
        self.seconds = 0.0  # wall-clock seconds in forwards
        self.forwards = 0
        self.tokens_forwarded = 0  # the width W of each forward, summed
        self.join(sessions)

    @torch.inference_mode()
    def join(self, sessions: Sequence[ModelSession]) -> None:
        """Add rows after the live ones: the prefilled batch-1 sessions' caches are copied in (close
        the sessions afterwards). Every cache is padded to the longest's slots."""
        _check(sessions)
        sizes = [s.cache_len() for s in sessions]
        S = max(self.size, *sizes)
        for i, layer in enumerate(self.cache.layers):
            if isinstance(layer, SlabLayer):  # written into the slab's spare rows, where it has them
                rows = [(s.cache.layers[i].keys, s.cache.layers[i].values) for s in sessions]
                layer.stack(self.rows, rows, S)
                continue
            keys = [_pad(layer.keys, S)] if self.rows else []  # [B, H, S, D]
            values = [_pad(layer.values, S)] if self.rows else []
            for s in sessions:
                other = s.cache.layers[i]
                keys.append(_pad(other.keys, S))  # [1, H, S, D]
                values.append(_pad(other.values, S))
            layer.keys, layer.values = torch.cat(keys), torch.cat(values)
        old = torch.nn.functional.pad(self.valid, (0, S - self.size))  # [B, S]
        new = torch.arange(S)[None] < torch.tensor(sizes)[:, None]  # [b, S]
        self.valid = torch.cat([old, new])
        self.positions += [s.positions for s in sessions]
        self.lengths += [int(s.length) for s in sessions]
        self.slots += [[] for _ in sessions]
        self.base += sizes

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def seconds_decode(self) -> float:  # as a session's (`hippo.cost.GammaPlan` times steps with it)
        return self.seconds

    @property
    def size(self) -> int:  # S: slots per row
        return int(self.valid.shape[1])

    def _held(self, row: int) -> int:
        """How many slots row `row` holds (its valid ones), from the host's bookkeeping."""
        return self.base[row] + len(self.slots[row])

    def _end(self, row: int) -> int:
        """1 + the last slot row `row` holds (its consumed slots all lie after its prompt's)."""
        return self.slots[row][-1] + 1 if self.slots[row] else self.base[row]

    @torch.inference_mode()
    def forward(self, blocks: Sequence[Sequence[int]]) -> torch.Tensor:  # -> logits [B, W, V]
        """Feed row b the tokens `blocks[b]` at its next logical positions (an empty block: the row
        only carries dummies this time). Column i of row b's logits follows its token i; columns
        from `len(blocks[b])` on are dummies, masked from every real token and invalid afterwards.
        """
        widths = [len(b) for b in blocks]
        ids = torch.zeros(len(blocks), max(widths, default=0), dtype=torch.long)
        for b, toks in enumerate(blocks):
            ids[b, : len(toks)] = torch.as_tensor(list(toks), dtype=torch.long)
        return self.forward_ids(ids, widths)

    @torch.inference_mode()
    def forward_ids(self, ids: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:  # -> logits [B, W, V]
        """`forward` of the tokens `ids` [B, W] (on any device: nothing is read back), row b's first
        `widths[b]` real and the rest dummies."""
        t0 = time.perf_counter()
        B, S = self.rows, self.size
        W = max(widths, default=0)
        if len(widths) != B or W == 0 or tuple(ids.shape) != (B, W):
            raise ValueError(
                f"forward needs one block per row ({B}) and some token, got widths {list(widths)} "
                f"and ids of shape {tuple(ids.shape)}"
            )
        ids = embeddable(ids, self.embedding_rows)
        pos = torch.cat(
            [fn(n, W) for fn, n in zip(self.positions, self.lengths)], dim=-2
        )  # [P, B, W] | [B, W]
        real = torch.arange(W)[None] < torch.tensor(widths)[:, None]  # [B, W]
        # no holes and no dummies: the model's own causal mask, as a session's forward
        full = all(self._held(b) == S for b in range(B))  # every slot valid, on the host's books
        mask = None if min(widths) == W and full else self._mask(B, W)
        kernels = self.packed.rows(B * W, self.max_rows) if self.packed is not None else nullcontext()
        with kernels, grouped_query_sdpa(self.device):
            logits = step_logits(
                self.model,
                self.direct,
                self.cache,
                input_ids=ids.to(self.device),
                position_ids=pos.to(self.device),
                **({} if mask is None else {"attention_mask": mask.to(self.device)}),
            ).to(self.logits_device)  # [B, W, V]
        for b, n in enumerate(widths):
            self.slots[b].extend(range(S, S + n))
            self.lengths[b] += n
        self.valid = torch.cat([self.valid, real], dim=1)
        if logits.device.type == "cuda":  # the head's device: the last of a target spread over several
            torch.cuda.current_stream(logits.device).synchronize()
        self.seconds += time.perf_counter() - t0
        self.forwards += 1
        self.tokens_forwarded += W  # per row: t_verify(B, k) is of k tokens a row
        return logits

    def _mask(self, B: int, W: int) -> torch.Tensor:  # -> [B, 1, W, S + W]
        """The additive mask of a forward: each row's valid slots, causal inside the new block (a row's
        dummies come after its real tokens, so the causal part hides them)."""
        S = self.size
        allowed = torch.cat(
            [
                self.valid[:, None, :].expand(B, W, S),
                torch.ones(W, W, dtype=torch.bool).tril().expand(B, W, W),
            ],
            dim=-1,
        )  # [B, W, S + W]
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(
            ~allowed, torch.finfo(self.dtype).min
        )
        return mask[:, None]

    @torch.inference_mode()
    def rollback(self, row: int, length: int) -> None:
        """Forget row `row`'s tokens after its first `length` logical tokens."""
        drop = self.lengths[row] - length
        if drop < 0 or drop > len(self.slots[row]):
            raise ValueError(f"row {row}: cannot roll back from {self.lengths[row]} to {length} tokens")
        if drop:
            gone = self.slots[row][-drop:]
            del self.slots[row][-drop:]
            self.valid[row, gone] = False
            self.lengths[row] = length
            end = max(self._end(b) for b in range(self.rows))
            if end < self.size:  # trailing slots no row holds: crop them (`_crop`)
                self._crop(end)

    def verify_curve(self, widths: Sequence[int], repeats: int = 2) -> VerifyCurve:
        """t_verify(B, k) of this batch (B = its rows): forwards of k filler tokens in every row, each
        rolled back and its slots cropped, so the cache ends as it began (`hippo.cost.time_widths`)."""
        lengths, size = list(self.lengths), self.size

        def restore() -> None:
            for b, n in enumerate(lengths):
                self.rollback(b, n)
            self._crop(size)

        return time_widths(lambda k: self.forward([[0] * k] * self.rows), restore, widths, repeats)

    @torch.inference_mode()
    def _crop(self, size: int) -> None:
        """Drop the slots from `size` on (all invalid: rolled back)."""
        if any(self._end(b) > size for b in range(self.rows)):
            raise RuntimeError("cannot crop valid slots")
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :size], layer.values[:, :, :size]
        self.valid = self.valid[:, :size]

    @torch.inference_mode()
    def select(self, rows: Sequence[int]) -> None:
        """Keep only the rows `rows` (in that order): finished rows leave the batch."""
        if list(rows) == list(range(self.rows)):
            return
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        for layer in self.cache.layers:
            if isinstance(layer, SlabLayer) and layer.keep_batch(list(rows)):  # in place
                continue
            i = idx.to(layer.keys.device)
            layer.keys, layer.values = layer.keys.index_select(0, i), layer.values.index_select(0, i)
        self.valid = self.valid.index_select(0, idx)
        self.positions = [self.positions[r] for r in rows]
        self.lengths = [self.lengths[r] for r in rows]
        self.slots = [self.slots[r] for r in rows]
        self.base = [self.base[r] for r in rows]
        self.maybe_compact()

    @torch.inference_mode()
    def maybe_compact(self) -> None:
        """Gather each row's valid slots to the front when the holes pass the threshold."""
        counts = [self._held(b) for b in range(self.rows)]
        keep = max(counts, default=0)
        holes = self.size - keep
        if holes < max(COMPACT_MIN, COMPACT_SHARE * self.size):
            return
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :keep]  # [B, keep]
        for layer in self.cache.layers:
            B, H, _, D = layer.keys.shape
            g = order.to(layer.keys.device)[:, None, :, None].expand(B, H, keep, D)
            layer.keys, layer.values = layer.keys.gather(2, g), layer.values.gather(2, g)
        # the stable gather keeps each row's order: its prompt stays in front, its consumed tokens follow
        self.slots = [list(range(base, base + len(s))) for base, s in zip(self.base, self.slots)]
        self.valid = torch.arange(keep)[None] < torch.tensor(counts)[:, None]  # [B, keep]


class SessionRow:
    """One job's own prefilled session (plain, packed or compiled: `hippo.session`, `hippo.static`) as
    a one-row `BatchedCache`: the engine's round makes the same calls on it, row index 0. No row joins
    it. It also scores a token tree (`score_tree`, `keep_tree`), which a stack of rows cannot.

    Tokens fed through `forward_ids` stay on their device: the session does not record them in its
    `generated` list (the engine tracks what each row's draft consumed), so the session's own
    catch-up (`ModelSession.sync`) is not used on a session fed so."""

    def __init__(self, session: ModelSession):
        self.session = session
        self.device = getattr(session, "device", torch.device("cpu"))
        self.logits_device = getattr(session, "logits_device", self.device)
        # a session kind of a plugin's may not take `record`: it then reads the tokens as it likes
        self._unrecorded = "record" in inspect.signature(session.forward).parameters

    rows = 1

    @property
    def lengths(self) -> list[int]:
        return [self.session.length]

    # the session's clocks, under a batch's names (`hippo.cost.GammaPlan` and the engine read them)
    @property
    def seconds(self) -> float:
        return self.session.seconds_decode

    seconds_decode = seconds

    @property
    def forwards(self) -> int:
        return self.session.forwards

    @property
    def tokens_forwarded(self) -> int:
        return getattr(self.session, "tokens_forwarded", 0)

    def forward(self, blocks: Sequence[Sequence[int]]) -> torch.Tensor:  # -> logits [1, W, V]
        (block,) = blocks
        return self.session.forward([int(t) for t in block])[None]

    def forward_ids(self, ids: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:  # -> [1, W, V]
        (width,) = widths
        if self._unrecorded:
            return self.session.forward(ids[0, :width], record=False)[None]
        return self.session.forward(ids[0, :width])[None]

    def rollback(self, row: int, length: int) -> None:
        self.session.rollback(length)

    def score_tree(self, prefix: torch.Tensor, proposal: Any) -> torch.Tensor:  # -> [1, n+1, V]
        """p at the root and after each node of a token tree, in one masked pass (`score_proposal`)."""
        return self.session.score_proposal(prefix, proposal)[None]

    def keep_tree(self, length: int, proposal: Any, path: Sequence[int]) -> None:
        self.session.keep_path(length, proposal, path)

    def verify_curve(self, widths: Sequence[int], repeats: int = 3) -> VerifyCurve:
        """t_verify(k) of the session, as `hippo.cost.AutoGamma.calibrate` measures it."""
        return measure_verify_curve(self.session, torch.zeros(1, dtype=torch.long), widths, repeats)

    def maybe_compact(self) -> None:
        """Nothing to compact: a session crops on rollback."""

    def select(self, rows: Sequence[int]) -> None:
        if list(rows) != [0]:
            raise ValueError(f"a one-row stack keeps row 0 only, not {list(rows)}")


def _check(sessions: Sequence[ModelSession]) -> None:
    """Each session a transformers model's, on a cache of full-attention layers (`hippo.session.KVSession`'s)."""
    for s in sessions:
        if getattr(getattr(s, "cache", None), "layers", None) is None:
            raise UnsupportedError(
                f"batched decoding needs prefilled KVSessions with a transformers DynamicCache, got "
                f"{type(s).__name__}; build the pipeline without static-cache sessions"
            )
        for layer in s.cache.layers:
            if type(layer) not in (DynamicLayer, SlabLayer):
                raise UnsupportedError(
                    f"batched decoding stacks full-attention cache layers only, got {type(layer).__name__}"
                )


def _pad(t: torch.Tensor, slots: int) -> torch.Tensor:  # [B, H, S', D] -> [B, H, slots, D]
    return torch.nn.functional.pad(t, (0, 0, 0, slots - t.shape[-2]))
