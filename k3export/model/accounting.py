"""What a configuration costs: parameters by component, active parameters per token, decode
cache, weight bytes. Counted from the model built on the meta device, so the numbers are the
model's own and no weights are ever allocated."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from k3export.config import K3Config
from k3export.model import K3ForCausalLM

MXFP4_BITS = 4 + 8 / 32  # a 4-bit value plus one 8-bit scale per group of 32
H200_BYTES = 141 * 10**9  # one H200's HBM3e as NVIDIA states it
COMPONENTS = ("kda", "mla", "dense_ffn", "routed_experts", "shared_experts", "router",
              "latent_projections", "norms_and_attnres", "embeddings", "lm_head")


def component(name: str, config: K3Config) -> str:
    """The component a parameter (by its checkpoint-style name) belongs to."""
    if name.startswith("model.embed_tokens."):
        return "embeddings"
    if name.startswith("lm_head."):
        return "lm_head"
    layer = re.match(r"model\.layers\.(\d+)\.(\w+)\.", name)
    if layer is None:
        return "norms_and_attnres"
    index, part = int(layer[1]), layer[2]
    if part == "self_attn":
        return "mla" if config.is_mla(index) else "kda"
    if part == "mlp":
        return "dense_ffn"
    if part == "block_sparse_moe":
        for marker, comp in ((".experts.", "routed_experts"), (".shared_experts.", "shared_experts"),
                             (".gate.", "router")):
            if marker in name:
                return comp
        return "latent_projections"
    return "norms_and_attnres"


@dataclass
class Report:
    config: K3Config
    params: dict[str, int] = field(default_factory=dict)
    bytes_by_component: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.params.values())

    @property
    def active(self) -> int:
        """Per token: everything but the embedding lookup, with only top-k of the routed experts."""
        c = self.config
        inactive = self.params["routed_experts"] * (1 - c.num_experts_per_token / c.num_experts)
        return round(self.total - self.params["embeddings"] - inactive)

    @property
    def weight_bytes(self) -> int:
        return sum(self.bytes_by_component.values())

    @property
    def weight_bytes_mxfp4_experts(self) -> int:
        """Routed experts in MXFP4 (as published), everything else as stored in the model dtype."""
        routed = self.params["routed_experts"]
        return round(self.weight_bytes - self.bytes_by_component["routed_experts"] + routed * MXFP4_BITS / 8)

    def cache(self, context: int) -> dict[str, int]:
        """Decode cache bytes: per token (MLA latent rows vs plain MHA) and per sequence."""
        c = self.config
        lac = c.linear_attn_config
        elem = torch.empty(0, dtype=getattr(torch, c.torch_dtype)).element_size()
        n_mla = len(c.mla_layers)
        n_kda = c.num_hidden_layers - n_mla
        latent_per_token = n_mla * c.latent_dim * elem
        mha_per_token = n_mla * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * elem
        channels = lac.num_heads * lac.head_dim
        kda_state = n_kda * lac.num_heads * lac.head_dim * lac.head_dim * 4
        kda_conv = n_kda * 3 * (lac.short_conv_kernel_size - 1) * channels * elem
        return {
            "mla_latent_per_token": latent_per_token,
            "plain_mha_per_token": mha_per_token,
            "kda_state_per_sequence": kda_state,
            "kda_conv_per_sequence": kda_conv,
            "context": context,
            "per_sequence_at_context": kda_state + kda_conv + context * latent_per_token,
        }


def parameter_report(config: K3Config) -> Report:
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    report = Report(config, dict.fromkeys(COMPONENTS, 0), dict.fromkeys(COMPONENTS, 0))
    for name, param in model.named_parameters():
        comp = component(name, config)
        report.params[comp] += param.numel()
        report.bytes_by_component[comp] += param.numel() * param.element_size()
    return report


def moe_cost_note(config: K3Config) -> str:
    """The MoE FLOPs per token that the exported graph runs (one multiply-add = 2 FLOPs)."""

    def flops(c: K3Config) -> tuple[float, float, float]:
        """(chosen experts, every expert, shared expert + router + latent projections) per token
        per MoE layer."""
        D, L, I = c.hidden_size, c.routed_expert_hidden_size, c.moe_intermediate_size
        expert = 2 * 3 * L * I
        rest = 2 * (3 * D * c.shared_expert_size + c.num_experts * D + 2 * D * L)
        return c.num_experts_per_token * expert, c.num_experts * expert, rest

    def human(x: float) -> str:
        return next(f"{x / s:.3g} {p}FLOP" for s, p in ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""))
                    if x >= s or s == 1)

    routed, _, rest = flops(config)
    published = K3Config.from_preset("kimi-k3")
    pub_routed, pub_dense, pub_rest = flops(published)
    return (f"MoE layers run only the chosen experts: k3.RoutedExperts nodes per layer (tokens grouped "
            f"by expert, one SiTU-GLU GEMM triple per expert used; packed MXFP4 experts are dequantised "
            f"only when used). Per token per MoE layer: {human(routed)} in the top-"
            f"{config.num_experts_per_token} of {config.num_experts} routed experts + {human(rest)} in "
            f"the shared expert, router and latent projections. At the published shapes {human(pub_routed)} "
            f"+ {human(pub_rest)}, where running every expert on every token cost {human(pub_dense)} in "
            f"routed experts ({published.num_experts // published.num_experts_per_token}x).")
