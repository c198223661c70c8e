"""Block Attention Residuals: attention along depth instead of a plain residual sum.

Each sublayer's input is a softmax-weighted mix of the banked block outputs and the block in
progress. Keys are the values RMS-normalised; one learned vector (norm.weight * proj.weight)
scores them. The weights sum to one per token, so the mix is a convex combination and its norm
never exceeds the largest input's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3export.model.layers import RMSNorm


def attn_res_weights(values: Tensor, proj: nn.Linear, norm: RMSNorm) -> Tensor:
    """values [N, ..., D] -> softmax weights over the N sources [N, ...], float32.

    proj and norm are a layer's `*_res_proj` [1, D] and `*_res_norm` [D] (checkpoint names)."""
    v = values.float()
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps)
    query = norm.weight.float() * proj.weight.float()[0]
    return (keys @ query).softmax(dim=0)


def attn_res_mix(values: list[Tensor], proj: nn.Linear, norm: RMSNorm) -> Tensor:
    """The weighted sum of `values` in float32, cast back to their dtype."""
    stacked = torch.stack(values)
    weights = attn_res_weights(stacked, proj, norm)
    return (weights[..., None] * stacked.float()).sum(0).to(values[0].dtype)
