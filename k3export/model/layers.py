"""Building blocks shared by every layer type: RMSNorm, SiTU-GLU and initialisation."""

from __future__ import annotations

import torch
from torch import Tensor, nn


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


def situ_glu(a: Tensor, b: Tensor, beta: float, linear_beta: float) -> Tensor:
    """SiTU-GLU: [beta tanh(a / beta) sigmoid(a)] * [linear_beta tanh(b / linear_beta)], in float32.

    Each factor is a soft clamp of SwiGLU's (silu(a) * b) and bounded by its beta."""
    a, b = a.float(), b.float()
    return beta * torch.tanh(a / beta) * torch.sigmoid(a) * (linear_beta * torch.tanh(b / linear_beta))


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
