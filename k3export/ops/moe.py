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


def grouped_experts(z: Tensor, experts: Tensor, weights: Tensor, expert_weight: ExpertWeight,
                    num_experts: int, expert_offset: int, beta: float, linear_beta: float) -> Tensor:
    """u [N, L] with each used expert run once, on the tokens routed to it.

    `expert_weight(e, name, dtype)` gives local expert e's (model expert expert_offset + e) w1, w3
    or w2 in `dtype` (a slice, or a dequantisation); each is asked for once per used expert. The
    working set is the routed activations ([N * k, I] and [N * k, L]) and one expert's weight at a
    time."""
    N, k = experts.shape
    local = experts.flatten() - expert_offset
    # The pairs whose expert this op holds; the others are another rank's and stay zero.
    mine = ((local >= 0) & (local < num_experts)).nonzero()[:, 0]
    if mine.numel() == 0:
        return z.new_zeros(z.shape, dtype=_accumulation_dtype(z))
    # The (token, slot) pairs grouped by expert (a stable sort keeps token order within an expert).
    order = mine[torch.sort(local[mine], stable=True).indices]
    counts = torch.bincount(local[mine]).tolist()
    starts = [sum(counts[:e]) for e in range(len(counts))]
    segments = [(e, starts[e], count) for e, count in enumerate(counts) if count]
    x = z[order // k]

    def per_expert(inputs: Tensor, name: str) -> Tensor:
        return torch.cat([inputs[s:s + c] @ expert_weight(e, name, z.dtype).T for e, s, c in segments])

    # Gate and up GEMMs per expert, SiTU-GLU once over every pair, then the down GEMM per expert.
    h = situ_glu(per_expert(x, "w1"), per_expert(x, "w3"), beta, linear_beta).to(z.dtype)
    y = per_expert(h, "w2").to(_accumulation_dtype(z)) * weights.flatten()[order, None]
    pairs = y.new_zeros(N * k, y.shape[1])
    pairs[order] = y
    return pairs.view(N, k, -1).sum(1)


@torch.library.custom_op("k3::routed_experts", mutates_args=())
def routed_experts(z: Tensor, experts: Tensor, weights: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                   situ_beta: float, situ_linear_beta: float, expert_offset: int = 0) -> Tensor:
    _check(z, experts, weights, w1.shape[2], expert_offset)
    stacked = {"w1": w1, "w3": w3, "w2": w2}

    def sliced(e: int, name: str, dtype: torch.dtype) -> Tensor:
        return stacked[name][e].to(dtype)

    return grouped_experts(z, experts, weights, sliced, w1.shape[0], expert_offset, situ_beta,
                           situ_linear_beta)


@routed_experts.register_fake
def _(z, experts, weights, w1, w3, w2, situ_beta, situ_linear_beta, expert_offset=0):
    return z.new_empty(z.shape, dtype=_accumulation_dtype(z))


@torch.library.custom_op("k3::routed_experts_mxfp4", mutates_args=())
def routed_experts_mxfp4(z: Tensor, experts: Tensor, weights: Tensor, w1_packed: Tensor, w1_scale: Tensor,
                         w3_packed: Tensor, w3_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor,
                         situ_beta: float, situ_linear_beta: float, expert_offset: int = 0) -> Tensor:
    _check(z, experts, weights, w1_packed.shape[2] * 2, expert_offset)
    packed = {"w1": (w1_packed, w1_scale), "w3": (w3_packed, w3_scale), "w2": (w2_packed, w2_scale)}

    def dequantized(e: int, name: str, dtype: torch.dtype) -> Tensor:
        weight_packed, weight_scale = packed[name]
        return mxfp4.dequantize(weight_packed[e], weight_scale[e], dtype)

    return grouped_experts(z, experts, weights, dequantized, w1_packed.shape[0], expert_offset, situ_beta,
                           situ_linear_beta)


@routed_experts_mxfp4.register_fake
def _(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, situ_beta,
      situ_linear_beta, expert_offset=0):
    return z.new_empty(z.shape, dtype=_accumulation_dtype(z))
