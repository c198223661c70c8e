"""Tensor and expert parallelism, applied to the plain model after the fact (as gpt-fast's tp.py does):
`split_model(model, rank, ranks)` keeps rank r's share of every layer's weights in place and inserts
the sums over ranks (`torch.ops.k3.all_reduce`, a `DistCollective` node once exported). The model
files stay as they are; with ranks = 1 nothing changes. Run the N ranks' models under
`torchrun --nproc-per-node N`: together they compute the unsplit model.

What rank r of N holds (H heads, E experts, widths as in the config), and the sums per token:

    KDA     heads [rH/N, (r+1)H/N): their rows of q/k/v_proj, q/k/v_conv1d, f_b_proj, dt_bias, g_proj,
            b_proj (beta) and A_log, and their recurrent state and conv tails; f_a_proj and o_norm
            (shared by every head) replicated; o_proj's input columns of those heads, then one
            all-reduce of its output: D values in the model dtype.
    MLA     q_a_proj, kv_a_proj_with_mqa and their norms replicated, so the latent cache (one key
            head) is the same on every rank; q_b_proj, kv_b_proj (the absorbed W_UK, W_UV) and
            g_proj rows of the rank's heads, o_proj's columns; one all-reduce: D values, model dtype.
    MoE     router replicated (float32 scores of the full-width input: every rank chooses the same
            experts); routed_expert_down/up_proj and routed_expert_norm replicated; routed experts
            [rE/N, (r+1)E/N) whole, running only the pairs routed to them (the op's expert_offset);
            the shared expert's intermediate width split. One all-reduce of [u | shared] in float32,
            L + D values: u must be summed before the latent RMSNorm (docs/architecture.md), and the
            shared expert's partial sum rides along, so the layer needs one collective, not two.
    dense   layer 0's MLP split along its intermediate width; one all-reduce: D values, model dtype.
    rest    embedding, AttnRes projections and norms, final norm and LM head replicated: 2 V D bytes
            of the model dtype on the first and last stage's ranks (2 x 2.35 GB in bf16 for kimi-k3),
            so that every rank has the logits and no collective sits outside the layers.

So a layer costs two all-reduces per token (attention, then FFN), and each is a sum in a fixed rank
order, not the unsplit model's summation order: float32 results agree to rounding (about 1e-7).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.model import K3ForCausalLM
from k3export.model.kda import KimiDeltaAttention
from k3export.model.layers import SituMLP
from k3export.model.mla import LatentMLA
from k3export.model.moe import LatentMoE


@dataclass(frozen=True)
class Kept:
    """A split parameter or buffer: the rank holds `index` of the unsplit tensor, of shape `shape`."""

    index: tuple[slice, ...]
    shape: torch.Size


@dataclass(frozen=True)
class RankSplit:
    """What `split_model` records on the model it splits (`model.tensor_parallel`)."""

    rank: int
    ranks: int
    config: K3Config  # the unsplit model's (the split model's own config has the rank's heads)
    # Parameter or buffer name -> what the rank holds of it; names not here are replicated whole.
    # A checkpoint loader reads only these parts (k3export/weights/checkpoint.py).
    kept: dict[str, Kept] = dataclasses.field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Collective:
    """One sum over the ranks: after a layer's attention (o_proj) or its FFN, of `values` per token."""

    layer: int
    after: str  # "attention" or "ffn"
    values: int  # per token
    dtype: str  # "model" (the model dtype) or "float32"

    def bytes_per_token(self, model_dtype: torch.dtype) -> int:
        size = 4 if self.dtype == "float32" else torch.empty(0, dtype=model_dtype).element_size()
        return self.values * size


def collectives(config: K3Config, layers: range) -> list[Collective]:
    """The all-reduces a split model runs over `layers`, in order: each layer's attention, then its
    FFN (a MoE layer's [u | shared] in float32, a dense layer's output in the model dtype)."""
    D, L = config.hidden_size, config.routed_expert_hidden_size
    sums = []
    for i in layers:
        sums.append(Collective(i, "attention", D, "model"))
        sums.append(Collective(i, "ffn", D, "model") if config.is_dense(i)
                    else Collective(i, "ffn", L + D, "float32"))
    return sums


def split_sizes(config: K3Config) -> dict[str, int]:
    """What a split divides among the ranks, by config field."""
    return {"linear_attn_config.num_heads": config.linear_attn_config.num_heads,
            "num_attention_heads": config.num_attention_heads,
            "num_experts": config.num_experts,
            "intermediate_size": config.intermediate_size,
            "shared_expert_size (num_shared_experts x moe_intermediate_size)": config.shared_expert_size}


def check_split(config: K3Config, ranks: int) -> None:
    """Refuses a rank count that does not divide the heads, the experts and the split widths."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise UserError(f"ranks = {ranks!r}: expected a positive integer (GPUs per pipeline stage)")
    uneven = [f"{name} = {size}" for name, size in split_sizes(config).items() if size % ranks]
    if uneven:
        raise UserError(f"ranks = {ranks} does not divide {', '.join(uneven)}: expected a rank count that "
                        "divides the heads, the experts and the MLP widths")


def check_rank(config: K3Config, rank: int, ranks: int) -> None:
    """Refuses a split that does not divide, or a rank outside 0 .. ranks - 1."""
    check_split(config, ranks)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < ranks:
        raise UserError(f"rank = {rank!r}: expected 0 <= rank < ranks = {ranks}")


def rank_config(config: K3Config, ranks: int) -> K3Config:
    """The config as one rank sees its layers' caches: 1/ranks of the KDA and MLA heads."""
    check_split(config, ranks)
    lac = dataclasses.replace(config.linear_attn_config,
                              num_heads=config.linear_attn_config.num_heads // ranks)
    return dataclasses.replace(config, linear_attn_config=lac,
                               num_attention_heads=config.num_attention_heads // ranks)


def _part(size: int, rank: int, ranks: int) -> slice:
    share = size // ranks
    return slice(rank * share, (rank + 1) * share)


def _keep(module: nn.Module, name: str, index: tuple[slice, ...]) -> None:
    """Replaces the parameter or buffer `name` by its slice `index` (a copy: the full tensor is freed),
    and records the slice in the module's `kept_slices` (split_model gathers them)."""
    tensor = getattr(module, name)
    kept = tensor[index].clone()
    if isinstance(tensor, nn.Parameter):
        setattr(module, name, nn.Parameter(kept, requires_grad=tensor.requires_grad))
    else:
        module.register_buffer(name, kept)
    if not hasattr(module, "kept_slices"):
        module.kept_slices = {}
    module.kept_slices[name] = Kept(index, tensor.shape)


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    _keep(linear, "weight", (rows,))
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: nn.Linear, columns: slice) -> None:
    _keep(linear, "weight", (slice(None), columns))
    linear.in_features = linear.weight.shape[1]


def _sum_output(module: nn.Module, ranks: int) -> None:
    """Sums the module's output over the ranks (a forward hook: the module's code stays as it is)."""
    module.register_forward_hook(lambda _module, _inputs, output: torch.ops.k3.all_reduce(output, ranks))


def _heads(size_per_head: int, heads: slice) -> slice:
    return slice(heads.start * size_per_head, heads.stop * size_per_head)


def _split_kda(kda: KimiDeltaAttention, rank: int, ranks: int) -> None:
    heads = _part(kda.num_heads, rank, ranks)
    channels = _heads(kda.head_dim, heads)
    for linear in (kda.q_proj, kda.k_proj, kda.v_proj, kda.f_b_proj, kda.g_proj):
        _keep_rows(linear, channels)
    for conv in (kda.q_conv1d, kda.k_conv1d, kda.v_conv1d):
        _keep(conv, "weight", (channels,))
        conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]
    _keep(kda, "A_log", (heads,))
    _keep(kda, "dt_bias", (channels,))
    _keep_rows(kda.b_proj, heads)
    _keep_columns(kda.o_proj, channels)
    kda.num_heads //= ranks
    _sum_output(kda.o_proj, ranks)


def _split_mla(mla: LatentMLA, rank: int, ranks: int) -> None:
    heads = _part(mla.num_heads, rank, ranks)
    _keep_rows(mla.q_b_proj, _heads(mla.nope_dim + mla.rope_dim, heads))
    _keep_rows(mla.kv_b_proj, _heads(mla.nope_dim + mla.v_dim, heads))
    _keep_rows(mla.g_proj, _heads(mla.v_dim, heads))
    _keep_columns(mla.o_proj, _heads(mla.v_dim, heads))
    mla.num_heads //= ranks
    _sum_output(mla.o_proj, ranks)


def _split_mlp(mlp: SituMLP, rank: int, ranks: int) -> None:
    """This rank's share of the intermediate width: the MLP's output is then a partial sum."""
    width = _part(mlp.gate_proj.out_features, rank, ranks)
    _keep_rows(mlp.gate_proj, width)
    _keep_rows(mlp.up_proj, width)
    _keep_columns(mlp.down_proj, width)


class ExpertParallelMoE(LatentMoE):
    """LatentMoE on one rank: this rank's experts and share of the shared expert, their partial sums
    added over the ranks in one all-reduce before the latent norm."""

    ranks: int

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.flatten(0, -2)
        experts, weights = self.gate(tokens)
        u = self.experts(self.routed_expert_down_proj(tokens), experts, weights)
        shared = self.shared_experts(tokens)
        summed = torch.ops.k3.all_reduce(torch.cat([u, shared.float()], dim=-1), self.ranks)
        u, shared = summed[:, :u.shape[-1]], summed[:, u.shape[-1]:]
        routed = self.routed_expert_up_proj(self.routed_expert_norm(u).to(x.dtype))
        return (routed + shared.to(x.dtype)).view_as(x)


def _split_moe(moe: LatentMoE, rank: int, ranks: int) -> None:
    experts = moe.experts
    held = _part(moe.gate.weight.shape[0], rank, ranks)
    # Every stacked expert tensor, float (w1, w3, w2) or MXFP4 (*_packed, *_scale), is [E, ...].
    for name, _ in [*experts.named_parameters(recurse=False), *experts.named_buffers(recurse=False)]:
        _keep(experts, name, (held,))
    experts.expert_offset = held.start
    _split_mlp(moe.shared_experts, rank, ranks)
    moe.__class__ = ExpertParallelMoE
    moe.ranks = ranks


def split_model(model: K3ForCausalLM, rank: int, ranks: int) -> K3ForCausalLM:
    """Keeps rank `rank` of `ranks`'s share of `model` (in place; returns it), its collectives inserted.

    The model's config becomes the rank's (rank_config: its heads), so its caches have the rank's
    shapes; `model.tensor_parallel` is a RankSplit (absent on an unsplit model, and for ranks = 1).
    Layers on the meta device (not in this process's pipeline stage) are split all the same, at no
    cost; so is a model wholly on the meta device, whose rank's weights are then loaded from a
    checkpoint, each tensor's kept part alone (k3export/weights/checkpoint.py build_model)."""
    split = getattr(model, "tensor_parallel", None)
    if split is not None:
        raise UserError(f"the model is already split (rank {split.rank} of {split.ranks}); split the unsplit "
                        "model")
    check_rank(model.config, rank, ranks)
    if ranks == 1:
        return model
    config = model.config
    for layer in model.model.layers:
        if layer.is_mla:
            _split_mla(layer.self_attn, rank, ranks)
        else:
            _split_kda(layer.self_attn, rank, ranks)
        if layer.is_dense:
            _split_mlp(layer.mlp, rank, ranks)
            _sum_output(layer.mlp.down_proj, ranks)
        else:
            _split_moe(layer.block_sparse_moe, rank, ranks)
    kept = {f"{prefix}.{name}": part for prefix, module in model.named_modules()
            for name, part in getattr(module, "kept_slices", {}).items()}
    model.tensor_parallel = RankSplit(rank, ranks, config, kept)
    model.config = rank_config(config, ranks)
    return model
