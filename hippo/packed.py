"""oneDNN-packed linear weights for the few-token forwards of speculative decoding (CPU, fp32).

A verification feeds γ+1 tokens, so every linear layer multiplies a [γ+1, D] activation by its
weight. Both that and a one-token step read each weight once, but on CPUs where MKL takes its
generic path (the AMD EPYC CPUs this was measured on) MKL's small-M sgemm makes a 6-token forward
cost 2-2.7 one-token steps. oneDNN's linear on a weight reordered for it once
(`mkldnn._reorder_linear_weight`, what inductor's `freezing` does) runs those widths near the
bandwidth floor, without compiling anything. Measured on the narration target (2-core AMD EPYC,
2 threads, a 576-token video prompt), a k-token forward in ms, MKL against packed: k = 1 15.6 /
13.7, k = 6 31.5 / 13.0, k = 12 34.6 / 13.7, k = 24 37.3 / 24.0.

`PackedLinears.of(model)` packs the linear layers of the model's decoder and output head once (a
second copy of those weights in memory), and `with packed.rows(k):` routes the linear layers of a
forward of k rows through them when `2 <= k <= max_rows`; `with packed.prefill():` routes a prompt's
prefill too (oneDNN's GEMM on the reordered weights beat MKL's large-M sgemm there: the narration
target's 587-token prefill took 227-232 ms against 250 ms). The routing is a torch function mode: it
holds in the calling thread only, and the model is not changed. One-token steps stay on MKL, which
is as fast there and computes exactly what `generate`'s decoding computes. Anything else (another
device or dtype, autograd, a weight changed in place since it was packed) takes the ordinary `F.linear`.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: row counts (tokens of one forward) routed to the packed weights by default: a verification's
#: γ+1 and a draft's catch-up, never a prompt's prefill
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


class _Route(TorchFunctionMode):
    """Sends `F.linear` calls on packed weights to oneDNN; every other call runs unchanged.
    `inference_only`: only calls made in inference mode (a prefill's, whose caller decides no mode)."""

    def __init__(self, owner: PackedLinears, inference_only: bool = False):
        super().__init__()
        self.owner = owner
        self.inference_only = inference_only

    def __torch_function__(self, func, types, args=(), kwargs=None):
        live = not self.inference_only or torch.is_inference_mode_enabled()
        if live and func is F.linear and len(args) >= 2:
            x, weight = args[0], args[1]  # x [..., I], weight [O, I]
            packed = self.owner.packs.get(id(weight))
            if packed is not None and packed.source is weight and packed.version == weight._version:
                bias = args[2] if len(args) > 2 else (kwargs or {}).get("bias")
                self.owner.routed += 1
                out = torch.ops.mkldnn._linear_pointwise(
                    x.reshape(-1, x.shape[-1]), packed.weight, bias, "none", [], ""
                )  # [rows, O]
                return out.view(*x.shape[:-1], weight.shape[0])
        return func(*args, **(kwargs or {}))


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
        """A context in which a forward of k rows uses the packed weights (when 2 <= k <= max_rows)."""
        if not self.packs or not 2 <= k <= max_rows or torch.is_grad_enabled():
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
            if isinstance(m, torch.nn.Linear) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


_PACKINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
