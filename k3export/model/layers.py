"""Building blocks shared by every layer type: RMSNorm and SiTU-GLU (its math lives beside the
routed-experts op, which runs it too)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3export.ops.moe import situ_glu

__all__ = ["RMSNorm", "SituMLP", "situ_glu"]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class SituMLP(nn.Module):
    """A SiTU-GLU feed-forward block: layer 0's dense MLP and the (fused) shared experts."""

    def __init__(self, dim: int, hidden: int, beta: float, linear_beta: float,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_proj = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        h = situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta)
        return self.down_proj(h.to(x.dtype))
