"""oneDNN-packed linear weights for the few-token forwards of speculative decoding (CPU, fp32).

A verification feeds γ+1 tokens, so every linear layer multiplies a [γ+1, D] activation by its
weight. Both that and a one-token step read each weight once, but on CPUs where MKL takes its
generic path (the AMD EPYC CPUs this was measured on) MKL's small-M sgemm makes a 6-token forward
cost 2-2.7 one-token steps, and its one-row sgemv runs on one thread (the narration target's 126 MB
of matrices in 7.8 ms, 16 GB/s, on 1 or 2 threads). oneDNN's linear on a weight reordered for it
once (`mkldnn._reorder_linear_weight`, what inductor's `freezing` does) runs those widths near the
bandwidth floor, without compiling anything. Measured on the narration target (2-core AMD EPYC,
2 threads, a 576-token video prompt), a k-token forward in ms, MKL against packed: k = 1 15.6 /
13.7, k = 6 31.5 / 13.0, k = 12 34.6 / 13.7, k = 24 37.3 / 24.0.

`PackedLinears.of(model)` packs the linear layers of the model's decoder and output head once (a
second copy of those weights in memory), and `with packed.rows(k):` routes the linear layers of a
forward of k rows through them when `k <= max_rows` (one-token steps included: hippo's target-alone
decoding of the two bench clips took 3.00 s against 3.42 s on MKL, the same tokens as `generate`);
`with packed.prefill():` routes a prompt's prefill too (oneDNN's GEMM on the reordered weights beat
MKL's large-M sgemm there: the narration target's 587-token prefill took 227-232 ms against 250 ms).
The packed layers become `PackedLinear`, an `nn.Linear` that reads the routing of the calling thread
(its modeling code and parameters are unchanged), and no other call pays for the routing (a torch
function mode, which sees every op of a forward, cost 0.7-0.9 ms of the narration target's 11 ms step).

oneDNN and MKL sum in different orders, so a packed forward's float32 logits differ from
`generate`'s in the last bits, as a k-token verification's already differ from one-token steps:
the tokens are the same unless two logits tie within float32 rounding (the float64 harness, where
nothing is packed, proves the schedules exact). Anything else (another device or dtype, autograd,
a weight changed in place since it was packed) takes the ordinary `F.linear`.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

#: the most rows (tokens of one forward) `rows` routes to the packed weights by default: a step, a
#: verification's γ+1 and a draft's catch-up (a prompt's prefill is routed by `prefill`)
MAX_ROWS = 64


def available() -> bool:
    """Whether this torch build has oneDNN's packed linear (CPU builds with mkldnn do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class _Packed:
    """One linear layer's weight [O, I], reordered for oneDNN, with the weight and the version it was
    made from (a weight changed in place since then is not routed)."""

    __slots__ = ("source", "weight", "version")

    def __init__(self, weight: torch.Tensor):  # [O, I]
        self.source, self.version = weight, weight._version
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())


_ACTIVE = threading.local()  # .route: the `_Route` this thread's forwards run in, if any


class PackedLinear(torch.nn.Linear):
    """`nn.Linear` that, inside its model's routing context in the calling thread, multiplies by its
    oneDNN-packed weight. Outside one (or while compiling) it is `nn.Linear`: `PackedLinears.of`
    sets it as the class of the layers it packs, and the model's code and parameters are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., I] -> [..., O]
        route = None if torch.compiler.is_compiling() else getattr(_ACTIVE, "route", None)
        out = None if route is None else route.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) if out is None else out


class _Route:
    """The context in which this thread's packed layers of one model run on their packed weights.
    `inference_only`: only calls made in inference mode (a prefill's, whose caller decides no mode)."""

    def __init__(self, owner: PackedLinears, inference_only: bool = False):
        self.owner = owner
        self.inference_only = inference_only
        self.outer: _Route | None = None

    def __enter__(self) -> _Route:
        self.outer, _ACTIVE.route = getattr(_ACTIVE, "route", None), self
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.route = self.outer

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x [..., I] by the packed `weight` [O, I] on oneDNN; None where the ordinary kernel must run."""
        if self.inference_only and not torch.is_inference_mode_enabled():
            return None
        packed = self.owner.packs.get(id(weight))
        if packed is None or packed.source is not weight or packed.version != weight._version:
            return None
        self.owner.routed += 1
        out = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, x.shape[-1]), packed.weight, bias, "none", [], ""
        )
        return out.view(*x.shape[:-1], weight.shape[0])  # [..., O]


class PackedLinears:
    """A model's decoder and output-head linear weights, packed for oneDNN (see the module's doc)."""

    def __init__(self, model: torch.nn.Module):
        self.routed = 0  # linear calls that ran on packed weights
        self.packs: dict[int, _Packed] = {}  # by id of the source weight
        if available():
            for module in _decoder_linears(model):
                w = module.weight
                if w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2:
                    self.packs[id(w)] = _Packed(w)
                    module.__class__ = PackedLinear
        self.bytes = sum(p.weight.numel() * p.weight.element_size() for p in self.packs.values())

    @classmethod
    def of(cls, model: torch.nn.Module) -> PackedLinears:
        """The model's packing, made once per model and shared by all its sessions."""
        with _LOCK:
            packed = _PACKINGS.get(model)
            if packed is None:
                packed = _PACKINGS[model] = cls(model)
            return packed

    def rows(self, k: int, max_rows: int = MAX_ROWS) -> Any:
        """A context in which a forward of k rows uses the packed weights (when 1 <= k <= max_rows)."""
        if not self.packs or not 1 <= k <= max_rows or torch.is_grad_enabled():
            return nullcontext()
        return _Route(self)

    def prefill(self) -> Any:
        """A context in which a prefill's linear layers (run in inference mode) use the packed weights."""
        return _Route(self, inference_only=True) if self.packs else nullcontext()


def _decoder_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linear layers a decoding step runs: the decoder's and the output head's (not a vision
    tower's, which only runs in the prefill)."""
    parts = []
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    parts.append(decoder if isinstance(decoder, torch.nn.Module) else model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module):
        parts.append(head)
    seen: set[int] = set()
    out = []
    for part in parts:
        for m in part.modules():
            if type(m) in (torch.nn.Linear, PackedLinear) and id(m) not in seen:  # not a subclass
                seen.add(id(m))
                out.append(m)
    return out


_PACKINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
