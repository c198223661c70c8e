"""Absorbed latent attention over a fixed-capacity cache: the reference math behind
`torch.ops.k3.latent_mla`, and the cache write `torch.ops.k3.tensor_scatter` that precedes it.

latent_mla(q [B, T, H, D], kv [B, 1, C, D], cache_lengths [B] int64, v_dim, scale) -> o [B, T, H, v_dim]

q is the absorbed query (latent part, then the rope-slot dims); kv is the latent cache of
capacity C after this call's T new rows were written at rows cache_lengths[b] .. cache_lengths[b]
+ T - 1. Query t of row b attends to rows j <= cache_lengths[b] + t with softmax(scale * q . kv);
the values are kv[..., :v_dim]. Padded queries (past a row's valid inputs) still see a valid
prefix, so they stay finite; callers ignore them. One key head is shared by all query heads (MQA),
so the cache is read once per step for every head. Only the rows up to max(cache_lengths) + T are
read, never the whole capacity.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("k3::tensor_scatter", mutates_args=())
def tensor_scatter(past: Tensor, update: Tensor, write_indices: Tensor) -> Tensor:
    """ONNX TensorScatter (opset 24, axis -2, linear mode): past [B, ..., C, D] with update
    [B, ..., T, D] written at rows write_indices[b] .. write_indices[b] + T - 1 of row b."""
    present = past.clone()
    T = update.shape[-2]
    for b, start in enumerate(write_indices.tolist()):
        present[b, ..., start:start + T, :] = update[b]
    return present


@tensor_scatter.register_fake
def _(past, update, write_indices):
    return past.new_empty(past.shape)


@torch.library.custom_op("k3::latent_mla", mutates_args=())
def latent_mla(q: Tensor, kv: Tensor, cache_lengths: Tensor, v_dim: int, scale: float) -> Tensor:
    T = q.shape[1]
    rows = min(int(cache_lengths.max()) + T, kv.shape[2])
    dtype = torch.float64 if torch.float64 in (q.dtype, kv.dtype) else torch.float32
    keys = kv[:, 0, :rows].to(dtype)
    scores = torch.einsum("bthd,bsd->bhts", q.to(dtype), keys) * scale
    last_visible = cache_lengths[:, None] + torch.arange(T, device=q.device)  # [B, T]
    visible = torch.arange(rows, device=q.device) <= last_visible[..., None]  # [B, T, rows]
    probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(dim=-1)
    o = torch.einsum("bhts,bsv->bthv", probs, keys[..., :v_dim])
    return o.to(q.dtype)


@latent_mla.register_fake
def _(q, kv, cache_lengths, v_dim, scale):
    return q.new_empty(*q.shape[:3], v_dim)


# The exported graph runs latent_mla as two nodes (k3export/onnx/ops.py): the splits of each row's cache,
# then their combine, so that an engine's AOT kernels can split the cache (an AOT plugin is one launch with
# no workspace: the partials are a graph tensor between the two). These are the two nodes' references (the
# parsed network's evaluator calls them): one split, the whole visible cache, which the combine returns as
# it is; a kernel may split the cache in any number of parts, the combine's result is the same.


@torch.library.custom_op("k3::latent_mla_splits", mutates_args=())
def latent_mla_splits(q: Tensor, kv: Tensor, cache_lengths: Tensor, v_dim: int,
                      scale: float) -> tuple[Tensor, Tensor]:
    """(o_part [S, B, T, H, v_dim], lse [S, B, T, H]), float32, S = 1: latent_mla's output before the cast
    to q's dtype, and the log-sum-exp of each query's visible scores."""
    T = q.shape[1]
    rows = min(int(cache_lengths.max()) + T, kv.shape[2])
    keys = kv[:, 0, :rows].float()
    scores = torch.einsum("bthd,bsd->bths", q.float(), keys) * scale
    last_visible = cache_lengths[:, None] + torch.arange(T, device=q.device)  # [B, T]
    visible = torch.arange(rows, device=q.device) <= last_visible[..., None]  # [B, T, rows]
    scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
    o = torch.einsum("bths,bsv->bthv", scores.softmax(dim=-1), keys[..., :v_dim])
    return o[None], scores.logsumexp(dim=-1)[None]


@torch.library.custom_op("k3::latent_mla_combine", mutates_args=())
def latent_mla_combine(q: Tensor, o_part: Tensor, lse: Tensor) -> Tensor:
    """o [B, T, H, v_dim] in q's dtype (q gives only that): the splits' outputs weighted by exp(lse - max)."""
    weights = torch.softmax(lse, dim=0)  # exp(lse_s - max) / sum: splits without a visible row weigh 0
    o = (weights[..., None] * o_part.nan_to_num()).sum(dim=0)  # an empty split's part is never written
    return o.to(q.dtype)
