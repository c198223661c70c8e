"""Gated latent MLA with query LoRA and no rotary embedding (NoPE).

The layer always runs in the absorbed form: the query is carried into the latent space
(q~_h = W_UK,h^T q_nope_h), attends against the cached latent rows [c | k_r] through
`torch.ops.k3.latent_mla`, and W_UV carries the result back to each head's value space.
The sigmoid output gate sits between W_UV and o_proj, so W_UV cannot fold into o_proj.
The cache is a buffer of fixed capacity written in place at each row's length
(`torch.ops.k3.tensor_scatter`, ONNX TensorScatter), never concatenated.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3export.config import K3Config
from k3export.model.cache import MLACache
from k3export.model.layers import RMSNorm


class LatentMLA(nn.Module):
    def __init__(self, config: K3Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.nope_dim, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        self.latent_rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.scale = config.mla_scale
        self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False, dtype=dtype)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.mla_eps, dtype=dtype)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * config.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(D, config.latent_dim, bias=False, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.mla_eps, dtype=dtype)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (self.nope_dim + self.v_dim),
                                   bias=False, dtype=dtype)
        self.g_proj = nn.Linear(D, H * self.v_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=False, dtype=dtype)

    def query(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head (q_nope, q_rope) for the normed input x [B, T, D]."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.unflatten(-1, (self.num_heads, -1))
        return q[..., :self.nope_dim], q[..., self.nope_dim:]

    def latent_rows(self, x: Tensor) -> Tensor:
        """The cache rows of x's tokens: [RMSNorm(c_kv) | k_r], k_r shared by all heads."""
        # Slices, not split(): ONNX's SplitToSequence has no bfloat16.
        kv = self.kv_a_proj_with_mqa(x)
        c_kv, k_r = kv[..., :self.latent_rank], kv[..., self.latent_rank:]
        return torch.cat([self.kv_a_layernorm(c_kv), k_r], dim=-1)

    def head_weights(self) -> tuple[Tensor, Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, v, rank] from kv_b_proj (rows head-major)."""
        w = self.kv_b_proj.weight.unflatten(0, (self.num_heads, -1))
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def forward(self, x: Tensor, cache: MLACache, cache_lengths: Tensor,
                input_lengths: Tensor) -> tuple[Tensor, MLACache]:
        """x [B, T, D] right-padded; the T new latent rows go to rows cache_lengths[b] .. of the
        cache (padding included: those rows lie past the row's new length and are never keys)."""
        q_nope, q_rope = self.query(x)
        latent = torch.ops.k3.tensor_scatter(cache.mla_latent, self.latent_rows(x)[:, None], cache_lengths)
        w_uk, w_uv = self.head_weights()
        # Per-head matmuls with heads leading (ONNX's Einsum has no bfloat16).
        q_latent = (q_nope.transpose(1, 2) @ w_uk).transpose(1, 2)  # [B, T, H, rank]
        o_latent = torch.ops.k3.latent_mla(torch.cat([q_latent, q_rope], dim=-1), latent, cache_lengths,
                                           self.latent_rank, self.scale)
        o = (o_latent.transpose(1, 2) @ w_uv.transpose(1, 2)).transpose(1, 2).flatten(-2)
        y = o.float() * torch.sigmoid(self.g_proj(x).float())
        return self.o_proj(y.to(x.dtype)), MLACache(latent)
