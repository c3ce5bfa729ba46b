"""Static-cache sessions with a compiled forward (gpt-fast style), opt-in per role.

A `StaticKVSession` takes over a prefilled `KVSession`: its entries are copied once into a
transformers `StaticCache` (pre-allocated slots), and every later forward runs one compiled graph
on fixed buffers. Rollback is a position reset (each layer's `cumulative_length`): entries past the
position stay in their slots but are never attended, since the causal mask of a static cache only
lets query slot s see slots <= s, and the next forward overwrites them.

On CPU the graph is inductor's with `freezing` and dynamic token counts, which packs every linear
layer's weight for oneDNN: the small-M GEMMs of a (γ+1)-token verification then run near the
bandwidth floor instead of MKL's small-M path (measured: a 6-row [1536 x 1024] linear took 0.26 ms
against MKL's 0.88 ms). One graph serves all widths k >= 2 and one k = 1, so γ from the cost model
does not recompile. On CUDA the same graph runs under CUDA graphs (inductor's `reduce-overhead`)
with a graph per width.

Compilation is paid on the first forward of each graph (seconds; `seconds_compile` books it) and
cached by inductor on disk for later processes; `mode="eager"` keeps the static cache without
compiling (for tests and for shapes inductor cannot take).

Profiled (narration target after a 587-token prompt, 2 threads, an Intel Xeon with AVX-512): a compiled
1-token step took 9.5-11 ms, ~2.2 ms of it copying each layer's 8 key/value heads out to the 16 query
heads, since transformers' SDPA path repeats them whenever an attention mask is given and a static
cache always gives one. `TRANSFORMERS_SDPA_FORCE_GQA=1` (SDPA's own grouped-query attention) brought
the step to 7.9 ms. It is not set here: set for the whole process it changes the attention of every
model, and hippo's packing of grouped query heads (`hippo.gqa`) is scoped to its eager forwards and
stays out of compiled graphs (measured with the variable: a compiled 6-token verification took 20.4 ms
inside a scoped switch, 15.7 ms with the variable set at start).
"""

from __future__ import annotations

import threading
import time
import types
import weakref
from typing import Any

import attrs
import torch

from hippo.compat import cache_arg
from hippo.errors import ConfigError
from hippo.session import KVSession, synchronize

MODES = ("inductor", "eager")
ROLES = ("target", "draft")


@attrs.frozen
class StaticSessions:
    """How a role's sessions run: `mode` "inductor" (compiled) or "eager" (static cache only).

    `headroom`: free slots allocated beyond the tokens the job asks for (drafts run γ ahead); the
    slot count is rounded up to a power of two, and the cache grows (a copy) if a session ever
    needs more.
    """

    mode: str = attrs.field(default="inductor")
    headroom: int = attrs.field(default=64)

    @mode.validator
    def _mode(self, _attr, value):
        if value not in MODES:
            raise ConfigError(f"compile mode {value!r} is not one of {', '.join(MODES)}")

    @headroom.validator
    def _headroom(self, _attr, value):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"compile headroom must be a positive int, got {value!r}")

    def open(self, session: KVSession, new_tokens: int) -> StaticKVSession:
        """Move `session` (just prefilled) onto a static cache with room for `new_tokens` more."""
        if not isinstance(session, KVSession):
            raise ConfigError(f"{type(session).__name__} cannot run on a static cache (needs a KVSession)")
        step = compiled_step(session.model) if self.mode == "inductor" else None
        return StaticKVSession(session, session.cache_len() + new_tokens + self.headroom, step)


def _round_up(n: int) -> int:
    """Slots for n entries: the next power of two (at least 64), so that runs of different lengths
    share the compiled graph of one cache size instead of compiling one per size."""
    return max(64, 1 << (n - 1).bit_length())


@torch.inference_mode()
def _static_cache(config: Any, slots: int) -> Any:
    """A transformers StaticCache whose tensors are all inference tensors, however the caller runs:
    a cache made outside inference mode would fail the compiled graph's guards (a recompile)."""
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=slots)


class StaticKVSession(KVSession):
    """A `KVSession` on a transformers `StaticCache`, forwarded by a compiled step (or eagerly)."""

    def __init__(self, session: KVSession, capacity: int, step: CompiledStep | None):
        super().__init__(
            session.model,
            None,
            session.prompt_logits,
            session.length,
            session.prompt_length,
            session.positions,
            direct=session.direct is not None,
        )
        self.last_logits, self.generated = session.last_logits, list(session.generated)
        self.compiled = step
        used = session.cache_len()
        self.cache = _static_cache(self.model.config, _round_up(capacity))
        self._fill(session.cache.layers, used)
        session.close()

    @torch.inference_mode()  # the cache's tensors are inference tensors, as a prefill's are
    def _fill(self, layers: list[Any], used: int) -> None:  # copy `used` entries of each layer
        for src, dst in zip(layers, self.cache.layers, strict=True):
            dst.lazy_initialization(src.keys, src.values)
            dst.keys[:, :, :used].copy_(src.keys[:, :, :used])
            dst.values[:, :, :used].copy_(src.values[:, :, :used])
            dst.cumulative_length.fill_(used)

    @property
    def capacity(self) -> int:
        return self.cache.layers[0].max_cache_len

    def cache_len(self) -> int:
        return int(self.cache.layers[0].cumulative_length)

    @torch.inference_mode()
    def _set_len(self, n: int) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(n)

    def _reserve(self, k: int) -> None:
        """Grow the cache (double it, one copy) if k more entries would not fit."""
        used = self.cache_len()
        if used + k <= self.capacity:
            return
        old = self.cache.layers
        self.cache = _static_cache(self.model.config, _round_up(max(2 * self.capacity, used + k)))
        self._fill(old, used)

    def _step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # ids [1, k] -> [k, V]
        if self.compiled is None:
            return super()._step(ids, pos)
        # fresh inference tensors: a caller's normal tensor would fail the graph's guards (a recompile)
        logits, compile_seconds = self.compiled(ids.clone(), pos.clone(), self.cache)
        self.seconds_compile += compile_seconds
        return logits[0]

    def _crop(self, drop: int) -> None:
        self._set_len(self.cache_len() - drop)

    def _block_mask(self, past: int, visible: torch.Tensor) -> torch.Tensor:  # [k, k] -> [k, capacity]
        k = visible.shape[0]
        allowed = torch.zeros(k, self.capacity, dtype=torch.bool)
        allowed[:, :past] = True
        allowed[:, past : past + k] = visible
        return allowed

    @torch.inference_mode()
    def _compact(self, past: int, rows: torch.Tensor) -> None:  # rows [r] ascending
        src = (past + rows).to(self.device)
        for layer in self.cache.layers:
            for buf in (layer.keys, layer.values):  # [B, H, capacity, D]
                buf[:, :, past : past + src.shape[0]] = buf[:, :, src]  # the gather copies first
        self._set_len(past + int(rows.shape[0]))


class CompiledStep:
    """`model(input_ids, position_ids, static cache).logits`, compiled once per model.

    Returns (logits [1, k, V], seconds spent compiling in this call). Dynamo compiles one graph
    for k = 1 (it specialises size 1) and one for every k >= 2 (a dynamic size); a new device,
    dtype or cache size may add graphs, which inductor's on-disk cache makes cheap later.
    """

    def __init__(self, model: torch.nn.Module, backend: str = "inductor"):
        self.model = model
        cuda = next(model.parameters()).device.type == "cuda"
        options = {"triton.cudagraphs": True} if cuda else {"freezing": True}

        def step(ids, pos, cache):
            return model(input_ids=ids, position_ids=pos, **cache_arg(cache), use_cache=True).logits

        if backend != "inductor":  # e.g. "eager": dynamo's graphs without inductor's code (debugging)
            options = None
        self._fn = torch.compile(_own_code(step), dynamic=not cuda, backend=backend, options=options)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, cache: Any) -> tuple[torch.Tensor, float]:
        graphs = _graphs()
        t0 = time.perf_counter()
        # pos's leading dim is the rotary sections (3 for M-RoPE), never the token count: static,
        # or dynamo's duck sizing gives it ids' symbol when k equals it and specialises k to it
        torch._dynamo.mark_static(pos, 0)
        with torch.no_grad():  # freezing (weights as constants) compiles only outside autograd
            logits = self._fn(ids, pos, cache)
        if _graphs() == graphs:
            return logits, 0.0
        synchronize(logits.device)  # this call compiled a graph: book its time as compiling
        return logits, time.perf_counter() - t0


def _own_code(fn: Any) -> Any:
    """`fn` on a copy of its code object. Dynamo keeps its graphs, its record of which sizes vary and
    its recompile count (`recompile_limit`, 8) per code object: on one shared `step`, the fifth model
    of a process compiled nothing and ran eagerly, and a model's graphs depended on the models
    compiled before it. With a code object each, every model gets the same two graphs."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


def _graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STEPS_LOCK = threading.Lock()


def compiled_step(model: torch.nn.Module) -> CompiledStep:
    """The model's compiled step, made once per model object and shared by all its sessions."""
    with _STEPS_LOCK:
        step = _STEPS.get(model)
        if step is None:
            step = _STEPS[model] = CompiledStep(model)
        return step
