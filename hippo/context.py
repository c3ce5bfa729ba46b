"""Video contexts: encode a video once, answer many questions from its cached prefix.

`Pipeline.prepare(inputs)` keeps, for the shared prefix (every token up to and including the last
multimodal placeholder, i.e. everything before the first question-dependent token):
- the target p's encoded prefix (vision features, embeddings, positions) and its KV cache;
- what the pipeline's scorer observed during that prefill (the attention scorer's prefix rows);
- a per-video memo where question-independent scores (temporal, spatial) are kept;
- lazily, the draft q's encoded prefix (its own vision features), when q is another model.

A question (`Turn`) extends the prefix by its tokens only: p's session is a copy-on-write fork of
the cached KV (`fork_cache`) fed the question's tokens at the positions the adapter computes for
the whole prompt, so the cached prefix is never written. The draft is prefilled on the whole
pruned prompt by the one draft path (`DraftSide.prefill`), from its cached encoding. Everything
else is `DecodeJob` and the schedulers, unchanged. Notation: P = prefix length, L = full prompt
length, k = question tokens, N = visual tokens.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager, nullcontext
from typing import Any

import attrs
import torch

from hippo.conversation import Conversation
from hippo.errors import InputError, MemoryBudgetError
from hippo.interfaces import Adapter, Encoded, Scorer, observes_pieces, prefilling
from hippo.kvcache import fit_cache, fork_cache
from hippo.placement import model_devices
from hippo.session import KVSession

#: the `hippo.pipeline.Pipeline` that prepares a context (its adapters, scorer and context budget)
Pipeline = Any

#: [1, L] tensors of processor inputs that follow the prompt's tokens, and the value a text token gets
PER_TOKEN = {"input_ids": None, "attention_mask": 1, "mm_token_type_ids": 0, "token_type_ids": 0}

MiB = 2**20

_KEYS = itertools.count()  # VideoContext.key: unique in this process, never reused


def truncate_inputs(inputs: dict[str, Any], length: int) -> dict[str, Any]:
    """The processor inputs of the prompt's first `length` tokens (the video's tensors unchanged)."""
    return {k: (v[:, :length] if k in PER_TOKEN and v is not None else v) for k, v in inputs.items()}


def extend_inputs(inputs: dict[str, Any], question: torch.Tensor) -> dict[str, Any]:  # question [k]
    """The processor inputs of the prompt followed by the text tokens `question`."""
    out = dict(inputs)
    q = question.view(1, -1)
    for key, fill in PER_TOKEN.items():
        v = inputs.get(key)
        if v is None:
            continue
        tail = q.to(v) if fill is None else torch.full((1, q.shape[1]), fill, dtype=v.dtype, device=v.device)
        out[key] = torch.cat([v, tail], dim=1)
    return out


def extend_encoded(
    adapter: Adapter, prefix: Encoded, inputs: dict[str, Any], question: torch.Tensor
) -> Encoded:
    """`prefix` (the encoded shared prefix) followed by the text tokens `question` [k]: embeddings
    of those tokens, and the whole prompt's positions as the adapter computes them (no vision)."""
    positions, next_position = adapter.prompt_positions(inputs)  # [R, L]
    P = prefix.length
    if not torch.equal(positions[:, :P].to(prefix.positions.device), prefix.positions):
        raise InputError(
            "the question changes the positions of the cached video prefix; this backbone's prompt cannot be "
            "split at the end of the video, use Pipeline.generate on the whole prompt"
        )
    q = question.to(prefix.input_ids.device, torch.long)
    embeds = adapter.embed_text(q).to(prefix.embeds)  # [k, D]
    return attrs.evolve(
        prefix,
        input_ids=torch.cat([prefix.input_ids, q]),
        embeds=torch.cat([prefix.embeds, embeds]),
        positions=positions.to(prefix.positions.device),
        next_position=next_position,
    )


@attrs.frozen
class DraftPrefix:
    """How the draft q gets a question's encoded prompt on a video context: its own encoding of the
    context's prefix, computed once and kept in a `store` (the context's, or a draft process's),
    extended by the question's tokens. Picklable: it travels to a draft process as it is."""

    key: int  # the context's VideoContext.key
    prefix_inputs: dict[str, Any]  # the prefix's processor inputs (input_ids [1, P])
    inputs: dict[str, Any]  # the whole prompt's processor inputs (input_ids [1, L])
    question: torch.Tensor  # [k] the tokens after the prefix

    def encode(self, adapter: Adapter, store: MutableMapping[int, Encoded]) -> Encoded:
        prefix = store.get(self.key)
        if prefix is None:
            prefix = store[self.key] = adapter.encode(self.prefix_inputs)
        return extend_encoded(adapter, prefix, self.inputs, self.question)


class EncodingStore(OrderedDict):
    """The draft's encoded video prefixes by context key, the `size` most recently used kept."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get(self, key: int, default: Any = None) -> Any:
        if key in self:
            self.move_to_end(key)
        return super().get(key, default)

    def __setitem__(self, key: int, value: Any) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


def tensor_bytes(*objs: Any) -> int:
    """Bytes of the distinct tensor storages reachable from `objs` (dicts, sequences, attrs, outputs)."""
    seen: set[int] = set()
    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)
        elif attrs.has(type(x)):
            for a in attrs.fields(type(x)):
                walk(getattr(x, a.name))
        elif hasattr(x, "layers"):  # a transformers cache
            for layer in x.layers:
                walk([getattr(layer, "keys", None), getattr(layer, "values", None)])

    for o in objs:
        walk(o)
    return total


def estimate_bytes(adapter: Adapter, prefix_length: int) -> int:
    """A prefix of `prefix_length` tokens: its KV (2 · layers · kv heads · head dim per token) plus
    about three [P, D] feature tensors (embeddings, visual rows, the vision output). An estimate."""
    cfg = adapter.model.config.get_text_config()
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    elem = next(adapter.model.parameters()).element_size()
    kv = 2 * int(cfg.num_hidden_layers) * kv_heads * head_dim * elem
    return prefix_length * (kv + 3 * int(cfg.hidden_size) * elem)


def available_bytes(device: torch.device) -> int | None:
    """Free memory on `device` (CUDA: the allocator's view; CPU: MemAvailable), or None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class VideoContext:
    """The cached shared prefix of one video prompt. Build it with `Pipeline.prepare`.

    `memory()` reports the bytes it holds; `close()` frees them. Questions never change it.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        inputs: dict[str, Any],  # the prefix's processor inputs (input_ids [1, P])
        encoded: Encoded,  # p's encoded prefix
        session: KVSession,  # p's prefill of the prefix (its cache is the shared one)
        capture: Any,  # what the scorer observed during that prefill
        tokenizer: Any = None,
    ):
        self.pipeline = pipeline
        self.inputs = inputs
        self.encoded = encoded
        self.cache = fit_cache(session.cache)  # kept and forked, never grown: no spare slots
        self.prefix_logits = session.prompt_logits  # [V]
        self.capture = capture
        self.tokenizer = tokenizer
        self.memo: dict = {}  # question-independent scores (ScoringContext.memo)
        self.key = next(_KEYS)
        self._draft_store: dict[int, Encoded] = {}  # q's encoded prefix (DraftPrefix), once used
        self._lock = threading.Lock()
        self.closed = False

    @property
    def length(self) -> int:
        """P: tokens in the cached prefix."""
        return self.encoded.length

    @property
    def prefix_ids(self) -> torch.Tensor:  # [P]
        return self.encoded.input_ids.cpu()

    def draft_encoded(self, prefix: DraftPrefix) -> Encoded:
        """q's encoding of a question's prompt: the prefix's (its own vision features) is computed
        on first use and kept here."""
        with self._lock:
            self._check_open()
            return prefix.encode(self.pipeline.draft_adapter, self._draft_store)

    def memory(self) -> dict[str, int]:
        """Bytes held: "kv" (p's cache), "features" (p's encoded prefix, scorer capture, memo),
        "draft_features" (q's encoded prefix, once used in this process; a `process` executor's draft
        keeps its own copy there), "total"."""
        if self.closed:
            return {"kv": 0, "features": 0, "draft_features": 0, "total": 0}
        kv = tensor_bytes(self.cache)
        feats = tensor_bytes(self.encoded, self.prefix_logits, self.memo, _capture_tensors(self.capture))
        draft = tensor_bytes(self._draft_store)
        return {"kv": kv, "features": feats, "draft_features": draft, "total": kv + feats + draft}

    @property
    def nbytes(self) -> int:
        return self.memory()["total"]

    def conversation(self) -> Conversation:
        """A multi-turn `Conversation` about this video."""
        return Conversation(self.pipeline, self)

    def close(self) -> None:
        """Free the cached KV and features; the context cannot answer afterwards."""
        self.closed = True
        self.cache = self.encoded = self.capture = self.prefix_logits = None
        self.memo, self._draft_store = {}, {}
        self.pipeline._contexts.discard(self)

    def _check_open(self) -> None:
        if self.closed:
            raise InputError("this video context is closed; prepare the video again")

    def __repr__(self) -> str:
        if self.closed:
            return "VideoContext(closed)"
        m = self.memory()
        return (
            f"VideoContext(prefix={self.length} tokens, visual={self.encoded.visual.n}, "
            f"kv={m['kv'] / MiB:.1f} MiB, features={(m['features'] + m['draft_features']) / MiB:.1f} MiB)"
        )


def _capture_tensors(capture: Any) -> Any:
    if capture is None:
        return None
    return [getattr(capture, "hidden", None), getattr(capture, "cos_sin", None)]


@contextmanager
def _memory_errors(what: str) -> Iterator[None]:
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise MemoryBudgetError(
            f"out of memory while {what}: {exc}; close other video contexts (ctx.close()), use fewer frames "
            "or a lower resolution (max_pixels)"
        ) from exc


def context_steps(
    pipe: Pipeline,
    inputs: dict[str, Any],
    *,
    tokenizer: Any = None,
    stage: Callable[[str], Any] | None = None,
    prefill_rows: int | None = None,  # rows per piece of the target's prefill (None: one piece)
) -> Iterator[VideoContext | None]:
    """Encode and prefill the shared prefix of `inputs` for `pipe` (see `Pipeline.prepare_steps`), in
    steps: yields None after the vision encoding and after each piece of the target's prefill but
    the last, then the context. Between two steps the pipeline's models may run other work (other
    requests' decoding). The prefill runs in one piece when the adapter or the scorer cannot split
    it (`Adapter.prefill_pieces`, `observes_pieces`)."""
    adapter = pipe.target_adapter
    P = adapter.shared_prefix_length(inputs["input_ids"][0])
    if P == 0:
        raise InputError("the prompt has no video (no multimodal placeholder token); use Pipeline.generate")
    check_budget(pipe, estimate_bytes(adapter, P), P)
    stage = stage or (lambda name: nullcontext())
    prefix = truncate_inputs(inputs, P)
    scorer: Scorer | None = pipe.scorer
    with _memory_errors("preparing the video context"), stage("vision encoding"):
        encoded = adapter.encode(prefix)
    vis = encoded.visual.seq_index
    if vis.numel() and int(vis.max()) >= P:
        raise InputError(f"visual tokens run past the shared prefix ({int(vis.max())} >= {P})")
    rows = prefill_rows if prefill_rows is not None and observes_pieces(scorer) else P
    capture = None

    @contextmanager
    def piece(start: int, end: int) -> Iterator[None]:  # one forward of the prefix's rows start..end-1
        nonlocal capture
        if scorer is None:
            observe = nullcontext()
        elif (start, end) == (0, P):
            observe = scorer.observe_target_prefill(adapter, encoded)
        else:
            observe = scorer.observe_target_piece(adapter, encoded, start, end, capture)
        with _memory_errors("preparing the video context"), observe:
            with prefilling(pipe.sessions["target"], adapter.model):
                yield
        if scorer is not None:
            capture = scorer.observed()

    if rows < P:
        yield None
    with stage("target prefill"):
        for session in adapter.prefill_pieces(encoded, rows, piece):
            if session is None:
                yield None
    yield VideoContext(pipe, prefix, encoded, session, capture, tokenizer)


def check_budget(pipe: Pipeline, estimate: int, prefix_length: int, kind: str = "a video context") -> None:
    """Refuse a new context (or a prompt's decoding: `kind`) that would exceed `pipe.context_budget`
    beside the live contexts, or the device's free memory."""
    live = [c for c in list(pipe._contexts) if not c.closed]
    held = sum(c.nbytes for c in live)
    budget = pipe.context_budget
    what = f"{kind} of {prefix_length} tokens needs about {estimate / MiB:.1f} MiB (KV + features)"
    if budget is not None and held + estimate > budget:
        raise MemoryBudgetError(
            f"{what}, but {len(live)} live context(s) hold {held / MiB:.1f} MiB of the budget of "
            f"{budget / MiB:.1f} MiB; close a context (ctx.close()) or raise Pipeline.context_budget"
        )
    # a target spread over devices holds its KV where its layers are: the free memory of them all
    frees = [available_bytes(d) for d in model_devices(pipe.target)]
    free = None if None in frees else sum(frees)
    if free is not None and estimate > free:
        raise MemoryBudgetError(
            f"{what}, but only {free / MiB:.1f} MiB are free on the device; close video contexts "
            "(ctx.close()), use fewer frames or a lower resolution (max_pixels)"
        )


class Turn:
    """One question on a video context: a `hippo.job.PromptSource` that extends the cached prefix."""

    kind = "extend"  # p is fed only the question's tokens

    def __init__(self, ctx: VideoContext, question: torch.Tensor):  # question [k] token ids
        ctx._check_open()
        self.ctx = ctx
        self.question = question.cpu().long()
        self.inputs = extend_inputs(ctx.inputs, self.question)
        self.memo = ctx.memo
        self._target: Encoded | None = None
        self._draft: Encoded | None = None

    @property
    def prompt_ids(self) -> torch.Tensor:  # [L]
        return self.inputs["input_ids"][0].cpu()

    def target_encoded(self) -> Encoded:
        if self._target is None:
            adapter = self.ctx.pipeline.target_adapter
            self._target = extend_encoded(adapter, self.ctx.encoded, self.inputs, self.question)
        return self._target

    def draft_prefix(self) -> DraftPrefix:
        return DraftPrefix(self.ctx.key, self.ctx.inputs, self.inputs, self.question)

    def draft_encoded(self) -> Encoded:
        if self._draft is None:
            self._draft = self.ctx.draft_encoded(self.draft_prefix())
        return self._draft

    def prefill_target(self, scorer: Scorer | None) -> KVSession:
        """p's session on the whole prompt: a fork of the cached prefix fed only the question."""
        adapter = self.ctx.pipeline.target_adapter
        encoded = self.target_encoded()
        P, L = self.ctx.length, encoded.length
        full = encoded.positions.cpu()  # [R, L]
        delta = encoded.next_position - L

        def positions(start: int, k: int) -> torch.Tensor:  # -> [R, 1, k] (M-RoPE) or [1, k]
            idx = torch.arange(start, start + k)
            out = torch.where(idx < L, full[:, idx.clamp(max=L - 1)], idx + delta)  # [R, k]
            return out if out.shape[0] == 1 else out[:, None, :]

        session = KVSession(
            adapter.model, fork_cache(self.ctx.cache), self.ctx.prefix_logits, P, P, positions,
            direct=adapter.direct_steps,
        )  # fmt: skip
        observe = (
            scorer.observe_target_extension(adapter, encoded, P, self.ctx.capture)
            if scorer is not None
            else nullcontext()
        )
        with observe, _memory_errors("prefilling the question"):
            session.extend_prompt(self.question)
        return session
