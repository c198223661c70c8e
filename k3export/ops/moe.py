"""Routed experts: the reference math behind `torch.ops.k3.routed_experts` and its MXFP4 form.

z [N, L] (the latent tokens, model dtype), experts [N, k] int64 and weights [N, k] float32 (the
router's choice and renormalised weights), w1 / w3 (gate / up) [E, I, L] and w2 (down) [E, L, I]:

    u[n] = sum_j weights[n, j] * w2[e] @ SiTU-GLU(w1[e] @ z[n], w3[e] @ z[n]),  e = experts[n, j]

u [N, L] is accumulated in float32 (float64 when z is, for tight reference tests). The matmuls run
in z's dtype and SiTU-GLU in float32, as the model's dense layers do. Only the selected experts
run: the (token, slot) pairs are grouped by expert and each used expert is one matmul per
projection over its tokens, so the cost is top_k / num_experts of running every expert on every
token (plus a few ops per used expert).

Expert parallelism (k3export/model/parallel.py) gives each rank a contiguous slice of the experts: the
weights then hold experts expert_offset .. expert_offset + E - 1 of the model, while `experts`
keeps the router's model-wide indices; pairs routed to an expert outside the slice belong to another
rank and contribute nothing here (u is this rank's partial sum). With expert_offset = 0 and all the
model's experts this is the plain layer. `routed_experts_mxfp4` takes the
experts as the published checkpoint stores them (k3export.ops.mxfp4: packed [E, O, I/2] uint8, low
nibble first, E8M0 scales [E, O, I/32]) and dequantises only the experts that receive a token. The
exported file and the plugin hold the same bytes as int32 words (k3export/ops/mxfp4.py, "Words"); the
plugin definition views them back to these bytes for this op.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import Tensor

from k3export.errors import UserError
from k3export.ops import mxfp4

ExpertWeight = Callable[[int, str, torch.dtype], Tensor]


def situ_glu(a: Tensor, b: Tensor, beta: float, linear_beta: float) -> Tensor:
    """SiTU-GLU: [beta tanh(a / beta) sigmoid(a)] * [linear_beta tanh(b / linear_beta)], in float32
    (float64 for float64 inputs). Each factor is a soft clamp of SwiGLU's (silu(a) * b), bounded by
    its beta. Used by every routed expert, the shared experts and layer 0's dense MLP."""
    dtype = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    a, b = a.to(dtype), b.to(dtype)
    return beta * torch.tanh(a / beta) * torch.sigmoid(a) * (linear_beta * torch.tanh(b / linear_beta))


def _check(z: Tensor, experts: Tensor, weights: Tensor, hidden: int, expert_offset: int) -> None:
    if z.dim() != 2 or z.shape[1] != hidden:
        raise UserError(f"routed_experts: z has shape {list(z.shape)}; expected [tokens, {hidden}]")
    if experts.shape != weights.shape or experts.dim() != 2 or experts.shape[0] != z.shape[0]:
        raise UserError(f"routed_experts: experts {list(experts.shape)} and weights {list(weights.shape)}; "
                        f"expected both [{z.shape[0]}, top_k]")
    if experts.dtype != torch.int64:
        raise UserError(f"routed_experts: experts are {experts.dtype}; expected torch.int64")
    if expert_offset < 0:
        raise UserError(f"routed_experts: expert_offset = {expert_offset}; expected >= 0")
    if experts.numel() and int(experts.min()) < 0:
        raise UserError(f"routed_experts: expert indices span {int(experts.min())}..{int(experts.max())}; "
                        "expected indices >= 0")


def _accumulation_dtype(z: Tensor) -> torch.dtype:
    return torch.float64 if z.dtype == torch.float64 else torch.float32


def group(experts: Tensor, num_experts: int, expert_offset: int) -> tuple[Tensor, Tensor, Tensor]:
    """The (token, slot) pairs n * k + j grouped by local expert, stable: (sorted_pairs [N k], offsets
    [E + 1], slots [N, k]), int32. Expert e's pairs are sorted_pairs[offsets[e] : offsets[e + 1]]; the pairs
    held elsewhere (another rank's experts) follow, offsets[E] counts the held ones; a pair's slot is its
    position in sorted_pairs, -1 where held elsewhere."""
    local = experts.flatten() - expert_offset
    held = (local >= 0) & (local < num_experts)
    key = torch.where(held, local, num_experts)
    order = torch.sort(key, stable=True).indices
    offsets = torch.searchsorted(key[order], torch.arange(num_experts + 1, device=key.device))
    slots = torch.empty_like(order)
    slots[order] = torch.arange(order.numel(), device=order.device)
    slots = torch.where(held, slots, -1).view(experts.shape)
    return order.to(torch.int32), offsets.to(torch.int32), slots.to(torch.int32)


def _segments(offsets: Tensor) -> list[tuple[int, int, int]]:
    """(expert, first slot, end slot) of each expert with pairs."""
    bounds = offsets.tolist()
    return [(e, start, end) for e, (start, end) in enumerate(itertools.pairwise(bounds)) if end > start]


def gate_up(z: Tensor, sorted_pairs: Tensor, offsets: Tensor, expert_weight: ExpertWeight, intermediate: int,
            beta: float, linear_beta: float) -> Tensor:
    """h [N k, I] in z's dtype: SiTU-GLU(w1[e] z[n], w3[e] z[n]) in each slot of expert e's pairs (n, j) (the
    slots past the held pairs 0)."""
    top_k = sorted_pairs.numel() // max(z.shape[0], 1)
    h = z.new_zeros(sorted_pairs.numel(), intermediate)
    for e, start, end in _segments(offsets):
        x = z[sorted_pairs[start:end].long() // top_k]
        h[start:end] = situ_glu(x @ expert_weight(e, "w1", z.dtype).T, x @ expert_weight(e, "w3", z.dtype).T,
                                beta, linear_beta).to(z.dtype)
    return h


def down(h: Tensor, offsets: Tensor, expert_weight: ExpertWeight, hidden: int) -> Tensor:
    """y [N k, L] float32 (float64 for float64 h): w2[e] h[s] in each slot of expert e's pairs."""
    y = h.new_zeros(h.shape[0], hidden, dtype=_accumulation_dtype(h))
    for e, start, end in _segments(offsets):
        y[start:end] = h[start:end] @ expert_weight(e, "w2", h.dtype).T
    return y


def combine(y: Tensor, slots: Tensor, weights: Tensor) -> Tensor:
    """u [N, L]: each token's held slots' y times their routing weights, summed over its k slots."""
    rows = torch.where((slots >= 0)[..., None], y[slots.clamp(min=0).long()], 0)  # [N, k, L]
    return (rows * weights.to(y.dtype)[..., None]).sum(1)


def grouped_experts(z: Tensor, experts: Tensor, weights: Tensor, expert_weight: ExpertWeight,
                    num_experts: int, intermediate: int, expert_offset: int, beta: float,
                    linear_beta: float) -> Tensor:
    """u [N, L] with each used expert run once, on the tokens routed to it, in the four stages the exported
    graph runs as nodes (k3export/onnx/moe.py): group, gate/up, down, combine.

    `expert_weight(e, name, dtype)` gives local expert e's (model expert expert_offset + e) w1, w3
    or w2 in `dtype` (a slice, or a dequantisation); each is asked for once per used expert. The
    working set is the routed activations ([N * k, I] and [N * k, L]) and one expert's weight at a
    time."""
    sorted_pairs, offsets, slots = group(experts, num_experts, expert_offset)
    h = gate_up(z, sorted_pairs, offsets, expert_weight, intermediate, beta, linear_beta)
    return combine(down(h, offsets, expert_weight, z.shape[1]), slots, weights)


def _sliced(stacked: dict[str, Tensor]) -> ExpertWeight:
    return lambda e, name, dtype: stacked[name][e].to(dtype)


def _dequantized(packed: dict[str, tuple[Tensor, Tensor]]) -> ExpertWeight:
    return lambda e, name, dtype: mxfp4.dequantize(packed[name][0][e], packed[name][1][e], dtype)


@torch.library.custom_op("k3::routed_experts", mutates_args=())
def routed_experts(z: Tensor, experts: Tensor, weights: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                   situ_beta: float, situ_linear_beta: float, expert_offset: int = 0) -> Tensor:
    _check(z, experts, weights, w1.shape[2], expert_offset)
    return grouped_experts(z, experts, weights, _sliced({"w1": w1, "w3": w3, "w2": w2}), w1.shape[0],
                           w1.shape[1], expert_offset, situ_beta, situ_linear_beta)


@routed_experts.register_fake
def _(z, experts, weights, w1, w3, w2, situ_beta, situ_linear_beta, expert_offset=0):
    return z.new_empty(z.shape, dtype=_accumulation_dtype(z))


@torch.library.custom_op("k3::routed_experts_mxfp4", mutates_args=())
def routed_experts_mxfp4(z: Tensor, experts: Tensor, weights: Tensor, w1_packed: Tensor, w1_scale: Tensor,
                         w3_packed: Tensor, w3_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor,
                         situ_beta: float, situ_linear_beta: float, expert_offset: int = 0) -> Tensor:
    _check(z, experts, weights, w1_packed.shape[2] * 2, expert_offset)
    packed = {"w1": (w1_packed, w1_scale), "w3": (w3_packed, w3_scale), "w2": (w2_packed, w2_scale)}
    return grouped_experts(z, experts, weights, _dequantized(packed), w1_packed.shape[0], w1_packed.shape[1],
                           expert_offset, situ_beta, situ_linear_beta)


@routed_experts_mxfp4.register_fake
def _(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, situ_beta,
      situ_linear_beta, expert_offset=0):
    return z.new_empty(z.shape, dtype=_accumulation_dtype(z))


# The exported graph runs the routed experts as three plugin nodes and a weighted sum in standard ops
# (k3export/onnx/moe.py), so that full TensorRT's AOT plugins (one launch each, no workspace) run them grouped
# by expert. These are the nodes' references (the parsed network's evaluator calls them); the MXFP4 forms
# take the checkpoint's bytes, as routed_experts_mxfp4 does.


@torch.library.custom_op("k3::routed_experts_group", mutates_args=())
def routed_experts_group(experts: Tensor, num_experts: int, expert_offset: int = 0) -> tuple[Tensor, Tensor,
                                                                                               Tensor]:
    return group(experts, num_experts, expert_offset)


@torch.library.custom_op("k3::routed_experts_gate_up", mutates_args=())
def routed_experts_gate_up(z: Tensor, sorted_pairs: Tensor, offsets: Tensor, w1: Tensor, w3: Tensor,
                           situ_beta: float, situ_linear_beta: float) -> Tensor:
    return gate_up(z, sorted_pairs, offsets, _sliced({"w1": w1, "w3": w3}), w1.shape[1], situ_beta,
                   situ_linear_beta)


@torch.library.custom_op("k3::routed_experts_gate_up_mxfp4", mutates_args=())
def routed_experts_gate_up_mxfp4(z: Tensor, sorted_pairs: Tensor, offsets: Tensor, w1_packed: Tensor,
                                 w1_scale: Tensor, w3_packed: Tensor, w3_scale: Tensor, situ_beta: float,
                                 situ_linear_beta: float) -> Tensor:
    packed = {"w1": (w1_packed, w1_scale), "w3": (w3_packed, w3_scale)}
    return gate_up(z, sorted_pairs, offsets, _dequantized(packed), w1_packed.shape[1], situ_beta,
                   situ_linear_beta)


@torch.library.custom_op("k3::routed_experts_down", mutates_args=())
def routed_experts_down(h: Tensor, offsets: Tensor, w2: Tensor) -> Tensor:
    return down(h, offsets, _sliced({"w2": w2}), w2.shape[1])


@torch.library.custom_op("k3::routed_experts_down_mxfp4", mutates_args=())
def routed_experts_down_mxfp4(h: Tensor, offsets: Tensor, w2_packed: Tensor, w2_scale: Tensor) -> Tensor:
    return down(h, offsets, _dequantized({"w2": (w2_packed, w2_scale)}), w2_packed.shape[1])
