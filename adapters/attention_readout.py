"""Reading a decoder's attention from the outside, for the attention scorer.

Any adapter whose language model has the usual transformers layout (`layers[i].self_attn` with
`q_proj`, optional `q_norm`, rotate-half RoPE from `position_embeddings`, keys cached post-RoPE)
gets the three methods the scorer needs by mixing this in.
"""

from __future__ import annotations

import torch

from hippo.errors import InputError
from hippo.session import KVSession


class AttentionReadout:
    model: torch.nn.Module

    def attention_modules(self) -> list[torch.nn.Module]:
        """The self-attention module of each decoder layer, in order (forward pre-hooks go here)."""
        return [layer.self_attn for layer in self.model.model.language_model.layers]

    @torch.inference_mode()
    def project_queries(
        self,
        layer_idx: int,
        hidden: torch.Tensor,  # [T, D] the attention module's input rows (after input_layernorm)
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # (cos [T, d], sin [T, d]) for those rows
    ) -> torch.Tensor:  # -> [H, T, d] post-RoPE queries, multiplied by the softmax scale
        attn = self.attention_modules()[layer_idx]
        q = attn.q_proj(hidden).view(hidden.shape[0], -1, attn.head_dim)  # [T, H, d]
        if getattr(attn, "q_norm", None) is not None:  # Qwen3-style per-head RMSNorm before RoPE
            q = attn.q_norm(q)
        q = q.transpose(0, 1)
        cos, sin = (x.to(q.dtype)[None] for x in position_embeddings)
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)  # rotate_half
        return (q * cos + rotated * sin) * attn.scaling

    def cached_keys(self, session: KVSession, layer_idx: int) -> torch.Tensor:  # -> [H_kv, L, d] post-RoPE
        if session.cache is None:
            raise InputError("the target session is closed; its KV cache is gone")
        return session.cache.layers[layer_idx].keys[
            0, :, : session.cache_len()
        ]  # a static cache has spare slots
