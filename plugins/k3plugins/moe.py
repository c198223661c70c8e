"""Triton grouped GEMM for the routed experts (the contract of `torch.ops.k3.routed_experts` and
`torch.ops.k3.routed_experts_mxfp4`, k3export/ops/moe.py).

z [N, L] (the latent tokens), experts [N, k] int64, weights [N, k] float32, w1 / w3 [E, I, L],
w2 [E, L, I]; u [N, L] float32 = sum_j weights[n, j] * w2[e] @ SiTU-GLU(w1[e] @ z[n], w3[e] @ z[n]).

In the style of fused-MoE kernels (vLLM / SGLang `fused_moe`), three steps:
    align    (torch, no host sync) the N * k (token, slot) pairs sorted by expert, each expert's run
             padded to a multiple of BLOCK_M, so that every M block belongs to one expert; padding
             rows hold the sentinel N * k, blocks past the last used one the expert -1 (they exit).
             The grid is sized by a bound from the shapes alone: cdiv(N * k, BLOCK_M) + min(E, N * k)
             blocks, so decode launches about k + 1 blocks, never one per expert.
    gate/up  per (M block, I block): a = z w1[e]^T and b = z w3[e]^T in float32, then
             h = SiTU-GLU(a, b), stored per pair in z's dtype (as the eager op rounds it).
    down     per (M block, L block): y = h w2[e]^T in float32, times the pair's routing weight,
             atomically added into u (float32), which sums the k slots of each token.
Weights are the model's float tensors or MXFP4 dequantised in registers, weight-only: the products
run in z's dtype with float32 accumulation. MXFP4 experts come as the plugin receives them, int32
words of the checkpoint's bytes (k3export/ops/mxfp4.py, "Words"): codes [E, O*K/8] (E2M1, eight per
word, the lowest nibble first), E8M0 scales [E, O*K/128] (2^(s - 127), four per word, one per 32
inputs), each expert flattened row-major. A scale byte of 0 or 1 decodes as 0 instead of 2^-127 or
2^-126 (values below 1e-37; the export refuses 255, NaN). `words` makes them from uint8 bytes.

NOT PROVEN here (no GPU on the machines this was written on): the speed, and the plugin's enqueue
under TensorRT. The numerics are tested under Triton's interpreter (tests/kernels/test_moe.py) and
every variant compiles for sm_90 without spills (tests/test_aot.py) for L and I multiples of 16 (every
preset; Triton's JIT specialises such widths, other widths get a general build not checked for spills);
tools/gpu_check.py times it.
The float32 atomics make the sum over the k slots order-dependent on a GPU (not bitwise repeatable).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3plugins.variants import DTYPES, KernelVariant, pointer

MXFP4_GROUP = 32  # inputs per E8M0 scale


class Tiles(NamedTuple):
    block_m: int  # (token, slot) pairs per program, all of one expert
    block_n: int  # output columns per program
    block_k: int  # reduction step (a multiple of 8, for MXFP4's eight codes a word)
    num_warps: int
    num_stages: int


# Decode: few pairs per expert, so the smallest M block tl.dot takes and deep K steps (the weights'
# bytes are the cost). Prefill: tensor-core sized tiles. float32 runs "ieee" FMA dots, whose operands
# sit in registers: short K steps. Sized so that no variant spills on sm_90 (tests/test_aot.py).
DECODE = Tiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
PREFILL = Tiles(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
DECODE_FP32 = Tiles(block_m=16, block_n=64, block_k=32, num_warps=4, num_stages=3)
PREFILL_FP32 = Tiles(block_m=64, block_n=64, block_k=16, num_warps=8, num_stages=3)
# Decode tiles while the pairs average fewer than this per expert (decode and short prompts).
DECODE_PAIRS_PER_EXPERT = 16


def tile_choices(dtype: torch.dtype) -> dict[str, Tiles]:
    """The decode and prefill tiles for activations of `dtype`."""
    if dtype == torch.float32:
        return {"decode": DECODE_FP32, "prefill": PREFILL_FP32}
    return {"decode": DECODE, "prefill": PREFILL}


def pick_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> Tiles:
    mode = "decode" if num_pairs < DECODE_PAIRS_PER_EXPERT * num_experts else "prefill"
    return tile_choices(dtype)[mode]


@triton.jit
def _tanh(x):
    # tanh from exp of a non-positive argument: never overflows (tl has no tanh).
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _e2m1_twice(code):
    # Twice the E2M1 value of a 4-bit code (bit 3 sign, bits 1-2 exponent, bit 0 mantissa): integers
    # 0, 1, 2, 3, 4, 6, 8, 12, so the decode is exact integer arithmetic.
    exponent = (code >> 1) & 3
    mantissa = code & 1
    twice = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
    return tl.where(code >= 8, -twice, twice).to(tl.float32)


@triton.jit
def _weight_tile(w, w_scale, rows, mask_n, k0, K, dtype, PACKED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight rows `rows` [BLOCK_N] (int64, expert offset included), inputs k0 .. k0 + BLOCK_K, as a
    [BLOCK_N, BLOCK_K] tile in `dtype`. Packed: int32 words [BLOCK_N, BLOCK_K / 8] and their scales
    decoded here, each word's eight codes (lowest nibble first) spread along a third axis and
    reshaped back into the row."""
    if PACKED:
        # Word j of the stacked experts holds codes 8j .. 8j + 7 of the flat [E * O, K] matrix, code
        # 8j + i in bits 4i .. 4i + 3; scale byte g (codes 32g ..) is bits 8(g % 4) .. of word g // 4.
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        mask = mask_n[:, None] & (offs_w < K // 8)[None, :]
        word = tl.load(w + rows[:, None] * (K // 8) + offs_w[None, :], mask=mask, other=0)
        # Scale byte g of the flat [E * O, K / 32] scales is byte g of the words' memory (little-endian
        # words: bits 8(g % 4) .. of word g // 4), read as a byte; one per 4 code words, the repeated
        # addresses served from cache.
        scale_bytes = w_scale.to(tl.pointer_type(tl.uint8))
        scale = tl.load(scale_bytes + rows[:, None] * (K // 32) + (offs_w // 4)[None, :], mask=mask,
                        other=0).to(tl.int32)
        # 2^(s - 128) from its float32 bits (exact for s >= 2), which halves _e2m1_twice's values.
        factor = tl.where(scale > 1, (tl.maximum(scale - 1, 0) << 23).to(tl.float32, bitcast=True), 0.0)
        # Code i of each word as [BLOCK_N, BLOCK_K / 8] values, put back in order (input 8j + i) by
        # joins: join(join(join(c0, c4), join(c2, c6)), join(join(c1, c5), join(c3, c7)))[.., j, a, b, c]
        # is code 4a + 2b + c of word j, which the reshape puts at 8j + 4a + 2b + c.
        c0 = _e2m1_twice(word & 15) * factor
        c1 = _e2m1_twice((word >> 4) & 15) * factor
        c2 = _e2m1_twice((word >> 8) & 15) * factor
        c3 = _e2m1_twice((word >> 12) & 15) * factor
        c4 = _e2m1_twice((word >> 16) & 15) * factor
        c5 = _e2m1_twice((word >> 20) & 15) * factor
        c6 = _e2m1_twice((word >> 24) & 15) * factor
        c7 = _e2m1_twice((word >> 28) & 15) * factor
        joined = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
        tile = tl.reshape(joined, (BLOCK_N, BLOCK_K))
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w + rows[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :],
                       other=0.0)
    return tile.to(dtype)


@triton.jit
def _moe_gate_up_kernel(z, w1, w1_scale, w3, w3_scale, pair_ids, block_experts, h, num_pairs, top_k, L, I,
                        beta, linear_beta, PACKED: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.load(block_experts + tl.program_id(0))
    if e < 0:  # a block past the last used expert's
        return
    pairs = tl.load(pair_ids + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < num_pairs  # padding rows hold num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    rows = e.to(tl.int64) * I + offs_n  # rows of w1 / w3 viewed as [E * I, L]
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(z + tokens[:, None] * L + offs_k[None, :], mask=mask_m[:, None] & (offs_k < L)[None, :],
                    other=0.0)
        gate = _weight_tile(w1, w1_scale, rows, mask_n, k0, L, x.dtype, PACKED, BLOCK_N, BLOCK_K)
        up = _weight_tile(w3, w3_scale, rows, mask_n, k0, L, x.dtype, PACKED, BLOCK_N, BLOCK_K)
        acc_a = tl.dot(x, tl.trans(gate), acc_a, input_precision="ieee")
        acc_b = tl.dot(x, tl.trans(up), acc_b, input_precision="ieee")
    # SiTU-GLU: [beta tanh(a / beta) sigmoid(a)] * [linear_beta tanh(b / linear_beta)].
    out = beta * _tanh(acc_a / beta) * tl.sigmoid(acc_a) * (linear_beta * _tanh(acc_b / linear_beta))
    tl.store(h + pairs.to(tl.int64)[:, None] * I + offs_n[None, :], out.to(h.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_down_kernel(h, w2, w2_scale, pair_ids, block_experts, weights, u, num_pairs, top_k, L, I,
                     PACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    e = tl.load(block_experts + tl.program_id(0))
    if e < 0:
        return
    pairs = tl.load(pair_ids + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < num_pairs
    pairs64 = pairs.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < L
    rows = e.to(tl.int64) * L + offs_n  # rows of w2 viewed as [E * L, I]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(h + pairs64[:, None] * I + offs_k[None, :], mask=mask_m[:, None] & (offs_k < I)[None, :],
                    other=0.0)
        down = _weight_tile(w2, w2_scale, rows, mask_n, k0, I, x.dtype, PACKED, BLOCK_N, BLOCK_K)
        acc = tl.dot(x, tl.trans(down), acc, input_precision="ieee")
    routing = tl.load(weights + pairs64, mask=mask_m, other=0.0)
    tokens = pairs64 // top_k
    # The k slots of a token land in different blocks: summed by float32 atomics into u (zeroed).
    tl.atomic_add(u + tokens[:, None] * L + offs_n[None, :], acc * routing[:, None],
                  mask=mask_m[:, None] & mask_n[None, :])


class Alignment(NamedTuple):
    pair_ids: Tensor  # [num_blocks * BLOCK_M] int32: pair index n * k + j, or N * k for padding
    block_experts: Tensor  # [num_blocks] int32: the block's expert, -1 past the last used block


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The M blocks the alignment can need: every used expert wastes less than one block."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def align(experts: Tensor, num_experts: int, block_m: int, expert_offset: int = 0) -> Alignment:
    """The (token, slot) pairs grouped by expert (stable: token order within an expert), each
    expert's run padded to a multiple of block_m. Pure device work, sized from the shapes alone.

    The experts held are the model's expert_offset .. expert_offset + num_experts - 1 (block_experts
    are local indices); pairs routed to other experts go to a spill group past them that gets no block."""
    local = experts.flatten() - expert_offset
    flat = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    num_pairs = flat.numel()
    blocks_bound = max_blocks(num_pairs, num_experts, block_m)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts[:num_experts] + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    first_pair = torch.cumsum(counts, 0) - counts  # each group's first position in `order`
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - first_pair[sorted_experts]
    # The spilled pairs' slots lie past the blocks, in room that is cut off below.
    block_start = torch.cat([block_end - blocks, block_end.new_full((1,), blocks_bound)])
    slots = block_start[sorted_experts] * block_m + rank
    pair_ids = torch.full((blocks_bound * block_m + num_pairs,), num_pairs, dtype=torch.int32,
                          device=flat.device)
    pair_ids[slots] = order.to(torch.int32)
    pair_ids = pair_ids[:blocks_bound * block_m]
    block_index = torch.arange(blocks_bound, device=flat.device)
    block_experts = torch.searchsorted(block_end, block_index, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return Alignment(pair_ids, block_experts)


Weight = tuple[Tensor, Tensor | None]  # (weight, None) or (packed, scale)


def _grouped_experts(z: Tensor, experts: Tensor, weights: Tensor, w1: Weight, w3: Weight, w2: Weight,
                     num_experts: int, intermediate: int, beta: float, linear_beta: float,
                     expert_offset: int, out: Tensor | None, tiles: Tiles | None) -> Tensor:
    N, L = z.shape
    if experts.dim() != 2 or experts.shape[0] != N or weights.shape != experts.shape:
        raise ValueError(f"routed_experts: experts {list(experts.shape)} and weights "
                         f"{list(weights.shape)} are not both [{N}, top_k]")
    packed = w1[1] is not None
    if packed and (L % MXFP4_GROUP or intermediate % MXFP4_GROUP):
        raise ValueError(f"routed_experts_mxfp4: L={L} and I={intermediate} must be multiples of 32")
    top_k = experts.shape[1]
    num_pairs = N * top_k
    u = z.new_empty(N, L, dtype=torch.float32) if out is None else out
    u.zero_()
    if num_pairs == 0:
        return u
    tiles = tiles or pick_tiles(num_pairs, num_experts, z.dtype)
    z = z.contiguous()
    # A no-op for the exports (the experts are in the model dtype); other float weights are copied
    # whole here, which keeps the compiled variants one per activation dtype.
    w1, w3, w2 = ((w.contiguous(), s.contiguous()) if packed else (w.to(z.dtype).contiguous(), None)
                  for w, s in (w1, w3, w2))
    pair_ids, block_experts = align(experts, num_experts, tiles.block_m, expert_offset)
    routing = weights.to(torch.float32).contiguous()
    h = z.new_empty(num_pairs, intermediate)
    blocks = block_experts.numel()
    options = {"PACKED": packed, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n,
               "BLOCK_K": tiles.block_k, "num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    _moe_gate_up_kernel[(blocks, triton.cdiv(intermediate, tiles.block_n))](
        z, w1[0], w1[1], w3[0], w3[1], pair_ids, block_experts, h, num_pairs, top_k, L, intermediate,
        beta, linear_beta, **options)
    _moe_down_kernel[(blocks, triton.cdiv(L, tiles.block_n))](
        h, w2[0], w2[1], pair_ids, block_experts, routing, u, num_pairs, top_k, L, intermediate, **options)
    return u


def routed_experts(z: Tensor, experts: Tensor, weights: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                   situ_beta: float, situ_linear_beta: float, expert_offset: int = 0,
                   out: Tensor | None = None, tiles: Tiles | None = None) -> Tensor:
    """u [N, L] float32 (written into `out` when given) for w1 / w3 [E, I, L] and w2 [E, L, I], the
    model's experts expert_offset .. expert_offset + E - 1 (experts holds the model's indices)."""
    E, I, L = w1.shape
    if w3.shape != w1.shape or w2.shape != (E, L, I) or z.shape[-1] != L:
        raise ValueError(f"routed_experts: w1 {list(w1.shape)}, w3 {list(w3.shape)}, w2 {list(w2.shape)} "
                         f"and z {list(z.shape)} do not fit w1 = w3 = [E, I, L], w2 = [E, L, I]")
    return _grouped_experts(z, experts, weights, (w1, None), (w3, None), (w2, None), E, I, situ_beta,
                            situ_linear_beta, expert_offset, out, tiles)


def words(stacked: Tensor) -> Tensor:
    """packed [E, O, K/2] or scale [E, O, K/32] uint8 bytes -> the int32 words the kernels read,
    [E, O*K/8] or [E, O*K/128]: a view of the same bytes (k3export.ops.mxfp4.to_words, without the import)."""
    return stacked.contiguous().view(stacked.shape[0], -1).view(torch.int32)


def routed_experts_mxfp4(z: Tensor, experts: Tensor, weights: Tensor, w1_packed: Tensor, w1_scale: Tensor,
                         w3_packed: Tensor, w3_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor,
                         situ_beta: float, situ_linear_beta: float, expert_offset: int = 0,
                         out: Tensor | None = None, tiles: Tiles | None = None) -> Tensor:
    """As `routed_experts`, the experts MXFP4 as int32 words (the plugin's inputs; `words` makes them
    from the checkpoint's bytes): codes [E, O*K/8] and scales [E, O*K/128] per projection, w1 / w3
    [O, K] = [I, L], w2 [L, I]. L is z's width; I follows from w1's words."""
    E, L = w1_packed.shape[0], z.shape[-1]
    if L % MXFP4_GROUP or w1_packed.dim() != 2 or (8 * w1_packed.shape[1]) % L:
        raise ValueError(f"routed_experts_mxfp4: w1_packed is {w1_packed.dtype} {list(w1_packed.shape)}; "
                         f"expected torch.int32 words [E, I*L/8] for z {list(z.shape)} (L a multiple of 32)")
    I = 8 * w1_packed.shape[1] // L
    shapes = {"w1_packed": (w1_packed, (E, I * L // 8)), "w1_scale": (w1_scale, (E, I * L // 128)),
              "w3_packed": (w3_packed, (E, I * L // 8)), "w3_scale": (w3_scale, (E, I * L // 128)),
              "w2_packed": (w2_packed, (E, L * I // 8)), "w2_scale": (w2_scale, (E, L * I // 128))}
    for name, (tensor, shape) in shapes.items():
        if tuple(tensor.shape) != shape or tensor.dtype != torch.int32:
            raise ValueError(f"routed_experts_mxfp4: {name} is {tensor.dtype} {list(tensor.shape)}; expected "
                             f"torch.int32 words {list(shape)} (E={E}, I={I}, L={L})")
    return _grouped_experts(z, experts, weights, (w1_packed, w1_scale), (w3_packed, w3_scale),
                            (w2_packed, w2_scale), E, I, situ_beta, situ_linear_beta, expert_offset, out,
                            tiles)


def kernel_variants() -> list[KernelVariant]:
    """Every (kernel, activation dtype, weight form, tiles) combination the launchers can pick."""
    variants = []
    torch_dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    for dtype in DTYPES:
        # Float experts in the activations' dtype, or MXFP4 as int32 words (codes and scales).
        for packed in (False, True):
            weight = "*i32" if packed else pointer(dtype)
            scale = "*i32" if packed else "constexpr"
            form = "mxfp4" if packed else dtype
            for mode, tiles in tile_choices(torch_dtypes[dtype]).items():
                blocks = {"PACKED": packed, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n,
                          "BLOCK_K": tiles.block_k}
                scales = {} if packed else {"w1_scale": None, "w3_scale": None, "w2_scale": None}
                common = {"pair_ids": "*i32", "block_experts": "*i32", "num_pairs": "i32", "top_k": "i32",
                          "L": "i32", "I": "i32"}
                kernels = {
                    "gate_up": (_moe_gate_up_kernel, {"z": pointer(dtype), "w1": weight, "w1_scale": scale,
                                                      "w3": weight, "w3_scale": scale, "h": pointer(dtype),
                                                      "beta": "fp32", "linear_beta": "fp32", **common}),
                    "down": (_moe_down_kernel, {"h": pointer(dtype), "w2": weight, "w2_scale": scale,
                                                "weights": "*fp32", "u": "*fp32", **common}),
                }
                for name, (fn, types) in kernels.items():
                    constexprs = {**blocks, **{k: v for k, v in scales.items() if k in fn.arg_names}}
                    signature = {arg: types.get(arg, "constexpr") for arg in fn.arg_names}
                    # L and I as Triton's JIT specialises them when multiples of 16 (every preset):
                    # without that, no load vectorises and the address registers spill.
                    variants.append(KernelVariant(f"moe_{name}_{mode}_{dtype}_w{form}", fn, signature,
                                                  constexprs, tiles.num_warps, tiles.num_stages,
                                                  divisible_by_16=("L", "I")))
    return variants
