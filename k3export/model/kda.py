"""The KDA layer (Kimi Delta Attention): short convs, L2-normed q/k, per-channel decay,
delta-rule recurrence (`torch.ops.k3.kda`), output RMSNorm and a full-rank sigmoid gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3export.config import K3Config
from k3export.model.cache import KDACache
from k3export.model.layers import RMSNorm


def causal_conv(x: Tensor, tail: Tensor, weight: Tensor, input_lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over time, then SiLU, in float32 (the weights are float32).

    x: [B, T, C], right-padded past input_lengths[b]; tail: [B, W-1, C], the inputs before x;
    weight: [C, 1, W], whose last tap multiplies the current token. Returns the output in x's
    dtype and the new tail: each row's last W-1 valid inputs (its old tail if it has none)."""
    width = weight.shape[-1]
    window = torch.cat([tail, x], dim=1)
    y = F.conv1d(window.float().transpose(1, 2), weight.float(), groups=weight.shape[0])
    # Row b's valid window ends at W-1 + input_lengths[b]: its tail is the W-1 entries before that.
    rows = input_lengths[:, None] + torch.arange(width - 1, device=x.device)  # [B, W-1]
    new_tail = torch.gather(window, 1, rows[..., None].expand(-1, -1, window.shape[-1]))
    return F.silu(y).transpose(1, 2).to(x.dtype), new_tail


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        lac = config.linear_attn_config
        self.num_heads, self.head_dim = lac.num_heads, lac.head_dim
        self.lower_bound = lac.gate_lower_bound
        D, K, W = config.hidden_size, lac.head_dim, lac.short_conv_kernel_size
        C = lac.num_heads * K
        f32 = torch.float32
        self.q_proj = nn.Linear(D, C, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(D, C, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(D, C, bias=False, dtype=dtype)
        # Conv weights, decay parameters and the output norm stay float32 whatever the model
        # dtype: rounding them to bf16 measurably changes the recurrence.
        self.q_conv1d = nn.Conv1d(C, C, W, groups=C, bias=False, dtype=f32)
        self.k_conv1d = nn.Conv1d(C, C, W, groups=C, bias=False, dtype=f32)
        self.v_conv1d = nn.Conv1d(C, C, W, groups=C, bias=False, dtype=f32)
        self.f_a_proj = nn.Linear(D, K, bias=False, dtype=dtype)
        self.f_b_proj = nn.Linear(K, C, bias=False, dtype=dtype)
        self.A_log = nn.Parameter(torch.empty(lac.num_heads, dtype=f32))
        self.dt_bias = nn.Parameter(torch.empty(C, dtype=f32))
        self.b_proj = nn.Linear(D, lac.num_heads, bias=False, dtype=dtype)
        self.g_proj = nn.Linear(D, C, bias=False, dtype=dtype)
        self.o_norm = RMSNorm(K, config.rms_norm_eps, dtype=f32)
        self.o_proj = nn.Linear(C, D, bias=False, dtype=dtype)

    def decay(self, x: Tensor) -> Tensor:
        """Log decay g per head and key channel, float32, in (lower_bound, 0)."""
        f = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias
        f = f.unflatten(-1, (self.num_heads, self.head_dim))
        a = self.A_log.exp()[:, None]
        if self.lower_bound is None:
            return -a * F.softplus(f)
        return self.lower_bound * torch.sigmoid(a * f)

    def forward(self, x: Tensor, cache: KDACache, cache_lengths: Tensor,
                input_lengths: Tensor) -> tuple[Tensor, KDACache]:
        """x [B, T, D] right-padded past input_lengths[b]: padded positions leave the state and
        the conv tails as they were (their outputs are ignored by the caller)."""
        heads = (self.num_heads, self.head_dim)
        q, q_conv = causal_conv(self.q_proj(x), cache.q_conv, self.q_conv1d.weight, input_lengths)
        k, k_conv = causal_conv(self.k_proj(x), cache.k_conv, self.k_conv1d.weight, input_lengths)
        v, v_conv = causal_conv(self.v_proj(x), cache.v_conv, self.v_conv1d.weight, input_lengths)
        q = l2_normalize(q.unflatten(-1, heads)) * self.head_dim**-0.5
        k = l2_normalize(k.unflatten(-1, heads))
        v = v.unflatten(-1, heads)
        beta = torch.sigmoid(self.b_proj(x).float())
        g = self.decay(x)
        # With k = 0, beta = 0 and g = 0 a step is the identity on the state: S <- S.
        valid = torch.arange(x.shape[1], device=x.device) < input_lengths[:, None]  # [B, T]
        k, beta, g = k * valid[..., None, None], beta * valid[..., None], g * valid[..., None, None]
        o, state = torch.ops.k3.kda(q, k, v, g, beta, cache.kda_state)
        # RMSNorm over each head's dims (one weight shared by all heads), then the gate.
        y = self.o_norm(o.float()).flatten(-2) * torch.sigmoid(self.g_proj(x).float())
        return self.o_proj(y.to(x.dtype)), KDACache(state, q_conv, k_conv, v_conv)
