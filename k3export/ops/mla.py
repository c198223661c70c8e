"""Absorbed latent attention: the reference math behind `torch.ops.k3.latent_mla`.

q [B, T, H, D] is the absorbed query (latent part, then the rope-slot dims); kv [B, S, D] is
the latent cache whose last T rows are the T new tokens (S >= T). Query t attends causally to
rows 0 .. S - T + t with softmax(scale * q . kv); the values are kv[..., :v_dim]. One key head
is shared by all query heads (MQA), so the cache is read once per step for every head.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("k3::latent_mla", mutates_args=())
def latent_mla(q: Tensor, kv: Tensor, v_dim: int, scale: float) -> Tensor:
    T, S = q.shape[1], kv.shape[1]
    dtype = torch.float64 if torch.float64 in (q.dtype, kv.dtype) else torch.float32
    scores = torch.einsum("bthd,bsd->bhts", q.to(dtype), kv.to(dtype)) * scale
    rows = torch.arange(S, device=q.device)
    visible = rows[None, :] <= (S - T + torch.arange(T, device=q.device))[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    o = torch.einsum("bhts,bsv->bthv", probs, kv[..., :v_dim].to(dtype))
    return o.to(q.dtype)


@latent_mla.register_fake
def _(q, kv, v_dim, scale):
    return q.new_empty(*q.shape[:3], v_dim)
