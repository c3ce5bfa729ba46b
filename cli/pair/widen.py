"""Function-preserving widening of a trained Qwen2.5-VL language model (Net2WiderNet-style).

At ~1M parameters a decode step costs mostly per-call overhead, so a 5x smaller draft is not 5x
cheaper. `widen` gives the trained target real extra compute while computing the same function:

- residual stream: every hidden unit is replicated `k` times, as whole blocks (x' = [x, x, ..., x]).
  RMSNorm is unchanged by this, because the mean of squares of a replicated vector is the
  original's (its weight is replicated too); no rescaling is needed;
- every linear layer reading the residual stream gets its input columns tiled and divided by `k`;
  every layer writing to it gets its output rows tiled;
- attention: the query and key/value heads are replicated `k` times (head_dim unchanged, so
  M-RoPE and the softmax scale are unchanged); o_proj reads k copies of every head's output, so
  its columns are divided by `k`. Grouped-query attention maps head b*H+o to key/value head
  b*KV + o//(H/KV), a copy of the original pairing;
- with `kv` (a model with one key/value head only): the key/value heads are replicated `kv` times
  instead of `k` (1: not at all), so the query heads share them as in a large model's grouped-query
  attention (Qwen2.5-72B: 8 query heads per key/value head) and the KV cache stays small against the
  weights. Every query head of a one-KV-head model reads that head, so any grouping is a copy of
  the original pairing;
- MLP: every intermediate neuron is replicated `m` times and down_proj's columns divided by `m`;
- embeddings and the vision merger's output are replicated; lm_head reads k copies, divided by k.

All replicas run: the widened language model does k^2 times the attention-projection work and
k*m times the MLP work (its MLP matrices are k*m times larger). In exact
arithmetic its logits equal the small model's; in float64 they agree to ~1e-15 and in float32 to
~1e-6 (sums run in a different order). The vision encoder is left as it is.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from hippo.cli.pair.tokens import set_generation_defaults


def _tile(w: torch.Tensor, rows: int, cols: int = 1, divide: int = 1) -> torch.Tensor:
    w = w.repeat(rows, cols) if w.dim() == 2 else w.repeat(rows)
    return w / divide if divide != 1 else w


def _kv_copies(config, k: int, kv: int | None) -> int:
    """How many times the key/value heads are replicated: `k` unless `kv` is given (see the module
    docstring; only a one-KV-head model can keep fewer copies than its query heads get)."""
    if kv is None or kv == k:
        return k
    heads = config.text_config.num_key_value_heads
    if heads != 1 or kv < 1 or (k * config.text_config.num_attention_heads) % kv:
        raise ValueError(
            f"kv={kv}: only a model with one key/value head (this one has {heads}) can replicate them "
            f"fewer times than its query heads (k={k}), into a number that divides the query heads"
        )
    return kv


def widened_config(config, k: int, m: int, kv: int | None = None):
    copies = _kv_copies(config, k, kv)
    cfg = config.__class__.from_dict(config.to_dict())
    t = cfg.text_config
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    t.hidden_size *= k
    t.num_attention_heads *= k
    t.num_key_value_heads *= copies
    if getattr(t, "head_dim", None) is not None:
        t.head_dim = head_dim
    t.intermediate_size *= m
    cfg.vision_config.out_hidden_size *= k
    return cfg


def widen_state(
    state: dict[str, torch.Tensor], k: int, m: int, kv: int | None = None
) -> dict[str, torch.Tensor]:
    """The widened model's weights from the small one's (keys as in `model.state_dict()`); `kv`: the
    key/value heads' copies (default `k`; fewer only for a one-KV-head model: `widened_config`)."""
    kv = k if kv is None else kv
    out = {}
    for name, w in state.items():
        if ".visual." in name or name.startswith("visual."):
            if "merger.mlp.2." in name:  # writes the language model's input: replicate its outputs
                out[name] = _tile(w, k, 1)
            else:
                out[name] = w.clone()
        elif name.endswith("embed_tokens.weight"):
            out[name] = _tile(w, 1, k)  # [V, D] -> [V, k D]
        elif name.startswith("lm_head"):
            out[name] = _tile(w, 1, k, divide=k)
        elif "norm.weight" in name or "layernorm.weight" in name:
            out[name] = _tile(w, k)
        elif "q_proj" in name:
            out[name] = _tile(w, k, k, divide=k) if w.dim() == 2 else _tile(w, k)
        elif "k_proj" in name or "v_proj" in name:
            out[name] = _tile(w, kv, k, divide=k) if w.dim() == 2 else _tile(w, kv)
        elif "o_proj" in name:
            out[name] = _tile(w, k, k, divide=k)
        elif "gate_proj" in name or "up_proj" in name:
            out[name] = _tile(w, m, k, divide=k)
        elif "down_proj" in name:
            out[name] = _tile(w, k, m, divide=m)
        else:
            raise KeyError(f"widen does not know how to widen {name} {tuple(w.shape)}")
    return out


@torch.no_grad()
def widen(model, k: int = 4, m: int = 4, kv: int | None = None) -> Qwen2_5_VLForConditionalGeneration:
    """A new model computing the same function as `model`, its residual stream and attention k times
    wider and its MLP intermediate m times wider (see the module docstring); its key/value heads
    replicated `kv` times (default `k`). Deterministic."""
    cfg = widened_config(model.config, k, m, kv)
    state = widen_state(model.state_dict(), k, m, _kv_copies(model.config, k, kv))
    with torch.random.fork_rng():  # the initial values are all overwritten; leave the caller's RNG alone
        wide = Qwen2_5_VLForConditionalGeneration(cfg)
    wide.load_state_dict(state, strict=True)
    wide = wide.to(model.dtype).eval()
    set_generation_defaults(wide)
    wide.generation_config = model.generation_config
    return wide


def weights_digest(model) -> str:
    """SHA-256 over every tensor of the state dict (name, dtype, shape, bytes), in name order."""
    h = hashlib.sha256()
    for name, w in sorted(model.state_dict().items()):
        h.update(f"{name}|{w.dtype}|{tuple(w.shape)}|".encode())
        h.update(w.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def norms_in_input_dtype():
    """Qwen2.5-VL's RMSNorm computes its variance in float32 whatever the model's dtype, which caps a
    float64 comparison at float32 rounding (~1e-7). Inside this context it computes in the input's
    dtype, so a float64 check sees the widening's own error (~1e-15). For verification only."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as mod

    original = mod.Qwen2_5_VLRMSNorm.forward

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    mod.Qwen2_5_VLRMSNorm.forward = forward
    try:
        yield
    finally:
        mod.Qwen2_5_VLRMSNorm.forward = original


@torch.inference_mode()
def max_logit_difference(small, wide, inputs: dict) -> float:
    """Largest |logit difference| over every position of a full forward pass (same dtype as the models)."""
    a = small(**inputs).logits
    b = wide(**inputs).logits
    return float((a - b).abs().max())
