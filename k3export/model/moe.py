"""The latent mixture-of-experts: sigmoid router with correction bias, top-k, routed SiTU-GLU
experts in a down-projected latent space, RMSNorm on their sum, up-projection, plus a
full-width shared expert on the input."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3export import mxfp4
from k3export.config import K3Config
from k3export.model.layers import RMSNorm, SituMLP, situ_glu


class Router(nn.Module):
    """Named `gate` in checkpoints. Scores in float32 on the full-width input."""

    def __init__(self, config: K3Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.top_k, self.scaling = config.num_experts_per_token, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=dtype))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts,
                                                                dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Returns the chosen experts [N, k] and their renormalised weights [N, k] (float32).

        The bias only ranks; the weights are the plain sigmoid scores. Ties go to the lowest
        expert index (a stable descending sort), the same rule every backend follows."""
        scores = torch.sigmoid(x.float() @ self.weight.float().T)
        ranking = scores + self.e_score_correction_bias
        experts = torch.sort(ranking, dim=-1, descending=True, stable=True).indices[..., :self.top_k]
        weights = scores.gather(-1, experts)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scaling
        return experts, weights


class RoutedExperts(nn.Module):
    """All routed experts' weights stacked: w1/w3 (gate/up) [E, I, L], w2 (down) [E, L, I].

    Checkpoints hold them per expert (`experts.{e}.w1.weight`); checkpoint.py converts.
    After `keep_packed()` they are MXFP4 buffers instead, dequantised on every forward call."""

    PROJECTIONS = ("w1", "w2", "w3")

    def __init__(self, config: K3Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        E, I, L = config.num_experts, config.moe_intermediate_size, config.routed_expert_hidden_size
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta
        self.packed = False
        self.w1 = nn.Parameter(torch.empty(E, I, L, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(E, I, L, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(E, L, I, dtype=dtype))

    def keep_packed(self) -> None:
        """Replaces w1/w2/w3 [E, O, I] by MXFP4 buffers `{w}_packed` [E, O, I/2] and `{w}_scale`
        [E, O, I/32] (uint8, 4.25 bits a weight instead of 16), as the published checkpoint
        stores them; forward then dequantises to the model dtype. torch.export's graph keeps that
        dequantisation, and the ONNX export keeps the buffers uint8 in the file and dequantises
        them in the graph in standard ops (export_onnx turns constant folding off for them)."""
        for name in self.PROJECTIONS:
            weight = getattr(self, name)
            E, O, I = weight.shape
            self.dtype = weight.dtype
            delattr(self, name)
            self.register_buffer(f"{name}_packed", torch.zeros(E, O, I // 2, dtype=torch.uint8,
                                                               device=weight.device))
            self.register_buffer(f"{name}_scale", torch.zeros(E, O, I // mxfp4.GROUP, dtype=torch.uint8,
                                                              device=weight.device))
        self.packed = True

    def weight(self, name: str) -> Tensor:
        if not self.packed:
            return getattr(self, name)
        return mxfp4.dequantize(getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"), self.dtype)

    def forward(self, z: Tensor, combine: Tensor) -> Tensor:
        """sum_e combine[n, e] * E_e(z_n), accumulated in float32.

        Dense dispatch: every expert runs on every token and `combine` (zero off the top-k)
        selects. It is static-shaped, so it traces and exports, at E / k times the FLOPs of a
        grouped GEMM; a grouped-GEMM MoE plugin is later work."""
        # Batched matmuls over experts rather than einsum: ONNX's Einsum has no bfloat16.
        a = z @ self.weight("w1").transpose(1, 2)  # [E, N, I]
        b = z @ self.weight("w3").transpose(1, 2)
        h = situ_glu(a, b, self.beta, self.linear_beta).to(z.dtype)
        y = h @ self.weight("w2").transpose(1, 2)  # [E, N, L]
        return (y.float() * combine.T[..., None]).sum(0)


class LatentMoE(nn.Module):
    def __init__(self, config: K3Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        D, L = config.hidden_size, config.routed_expert_hidden_size
        self.num_experts = config.num_experts
        self.gate = Router(config, dtype)
        self.routed_expert_down_proj = nn.Linear(D, L, bias=False, dtype=dtype)
        self.experts = RoutedExperts(config, dtype)
        self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps, dtype=dtype)
        self.routed_expert_up_proj = nn.Linear(L, D, bias=False, dtype=dtype)
        self.shared_experts = SituMLP(D, config.shared_expert_size, config.activation_situ_beta,
                                      config.activation_situ_linear_beta, dtype)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.flatten(0, -2)
        experts, weights = self.gate(tokens)
        combine = torch.zeros(tokens.shape[0], self.num_experts, dtype=torch.float32,
                              device=x.device).scatter(-1, experts, weights)
        u = self.experts(self.routed_expert_down_proj(tokens), combine)
        routed = self.routed_expert_up_proj(self.routed_expert_norm(u).to(x.dtype))
        return routed.view_as(x) + self.shared_experts(x)
