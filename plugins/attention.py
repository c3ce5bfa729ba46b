"""The attention scorer (paper eq. 2): text-to-video attention read from the target's own prefill.

s_attn(v_j) = 1/(N_L H L_txt) Σ_ℓ Σ_h Σ_i softmax_i(q_i^{ℓ,h} · K^{ℓ,h} / √d_k)[j]

How it is computed, without ever forming an L×L matrix (the KV reconstruction of SpecVLM/HIPPO):

1. `observe_target_prefill` puts a forward *pre*-hook on every selected layer's self-attention. The
   hook copies the layer input (already layer-normed) and the rotary (cos, sin) rows of the query
   positions only (default: the text after the last video token). It returns nothing, so the
   target's computation is untouched.
2. After the prefill, `score` projects those rows to post-RoPE queries through the adapter
   (`project_queries`) and reads the post-RoPE keys from the target's KV cache (`cached_keys`).
3. `text_to_visual_attention` runs the softmax in key chunks: pass 1 accumulates a running max and
   sum of exponentials over every key the row can see (causal; sliding-window layers respected), pass 2
   re-scores only the visual keys and adds exp(s - logsumexp) per visual column. Memory is
   O(H · L_txt · chunk), never O(L²) nor O(L_txt · L).

An adapter supports this scorer by implementing three small methods (Qwen2.5-VL/Qwen3-VL do):
`attention_modules() -> list[nn.Module]`, `project_queries(layer, hidden [T, D], (cos, sin)) -> [H, T, d]`
(post-RoPE, already multiplied by the softmax scale), and `cached_keys(session, layer) -> [H_kv, L, d]`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from hippo import hookimpl
from hippo.errors import ConfigError, InputError, UnsupportedError
from hippo.interfaces import Adapter, Encoded, Scorer, ScoringContext
from hippo.types import VisualTokens
from hippo.validators import layer_indices, one_of, optional_int_tuple, positive_int
from hippo.visual import compute_dtype

QUERY_MODES = ("after_video", "text")
SOFTMAX_MODES = ("causal", "visual")
_ADAPTER_METHODS = ("attention_modules", "project_queries", "cached_keys")


def query_rows(encoded: Encoded, mode: str) -> torch.Tensor:  # -> [T] long, ascending sequence positions
    """Prompt positions whose attention to the video is read.

    "after_video": every token after the last video token (SpecVLM's stage-2 text, the question).
    "text": every non-video token after the first video token (text between videos included). Tokens
    before the first video are never used: causally they cannot see any video token.
    """
    vis = encoded.visual.seq_index.cpu()
    L = encoded.length
    if vis.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if mode == "after_video":
        return torch.arange(int(vis.max()) + 1, L)
    is_vis = torch.zeros(L, dtype=torch.bool)
    is_vis[vis] = True
    pos = torch.arange(L)
    return pos[(pos > int(vis.min())) & ~is_vis]


def _visible(rows: torch.Tensor, cols: torch.Tensor, window: int | None) -> torch.Tensor:
    # rows [R], cols [C] -> [R, C] bool: key col is visible from query row (causal, sliding window)
    ok = cols[None, :] <= rows[:, None]
    if window is not None:
        ok &= cols[None, :] > rows[:, None] - window
    return ok


def text_to_visual_attention(
    q: torch.Tensor,  # [H, T, d] post-RoPE queries, already scaled by the softmax scale
    keys: torch.Tensor,  # [H_kv, L', d] post-RoPE keys; L' >= max(rows) + 1
    rows: torch.Tensor,  # [T] long, sequence position of each query
    cols: torch.Tensor,  # [N] long, sequence position of each visual key
    *,
    chunk: int = 4096,
    window: int | None = None,  # sliding-window size of the layer (keys with row - col >= window are hidden)
    normaliser: str = "causal",  # "causal": softmax over all visible keys; "visual": over visual keys only
) -> torch.Tensor:  # -> [N] Σ over heads and query rows of the softmax weight at each visual key
    """Chunked softmax read-out: memory O(H · T · chunk); no [T, L] or [L, L] matrix is formed."""
    H, T, d = q.shape
    Hkv = keys.shape[0]
    if H % Hkv:
        raise ValueError(f"{H} query heads is not a multiple of {Hkv} key/value heads")
    G = H // Hkv
    dtype = compute_dtype(q.dtype)
    dev = q.device
    rows = rows.to(dev)
    cols = cols.to(dev)
    out = torch.zeros(cols.shape[0], dtype=dtype, device=dev)
    if T == 0 or cols.numel() == 0:
        return out
    # GQA: query head h uses key head h // G (transformers' repeat_kv layout)
    qg = q.to(dtype).reshape(Hkv, G * T, d)
    grows = rows.repeat(G)  # [G*T] sequence position of each grouped query row
    floor = torch.finfo(dtype).min
    m = torch.full((Hkv, G * T), floor, dtype=dtype, device=dev)  # running max
    s_sum = torch.zeros(Hkv, G * T, dtype=dtype, device=dev)  # running Σ exp(s - m)
    last = int(rows.max())
    first = 0 if window is None else max(0, int(rows.min()) - window + 1)

    def logits(key_pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # -> [Hkv, G*T, C]
        s = torch.bmm(qg, k.to(dtype).transpose(1, 2))
        vis = _visible(grows, key_pos, window)
        return s.masked_fill_(~vis, float("-inf"))

    def accumulate(key_pos: torch.Tensor, k: torch.Tensor) -> None:
        nonlocal m, s_sum
        s = logits(key_pos, k)
        m_new = torch.maximum(m, s.amax(dim=-1))
        s_sum = s_sum * torch.exp(m - m_new) + torch.exp(s - m_new[..., None]).sum(dim=-1)
        m = m_new

    # pass 1: the normaliser of every query row
    if normaliser == "causal":
        for c0 in range(first, last + 1, chunk):
            c1 = min(c0 + chunk, last + 1)
            accumulate(torch.arange(c0, c1, device=dev), keys[:, c0:c1])
    elif normaliser == "visual":
        for c0 in range(0, cols.shape[0], chunk):
            idx = cols[c0 : c0 + chunk]
            accumulate(idx, keys.index_select(1, idx))
    else:
        raise ValueError(f"normaliser must be one of {SOFTMAX_MODES}, got {normaliser!r}")
    lse = m + torch.log(s_sum)  # [Hkv, G*T]; -inf never occurs: every row sees at least itself (causal)
    # pass 2: the weights at the visual keys, summed over heads and rows
    for c0 in range(0, cols.shape[0], chunk):
        idx = cols[c0 : c0 + chunk]
        p = torch.exp(logits(idx, keys.index_select(1, idx)) - lse[..., None])
        if normaliser == "visual":
            p = torch.nan_to_num(p, nan=0.0)  # rows that see no visual key at all (lse = -inf)
        out[c0 : c0 + idx.shape[0]] = p.sum(dim=(0, 1))
    return out


@attrs.define
class _Capture:
    """What the hooks recorded during one target prefill."""

    encoded: Any  # weakref to the Encoded the prefill ran on
    rows: torch.Tensor  # [T]
    layers: tuple[int, ...]
    hidden: dict[int, torch.Tensor] = attrs.Factory(dict)  # layer -> [T, D]
    cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]] = attrs.Factory(dict)  # layer -> ([T, d], [T, d])
    problems: list[str] = attrs.Factory(list)


def _rows_2d(x: torch.Tensor, rows: torch.Tensor, L: int) -> torch.Tensor:  # [..., L, k] -> [T, k]
    if x.dim() < 2 or x.shape[-2] != L:
        raise ValueError(f"expected a [..., {L}, k] tensor, got {tuple(x.shape)}")
    lead = x.shape[:-2]
    if any(s != 1 for s in lead):
        raise ValueError(f"batch size must be 1, got leading dims {tuple(lead)}")
    return x.reshape(L, x.shape[-1]).index_select(0, rows.to(x.device)).clone()


class AttentionScorer(Scorer):
    """s_attn (eq. 2) from the target's prefill: text→video attention averaged over layers, heads, rows.

    Needs the target's prefill (`context.target`), observed through `observe_target_prefill`.
    """

    @attrs.frozen
    class Config:
        #: decoder layers to average over (None: all; negative indices count from the end)
        layers: tuple[int, ...] | None = attrs.field(
            default=None, converter=optional_int_tuple, validator=layer_indices
        )
        #: which prompt rows are the text queries: "after_video" (default) or "text" (see `query_rows`)
        queries: str = attrs.field(default="after_video", validator=one_of(*QUERY_MODES))
        #: softmax normaliser: "causal" (all keys a row sees, as in the model) or "visual" (eq. 2 read literally)
        softmax_over: str = attrs.field(default="causal", validator=one_of(*SOFTMAX_MODES))
        #: keys per chunk of the streaming softmax (bounds memory to H · L_txt · chunk_size floats)
        chunk_size: int = attrs.field(default=4096, validator=positive_int)

    def __init__(self, config: Any = None):
        super().__init__(config)
        self._capture: _Capture | None = None

    # ---- layers ---------------------------------------------------------------------------
    def _modules(self, adapter: Adapter) -> list[torch.nn.Module]:
        missing = [m for m in _ADAPTER_METHODS if not hasattr(adapter, m)]
        if missing:
            raise UnsupportedError(
                f"the attention scorer cannot read attention from adapter {type(adapter).__name__} "
                f"(it lacks {', '.join(missing)}); use a scorer without attention, e.g. "
                ".scorer('holistic', components=['temporal', 'spatial'])"
            )
        return list(adapter.attention_modules())

    def _layers(self, n_layers: int) -> tuple[int, ...]:
        if self.config.layers is None:
            return tuple(range(n_layers))
        out = []
        for i in self.config.layers:
            if not -n_layers <= i < n_layers:
                raise ConfigError(
                    f"attention scorer: layer {i} does not exist; the target has {n_layers} decoder layers "
                    f"(valid: 0..{n_layers - 1}, or negative from the end)"
                )
            out.append(i % n_layers)
        return tuple(sorted(set(out)))

    # ---- capture --------------------------------------------------------------------------
    def observe_target_prefill(self, adapter: Adapter, encoded: Encoded) -> contextlib.AbstractContextManager:
        return self._observe(adapter, encoded)

    def observed(self) -> _Capture | None:
        return self._capture

    def observe_target_extension(
        self, adapter: Adapter, encoded: Encoded, start: int, prior: Any
    ) -> contextlib.AbstractContextManager:
        """Capture the query rows start..L-1 from a forward of those rows only; the rows before
        `start` (a video context's cached prefix) come from `prior`, its prefill's capture."""
        return self._observe(adapter, encoded, start, encoded.length, prior)

    def observe_target_piece(
        self, adapter: Adapter, encoded: Encoded, start: int, end: int, prior: Any
    ) -> contextlib.AbstractContextManager:
        """Capture the query rows start..end-1 from a forward of those rows only (one piece of a
        prefill in pieces); the rows before `start` come from `prior`, the pieces before."""
        return self._observe(adapter, encoded, start, end, prior)

    @contextlib.contextmanager
    def _observe(
        self,
        adapter: Adapter,
        encoded: Encoded,
        start: int = 0,
        end: int | None = None,
        prior: _Capture | None = None,
    ) -> Iterator[None]:
        modules = self._modules(adapter)
        layers = self._layers(len(modules))
        rows = query_rows(encoded, self.config.queries)
        end = encoded.length if end is None else end
        old = rows[rows < start]
        if start and (
            prior is None
            or prior.layers != layers
            or not torch.equal(prior.rows.cpu(), old)
            or prior.problems
        ):
            raise InputError(
                "the attention scorer has no usable capture of the video context's prefix (it was prepared "
                "with another scorer configuration); prepare the context with this pipeline"
            )
        cap = _Capture(encoded=weakref.ref(encoded), rows=rows[rows < end], layers=layers)
        L = end - start  # the forward sees rows start..end-1 only
        new_rows = rows[(rows >= start) & (rows < end)] - start  # [T_new] rows of this forward

        def make_hook(layer: int):
            def hook(module, args, kwargs):  # forward pre-hook: reads, never modifies
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                pe = kwargs.get("position_embeddings")
                if hidden is None or pe is None:
                    cap.problems.append(f"layer {layer}: no hidden_states/position_embeddings in the call")
                    return None
                if hidden.shape[-2] != L:
                    cap.problems.append(
                        f"layer {layer}: saw {hidden.shape[-2]} positions, expected the rows {start}..{end - 1} "
                        f"({L}); the forward did not match the piece observed"
                    )
                    return None
                with torch.no_grad():
                    h = _rows_2d(hidden, new_rows, L)
                    cs = (_rows_2d(pe[0], new_rows, L), _rows_2d(pe[1], new_rows, L))
                    if start:  # the cached prefix's rows first
                        h = torch.cat([prior.hidden[layer].to(h), h])
                        cs = tuple(torch.cat([a.to(b), b]) for a, b in zip(prior.cos_sin[layer], cs))
                    cap.hidden[layer], cap.cos_sin[layer] = h, cs
                return None

            return hook

        handles = [modules[i].register_forward_pre_hook(make_hook(i), with_kwargs=True) for i in layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        if start and start == end:  # nothing after the prefix: no forward ran
            cap.hidden, cap.cos_sin = dict(prior.hidden), dict(prior.cos_sin)
        self._capture = cap

    # ---- scoring --------------------------------------------------------------------------
    def _checked_capture(self, context: ScoringContext) -> _Capture:
        if context.target is None:
            raise InputError(
                "the attention scorer needs the target's prefill (its KV cache), but the target has not been "
                "prefilled when pruning ran; prune after job.prefill_target(), or use a scorer without "
                "attention, e.g. .scorer('holistic', components=['temporal', 'spatial'])"
            )
        cap = self._capture
        if cap is None or cap.encoded() is not context.encoded:
            raise InputError(
                "the attention scorer did not observe the target's prefill of this prompt; the prefill must run "
                "inside scorer.observe_target_prefill(adapter, encoded) (DecodeJob.prefill_target does this)"
            )
        missing = [i for i in cap.layers if i not in cap.hidden]
        if missing:
            why = "; ".join(cap.problems) or "the hooks never fired"
            raise InputError(f"the attention scorer captured no queries for layers {missing}: {why}")
        return cap

    @torch.inference_mode()
    def score(self, visual: VisualTokens, context: ScoringContext) -> torch.Tensor:  # -> [N]
        dev = visual.embeds.device
        if visual.n == 0:
            return torch.zeros(0, dtype=torch.float32, device=dev)
        cap = self._checked_capture(context)
        if cap.rows.numel() == 0:
            raise InputError(
                f"the prompt has no text queries for the attention scorer (queries={self.config.queries!r}: "
                "no text after the video); put the question after the video or use queries='text'"
            )
        adapter, session = context.adapter, context.target
        modules = self._modules(adapter)
        cols = visual.seq_index
        total = None
        for layer in cap.layers:
            hidden = cap.hidden[layer]
            q = adapter.project_queries(layer, hidden, cap.cos_sin[layer])  # [H, T, d]
            keys = adapter.cached_keys(session, layer)  # [H_kv, L', d]
            need = int(cap.rows.max()) + 1
            if keys.shape[1] < need:
                raise InputError(
                    f"the target's cache holds {keys.shape[1]} positions but the prompt has {need}; "
                    "score before the target's cache is rolled back or closed"
                )
            s = text_to_visual_attention(
                q,
                keys[:, :need],
                cap.rows,
                cols,
                chunk=self.config.chunk_size,
                window=getattr(modules[layer], "sliding_window", None),
                normaliser=self.config.softmax_over,
            ).to(dev)
            s = s / (q.shape[0] * cap.rows.numel())  # mean over this layer's heads and query rows
            total = s if total is None else total + s
        return total / len(cap.layers)


@hookimpl
def hippo_register_scorers():
    return {"attention": AttentionScorer}
