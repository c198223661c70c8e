"""The latent mixture-of-experts: sigmoid router with correction bias, top-k, routed SiTU-GLU
experts in a down-projected latent space, RMSNorm on their sum, up-projection, plus a
full-width shared expert on the input."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3export.config import K3Config
from k3export.model.layers import RMSNorm, SituMLP
from k3export.ops import mxfp4


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
        scores = torch.sigmoid(x.float() @ self.weight.float().t())
        experts = self.choose(scores)
        weights = scores.gather(-1, experts)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scaling
        return experts, weights

    def choose(self, scores: Tensor) -> Tensor:
        """The top-k experts [N, k] by score plus correction bias (k3export.check.routing holds them to
        another backend's choices in half-precision checks)."""
        ranking = scores + self.e_score_correction_bias
        return torch.sort(ranking, dim=-1, descending=True, stable=True).indices[..., :self.top_k]


class RoutedExperts(nn.Module):
    """All routed experts' weights stacked: w1/w3 (gate/up) [E, I, L], w2 (down) [E, L, I].

    Checkpoints hold them per expert (`experts.{e}.w1.weight`); checkpoint.py converts.
    After `keep_packed()` they are MXFP4 buffers instead, and only the experts a call routes tokens
    to are dequantised (`torch.ops.k3.routed_experts_mxfp4`)."""

    PROJECTIONS = ("w1", "w2", "w3")

    def __init__(self, config: K3Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        E, I, L = config.num_experts, config.moe_intermediate_size, config.routed_expert_hidden_size
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta
        self.packed = False
        # The model index of the first expert held: nonzero only on an expert-parallel rank, which
        # holds a slice of the experts (k3export/model/parallel.py).
        self.expert_offset = 0
        self.w1 = nn.Parameter(torch.empty(E, I, L, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(E, I, L, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(E, L, I, dtype=dtype))

    def keep_packed(self) -> None:
        """Replaces w1/w2/w3 [E, O, I] by MXFP4 buffers `{w}_packed` [E, O, I/2] and `{w}_scale`
        [E, O, I/32] (uint8, 4.25 bits a weight instead of 16), as the published checkpoint
        stores them; the exported file keeps the same bytes, declared as int32 words
        (k3export/ops/mxfp4.py, "Words")."""
        for name in self.PROJECTIONS:
            weight = getattr(self, name)
            E, O, I = weight.shape
            delattr(self, name)
            self.register_buffer(f"{name}_packed", torch.zeros(E, O, I // 2, dtype=torch.uint8,
                                                               device=weight.device))
            self.register_buffer(f"{name}_scale", torch.zeros(E, O, I // mxfp4.GROUP, dtype=torch.uint8,
                                                              device=weight.device))
        self.packed = True

    def forward(self, z: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """u[n] = sum_j weights[n, j] * E_{experts[n, j]}(z[n]), float32 [N, L]: only the chosen
        experts run (one custom op, `k3.RoutedExperts` in ONNX)."""
        if self.packed:
            return torch.ops.k3.routed_experts_mxfp4(
                z, experts, weights, self.w1_packed, self.w1_scale, self.w3_packed, self.w3_scale,
                self.w2_packed, self.w2_scale, self.beta, self.linear_beta, self.expert_offset)
        return torch.ops.k3.routed_experts(z, experts, weights, self.w1, self.w3, self.w2, self.beta,
                                           self.linear_beta, self.expert_offset)


class LatentMoE(nn.Module):
    def __init__(self, config: K3Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        D, L = config.hidden_size, config.routed_expert_hidden_size
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
        u = self.experts(self.routed_expert_down_proj(tokens), experts, weights)
        routed = self.routed_expert_up_proj(self.routed_expert_norm(u).to(x.dtype))
        return routed.view_as(x) + self.shared_experts(x)
