"""Triton grouped GEMM for the routed experts (the contract of `torch.ops.k3.routed_experts` and
`torch.ops.k3.routed_experts_mxfp4`, k3export/ops/moe.py).

z [N, L] (the latent tokens), experts [N, k] int64, weights [N, k] float32, w1 / w3 [E, I, L],
w2 [E, L, I]; u [N, L] float32 = sum_j weights[n, j] * w2[e] @ SiTU-GLU(w1[e] @ z[n], w3[e] @ z[n]).

Grouped by expert, in four launches, each a single kernel with no workspace (so that full TensorRT's AOT
plugins can run each as a node of its own, its intermediates graph tensors):
    group    (E + 1 programs) the N * k (token, slot) pairs held here sorted by local expert, stable:
             `sorted_pairs`, each expert's `offsets` (counting only the pairs held here) and each
             pair's slot (-1 for a pair routed to an expert held elsewhere).
    gate/up  per (tile of one expert's slots, block of I columns): a = w1[e] z^T and b = w3[e] z^T as one
             product of their rows in float32 on tensor cores, the weights the wide side of the product and
             the tile's pairs the narrow one (16 at decode), then h = SiTU-GLU(a, b), stored per slot in
             z's dtype (as the eager op rounds it).
    down     per (tile, block of L rows): y = w2[e] h^T per slot, float32.
    combine  per (token, block of L): u[n] = sum over its slots held here, in slot order, of the routing
             weight times y: deterministic, no atomics.
A tile's expert comes from `offsets` in the kernel (a prefix sum over the E experts' tile counts), so the
tile size is each GEMM kernel's own choice and the grid a bound from the shapes alone:
cdiv(N * k, BLOCK_P) + min(E, N * k) tiles; the tiles past the last used one exit.
Weights are the model's float tensors or MXFP4 dequantised in registers, weight-only: the products
run in z's dtype with float32 accumulation. MXFP4 experts come as the plugin receives them, int32
words of the checkpoint's bytes (k3export/ops/mxfp4.py, "Words"): codes [E, O*K/8] (E2M1, eight per
word, the lowest nibble first), E8M0 scales [E, O*K/128] (2^(s - 127), four per word, one per 32
inputs), each expert flattened row-major; every scale byte decodes exactly (the export refuses 255, NaN).
`words` makes them from uint8 bytes. Each K step decodes a weight tile for one product (_weight_tile):
two codes a 32-bit operation (_e2m1_pair), joined into input order, then two exact multiplies by powers of
two a value (in packed bfloat16 for bfloat16 activations).

NOT PROVEN here (no GPU on the machines this was written on): the speed, and the plugin's enqueue
under TensorRT. The numerics are tested under Triton's interpreter (tests/kernels/test_moe.py) and
every variant compiles for sm_90 without spills (tests/test_aot.py) for L and I multiples of 16 (every
preset; Triton's JIT specialises such widths, other widths get a general build not checked for spills);
tools/gpu_check.py times it. h [N * k, I] and y [N * k, L] are sized for every pair, the bound from the
shapes (at most all of them are held here).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3plugins.variants import DTYPES, KernelVariant, pointer

MXFP4_GROUP = 32  # inputs per E8M0 scale


class Tiles(NamedTuple):
    block_p: int  # (token, slot) pairs per program, all of one expert: the narrow side of the product
    block_w: int  # output columns per program (gate/up's product has their rows of w1 and of w3: twice as
    #               many weight rows): the wide side, where wgmma's 64 rows go
    block_k: int  # reduction step (a multiple of 32 for MXFP4's scale groups)
    num_warps: int
    num_stages: int


class KernelTiles(NamedTuple):
    """A mode's tiles: gate/up's and down's."""
    gate_up: Tiles
    down: Tiles


# The weights are the products' wide (M) side and the pairs the narrow one (16, the least tl.dot takes):
# at decode an expert has a pair or two, and the weight rows fill wgmma's 64-row tiles. Prefill takes 64
# pairs. Two stages, within the 48 KB of dynamic shared memory an AOT launch gets
# (trt_aot.DEFAULT_SHARED_BYTES). float32 runs "ieee" FMA dots, whose operands sit in registers: short K
# steps. Sized so that no variant spills on sm_90a or sm_100a (tests/test_aot.py).
DECODE = KernelTiles(*[Tiles(block_p=16, block_w=64, block_k=64, num_warps=4, num_stages=2)] * 2)
PREFILL = KernelTiles(*[Tiles(block_p=64, block_w=128, block_k=32, num_warps=8, num_stages=2)] * 2)
DECODE_FP32 = KernelTiles(*[Tiles(block_p=16, block_w=64, block_k=16, num_warps=4, num_stages=2)] * 2)
PREFILL_FP32 = KernelTiles(*[Tiles(block_p=32, block_w=32, block_k=16, num_warps=4, num_stages=2)] * 2)
# MXFP4 experts (16-bit activations), each K step a decoded [rows, block_k] tile (_weight_tile): 128 product
# rows a program on gate/up (64 columns) and at decode on down, to keep the programs many at one token a
# rank (96 and 112 for 132 SMs); long K steps, within 48 KB. Prefill: 128 pairs, so that each weight is
# decoded once per 128 pairs (146 an expert at 8,192 tokens a rank: twice, where 64 took three times).
PACKED_DECODE = KernelTiles(Tiles(block_p=16, block_w=64, block_k=128, num_warps=4, num_stages=2),
                            Tiles(block_p=16, block_w=64, block_k=256, num_warps=4, num_stages=2))
PACKED_PREFILL = KernelTiles(Tiles(block_p=128, block_w=64, block_k=64, num_warps=8, num_stages=2),
                             Tiles(block_p=128, block_w=128, block_k=64, num_warps=8, num_stages=2))
# Decode tiles while the pairs average fewer than this per expert (decode and short prompts).
DECODE_PAIRS_PER_EXPERT = 16
# Pairs the grouping kernel reads at a time; weighted-sum columns per program.
GROUP_BLOCK = 512
COMBINE_BLOCK = 256


def tile_choices(dtype: torch.dtype, packed: bool = False) -> dict[str, KernelTiles]:
    """The decode and prefill tiles for activations of `dtype`, float or MXFP4 (`packed`) experts."""
    if dtype == torch.float32:
        return {"decode": DECODE_FP32, "prefill": PREFILL_FP32}
    if packed:
        return {"decode": PACKED_DECODE, "prefill": PACKED_PREFILL}
    return {"decode": DECODE, "prefill": PREFILL}


def tile_mode(num_pairs: int, num_experts: int) -> str:
    """"decode" while the pairs average fewer than DECODE_PAIRS_PER_EXPERT an expert, else "prefill"."""
    return "decode" if num_pairs < DECODE_PAIRS_PER_EXPERT * num_experts else "prefill"


def pick_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype, packed: bool = False) -> KernelTiles:
    return tile_choices(dtype, packed)[tile_mode(num_pairs, num_experts)]


@triton.jit
def _tanh(x):
    # tanh from exp of a non-positive argument: never overflows (tl has no tanh).
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _scale_factor(scale, dtype: tl.constexpr):
    # 2^(s - 127) from its exponent bits (s = 0: the denormal 2^-127), exact for every scale byte: in bfloat16
    # for bfloat16 activations (float32's exponent range, in packed multiplies: HMUL2.BF16_V2), else float32
    # (float16's range does not hold it).
    if dtype == tl.bfloat16:
        return tl.maximum(scale << 7, 0x40).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return tl.maximum(scale << 23, 0x400000).to(tl.float32, bitcast=True)


@triton.jit
def _shift_left(x, n: tl.constexpr):
    if n >= 0:
        return x << n
    else:
        return x >> -n


@triton.jit
def _e2m1_pair(word, i: tl.constexpr):
    # Codes i and i + 4 of each int32 word (E2M1: sign, exponent e (2 bits), mantissa m at bits 4i .. and
    # 4i + 16 ..) as two bfloat16 bit patterns, code i in the low half: e, m to bits 8 .. 6 of a half and the
    # sign to bit 15 make the value times 2^-126 for every code (e = 0 gives the denormal 0.5 m 2^-126), no
    # table, no select. One shift and mask places both halves' e, m, another both signs (the masks keep the
    # right shifts' sign fill out): two codes in four instructions.
    return (_shift_left(word, 6 - 4 * i) & 0x01C001C0) | (_shift_left(word, 12 - 4 * i) & -0x7FFF8000)


@triton.jit
def _e2m1_codes(pair, dtype: tl.constexpr):
    """The two codes of an _e2m1_pair, each the value times 2^-126: bfloat16 as the pattern's halves for
    bfloat16 activations, else float32, their bits moved to the top half (a bfloat16 is a float32's top
    half)."""
    if dtype == tl.bfloat16:
        first, second = pair.to(tl.int16), (pair >> 16).to(tl.int16)
        return first.to(tl.bfloat16, bitcast=True), second.to(tl.bfloat16, bitcast=True)
    else:
        return (pair << 16).to(tl.float32, bitcast=True), (pair & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _weight_tile(w, w_scale, rows, mask_n, k0, K, dtype, PACKED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight rows `rows` [BLOCK_N] (int64, expert offset included), inputs k0 .. k0 + BLOCK_K, as a
    [BLOCK_N, BLOCK_K] tile in `dtype`. Packed: each word's eight codes (lowest nibble first) spread along a
    third axis and reshaped back into the row, then scaled: in bfloat16 for bfloat16 activations, else in
    float32 (_scale_factor)."""
    MUL: tl.constexpr = tl.bfloat16 if dtype == tl.bfloat16 else tl.float32
    if PACKED:
        # Word j of the stacked experts holds codes 8j .. 8j + 7 of the flat [E * O, K] matrix, code 8j + i in
        # bits 4i .. 4i + 3.
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        word = tl.load(w + rows[:, None] * (K // 8) + offs_w[None, :],
                       mask=mask_n[:, None] & (offs_w < K // 8)[None, :], other=0)
        # Code i of each word as [BLOCK_N, BLOCK_K / 8] values, put back in order (input 8j + i) by joins:
        # join(join(join(c0, c4), join(c2, c6)), join(join(c1, c5), join(c3, c7)))[.., j, a, b, c] is code
        # 4a + 2b + c of word j, which the reshape puts at 8j + 4a + 2b + c.
        c0, c4 = _e2m1_codes(_e2m1_pair(word, 0), MUL)
        c1, c5 = _e2m1_codes(_e2m1_pair(word, 1), MUL)
        c2, c6 = _e2m1_codes(_e2m1_pair(word, 2), MUL)
        c3, c7 = _e2m1_codes(_e2m1_pair(word, 3), MUL)
        joined = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
        # Scale byte g of the flat [E * O, K / 32] scales (codes 32g ..) is byte g of the words' memory
        # (little-endian words: bits 8(g % 4) .. of word g // 4), read as a byte, one per group of the step (a
        # step of 16 lies within one group). Times 2^126 first: every code exact, then the scale.
        GROUPS: tl.constexpr = (BLOCK_K + 31) // 32
        offs_g = k0 // 32 + tl.arange(0, GROUPS)
        scale = tl.load(w_scale.to(tl.pointer_type(tl.uint8)) + rows[:, None] * (K // 32) + offs_g[None, :],
                        mask=mask_n[:, None] & (offs_g < K // 32)[None, :], other=0).to(tl.int32)
        grouped = tl.reshape(joined, (BLOCK_N, GROUPS, BLOCK_K // GROUPS))
        tile = tl.reshape(grouped * 2.0**126 * _scale_factor(scale, MUL)[:, :, None], (BLOCK_N, BLOCK_K))
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w + rows[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :],
                       other=0.0)
    return tile.to(dtype)


@triton.jit
def _expert_step(acc, w, w_scale, rows, mask_w, k0, K, x_rows, mask_p, PACKED: tl.constexpr,
                 BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BLOCK_W, BLOCK_P] + the weight rows `rows` times the pairs' inputs k0 .. k0 + BLOCK_K: x_rows
    [1, BLOCK_P] point at each pair's input row (masked by mask_p [1, BLOCK_P]). `w` (and `w_scale`) a
    pointer, or one a row ([BLOCK_W, 1]: rows of two matrices in one product). float32 multiplies in FMA
    ("ieee"), 16-bit activations on tensor cores."""
    dtype = x_rows.dtype.element_ty
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_rows + offs_k[:, None], mask=mask_p & (offs_k < K)[:, None], other=0.0)
    tile = _weight_tile(w, w_scale, rows, mask_w, k0, K, dtype, PACKED, BLOCK_W, BLOCK_K)
    precision: tl.constexpr = "ieee" if dtype == tl.float32 else None
    return tl.dot(tile, x, acc, input_precision=precision)


@triton.jit
def _moe_group_kernel(experts, num_pairs, sorted_pairs, offsets, slots, E, OFFSET, BLOCK: tl.constexpr):
    # Program g places the pairs of group g: local expert g (model expert OFFSET + g), or for g = E the
    # pairs held elsewhere. Its first pass counts the pairs of lower groups (its start), the second writes
    # its pairs in pair order (stable) from there. Every program reads all the pairs, and none needs
    # another's result: one launch, no atomics, no workspace.
    g = tl.program_id(0)
    start = 0
    for p0 in range(0, num_pairs, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        local = tl.load(experts + p, mask=p < num_pairs, other=0) - OFFSET
        group = tl.where((local >= 0) & (local < E), local, E)
        start += tl.sum(((p < num_pairs) & (group < g)).to(tl.int32))
    tl.store(offsets + g, start)  # offsets[E]: the pairs held here
    slot = start
    # (q0: a name of its own, since tools/kernel_estimate.py keys loops by their text)
    for q0 in range(0, num_pairs, BLOCK):
        p = q0 + tl.arange(0, BLOCK)
        local = tl.load(experts + p, mask=p < num_pairs, other=0) - OFFSET
        group = tl.where((local >= 0) & (local < E), local, E)
        mine = (p < num_pairs) & (group == g)
        position = slot + tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(sorted_pairs + position, p, mask=mine)
        tl.store(slots + p, tl.where(g < E, position, -1), mask=mine)
        slot += tl.sum(mine.to(tl.int32))


@triton.jit
def _expert_tile(offsets, E, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    # Program t's tile from the rank's own pairs: expert e's slots offsets[e] .. offsets[e + 1] in tiles of
    # BLOCK_P, the experts' tiles in order. Returns (e, first slot, end of e's slots); e >= E past the last.
    t = tl.program_id(0)
    index = tl.arange(0, BLOCK_E)
    start = tl.load(offsets + index, mask=index < E, other=0)
    end = tl.load(offsets + index + 1, mask=index < E, other=0)
    tiles = (end - start + BLOCK_P - 1) // BLOCK_P
    tiles_end = tl.cumsum(tiles, 0)
    e = tl.sum((tiles_end <= t).to(tl.int32))
    here = index == e
    first_tile = tl.sum(tl.where(here, tiles_end - tiles, 0))
    first_slot = tl.sum(tl.where(here, start, 0)) + (t - first_tile) * BLOCK_P
    return e, first_slot, tl.sum(tl.where(here, end, 0))


@triton.jit
def _moe_gate_up_kernel(z, sorted_pairs, offsets, w1, w1_scale, w3, w3_scale, TOP_K, h, L, I, E, BETA,
                        LINEAR_BETA, PACKED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    # h[s] = SiTU-GLU(w1[e] z[n], w3[e] z[n]) for the pairs of one expert in slots s, BLOCK_W columns of h
    # at a time: one product of their rows of w1 and of w3, [2 BLOCK_W, BLOCK_K] weights x [BLOCK_K, BLOCK_P]
    # tokens (the inputs loaded once for both), each weight read once per tile. (TOP_K before h: an AOT
    # launch passes the inputs, then the scalars, then the outputs; the widths are compiled in.)
    e, first_slot, end_slot = _expert_tile(offsets, E, BLOCK_E, BLOCK_P)
    if e >= E:
        return
    slots = first_slot + tl.arange(0, BLOCK_P)
    mask_p = slots < end_slot
    tokens = (tl.load(sorted_pairs + slots, mask=mask_p, other=0) // TOP_K).to(tl.int64)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask_w = offs_w < I
    # Product row q: blocks of 8 rows of w1, then the same 8 of w3, so that the wgmma thread holding row
    # r < 8 of a 16-row block of the result holds row r + 8 too: a and b part in its registers.
    q = tl.arange(0, 2 * BLOCK_W)
    offs_q = tl.program_id(1) * BLOCK_W + q // 16 * 8 + q % 8
    gate = (q % 16 < 8)[:, None]
    w = tl.where(gate, w1, w3)  # one pointer a row
    w_scale = tl.where(gate, w1_scale, w3_scale) if PACKED else None
    rows = e.to(tl.int64) * I + offs_q  # rows of w1 / w3 viewed as [E * I, L]
    x, x_mask = z + tokens[None, :] * L, mask_p[None, :]  # each pair's input row
    acc = tl.zeros([2 * BLOCK_W, BLOCK_P], dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        acc = _expert_step(acc, w, w_scale, rows, offs_q < I, k0, L, x, x_mask, PACKED, 2 * BLOCK_W, BLOCK_K)
    acc = acc.reshape(BLOCK_W // 8, 2, 8, BLOCK_P).permute(0, 2, 3, 1).reshape(BLOCK_W, BLOCK_P, 2)
    acc_a, acc_b = tl.split(acc)
    # SiTU-GLU: [beta tanh(a / beta) sigmoid(a)] * [linear_beta tanh(b / linear_beta)].
    out = BETA * _tanh(acc_a / BETA) * tl.sigmoid(acc_a) * (LINEAR_BETA * _tanh(acc_b / LINEAR_BETA))
    tl.store(h + slots.to(tl.int64)[None, :] * I + offs_w[:, None], out.to(h.dtype.element_ty),
             mask=mask_p[None, :] & mask_w[:, None])


@triton.jit
def _moe_down_kernel(h, offsets, w2, w2_scale, y, L, I, E, PACKED: tl.constexpr, BLOCK_E: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    # y[s] = w2[e] h[s] (float32) for the pairs of one expert, L rows at a time.
    e, first_slot, end_slot = _expert_tile(offsets, E, BLOCK_E, BLOCK_P)
    if e >= E:
        return
    slots = (first_slot + tl.arange(0, BLOCK_P)).to(tl.int64)
    mask_p = slots < end_slot
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask_w = offs_w < L
    rows = e.to(tl.int64) * L + offs_w  # rows of w2 viewed as [E * L, I]
    x_rows, x_mask = h + slots[None, :] * I, mask_p[None, :]
    acc = tl.zeros([BLOCK_W, BLOCK_P], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        acc = _expert_step(acc, w2, w2_scale, rows, mask_w, k0, I, x_rows, x_mask, PACKED, BLOCK_W, BLOCK_K)
    tl.store(y + slots[None, :] * L + offs_w[:, None], acc, mask=mask_p[None, :] & mask_w[:, None])


@triton.jit
def _moe_combine_kernel(y, slots, weights, u, L, TOP_K, BLOCK_L: tl.constexpr):
    # u[n] = sum over token n's slots held here, in slot order, of the routing weight times its y row:
    # every program owns its outputs, so the sum is in a fixed order (no atomics).
    n = tl.program_id(0).to(tl.int64)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    mask_l = offs_l < L
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for j in range(TOP_K):
        slot = tl.load(slots + n * TOP_K + j)
        if slot >= 0:  # -1: a pair held elsewhere adds nothing
            row = tl.load(y + slot.to(tl.int64) * L + offs_l, mask=mask_l, other=0.0)
            acc += tl.load(weights + n * TOP_K + j) * row
    tl.store(u + n * L + offs_l, acc, mask=mask_l)


class Grouping(NamedTuple):
    sorted_pairs: Tensor  # [N * k] int32: the pairs (n * k + j) held here by expert, in pair order within one
    offsets: Tensor  # [E + 1] int32: expert e's slots are offsets[e] .. offsets[e + 1]; offsets[E] pairs held
    slots: Tensor  # [N, k] int32: each pair's slot, -1 for a pair held elsewhere


def group_pairs(experts: Tensor, num_experts: int, expert_offset: int = 0,
                out: Grouping | None = None) -> Grouping:
    """The (token, slot) pairs grouped by local expert (model experts expert_offset ..), stable: one launch
    of E + 1 programs, sized from the shapes alone (no host sync). The pairs held elsewhere follow
    the held ones in `sorted_pairs`. Written into `out` when given (the group node's outputs)."""
    experts = experts.contiguous()
    num_pairs = experts.numel()
    out = out or Grouping(experts.new_empty(num_pairs, dtype=torch.int32),
                          experts.new_empty(num_experts + 1, dtype=torch.int32),
                          experts.new_empty(experts.shape, dtype=torch.int32))
    _moe_group_kernel[(num_experts + 1,)](experts, num_pairs, *out, num_experts, expert_offset,
                                          BLOCK=GROUP_BLOCK)
    return out


def max_tiles(num_pairs: int, num_experts: int, block_p: int) -> int:
    """The tiles the grouped kernels' first grid axis needs: every expert with pairs wastes less than one."""
    return triton.cdiv(num_pairs, block_p) + min(num_experts, num_pairs)


Weight = tuple[Tensor, Tensor | None]  # (weight, None) or (packed, scale)


def _grouped_experts(z: Tensor, experts: Tensor, weights: Tensor, w1: Weight, w3: Weight, w2: Weight,
                     num_experts: int, intermediate: int, beta: float, linear_beta: float,
                     expert_offset: int, out: Tensor | None, tiles: KernelTiles | None) -> Tensor:
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
    if num_pairs == 0:
        return u.zero_()
    tiles = tiles or pick_tiles(num_pairs, num_experts, z.dtype, packed)
    z = z.contiguous()
    # A no-op for the exports (the experts are in the model dtype); other float weights are copied
    # whole here, which keeps the compiled variants one per activation dtype.
    w1, w3, w2 = ((w.contiguous(), s.contiguous()) if packed else (w.to(z.dtype).contiguous(), None)
                  for w, s in (w1, w3, w2))
    sorted_pairs, offsets, slots = group_pairs(experts, num_experts, expert_offset)
    h = gate_up(z, sorted_pairs, offsets, w1, w3, beta, linear_beta, z.new_empty(num_pairs, intermediate),
                tiles.gate_up)
    y = down(h, offsets, w2, z.new_empty(num_pairs, L, dtype=torch.float32), tiles.down)
    _moe_combine_kernel[(N, triton.cdiv(L, COMBINE_BLOCK))](
        y, slots, weights.to(torch.float32).contiguous(), u, L, top_k, BLOCK_L=COMBINE_BLOCK)
    return u


def _blocks(tiles: Tiles, packed: bool, num_experts: int) -> dict[str, Any]:
    return {"PACKED": packed, "BLOCK_E": triton.next_power_of_2(num_experts), "BLOCK_P": tiles.block_p,
            "BLOCK_W": tiles.block_w, "BLOCK_K": tiles.block_k, "num_warps": tiles.num_warps,
            "num_stages": tiles.num_stages}


def gate_up(z: Tensor, sorted_pairs: Tensor, offsets: Tensor, w1: Weight, w3: Weight, beta: float,
            linear_beta: float, h: Tensor, tiles: Tiles | None = None) -> Tensor:
    """h [N k, I] (z's dtype) per slot of the grouping: SiTU-GLU(w1[e] z[n], w3[e] z[n]); z [N, L]
    contiguous, the weights contiguous in z's dtype or MXFP4 words."""
    num_pairs, intermediate = h.shape
    num_experts = offsets.shape[0] - 1
    packed = w1[1] is not None
    if num_pairs == 0:
        return h
    tiles = tiles or pick_tiles(num_pairs, num_experts, z.dtype, packed).gate_up
    _moe_gate_up_kernel[(max_tiles(num_pairs, num_experts, tiles.block_p),
                         triton.cdiv(intermediate, tiles.block_w))](
        z, sorted_pairs, offsets, w1[0], w1[1], w3[0], w3[1], num_pairs // z.shape[0], h, z.shape[1],
        intermediate, num_experts, beta, linear_beta, **_blocks(tiles, packed, num_experts))
    return h


def down(h: Tensor, offsets: Tensor, w2: Weight, y: Tensor, tiles: Tiles | None = None) -> Tensor:
    """y [N k, L] float32 per slot of the grouping: w2[e] h[s]."""
    (num_pairs, intermediate), L = h.shape, y.shape[1]
    num_experts = offsets.shape[0] - 1
    packed = w2[1] is not None
    if num_pairs == 0:
        return y
    tiles = tiles or pick_tiles(num_pairs, num_experts, h.dtype, packed).down
    _moe_down_kernel[(max_tiles(num_pairs, num_experts, tiles.block_p), triton.cdiv(L, tiles.block_w))](
        h, offsets, w2[0], w2[1], y, L, intermediate, num_experts, **_blocks(tiles, packed, num_experts))
    return y


def routed_experts(z: Tensor, experts: Tensor, weights: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                   situ_beta: float, situ_linear_beta: float, expert_offset: int = 0,
                   out: Tensor | None = None, tiles: KernelTiles | None = None) -> Tensor:
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
                         out: Tensor | None = None, tiles: KernelTiles | None = None) -> Tensor:
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


# Every argument's Triton type where it is not compiled in.
_ARGUMENT_TYPES = {"experts": "*i64", "num_pairs": "i32", "sorted_pairs": "*i32", "offsets": "*i32",
                   "slots": "*i32", "y": "*fp32", "weights": "*fp32", "u": "*fp32", "L": "i32", "I": "i32",
                   "E": "i32", "OFFSET": "i32", "TOP_K": "i32", "BETA": "fp32", "LINEAR_BETA": "fp32"}


def _variant(name: str, fn: triton.JITFunction, types: dict[str, str], fixed: dict[str, Any],
             tiles: Tiles | None, num_warps: int = 4) -> KernelVariant:
    # `fixed`: compiled in (constexprs); the rest take their types. Widths named in the variant's name.
    fixed = {k: v for k, v in fixed.items() if k in fn.arg_names}
    types = {**_ARGUMENT_TYPES, **types}
    signature = {arg: "constexpr" if arg in fixed else types[arg] for arg in fn.arg_names}
    widths = "".join(f"_{k.lower()}{fixed[k]}" for k in ("L", "I", "E", "TOP_K", "OFFSET") if k in fixed)
    # L and I, when runtime arguments, as Triton's JIT specialises multiples of 16 (every preset): without
    # that, no load vectorises and the address registers spill.
    return KernelVariant(name + widths, fn, signature, fixed, tiles.num_warps if tiles else num_warps,
                         tiles.num_stages if tiles else 3,
                         divisible_by_16=tuple(a for a in ("L", "I") if a in fn.arg_names and a not in fixed))


def grouped_variants(dtype: str, packed: bool, tiles: KernelTiles, mode: str,
                     constants: dict[str, Any] | None = None) -> list[KernelVariant]:
    """The gate/up and down kernels for activations of `dtype` (Triton's name), float experts in that dtype
    or MXFP4 words, with `tiles`. `constants` compiles scalars in (the AOT form: L, I, E, TOP_K, BETA,
    LINEAR_BETA; an AOT scalar cannot be a float); without them they are runtime arguments and the
    expert table's block is the one for 128 experts."""
    constants = constants or {}
    weight, scale = ("*i32", "*i32") if packed else (pointer(dtype), "constexpr")
    types = {"z": pointer(dtype), "h": pointer(dtype), **dict.fromkeys(("w1", "w3", "w2"), weight),
             **dict.fromkeys(("w1_scale", "w3_scale", "w2_scale"), scale)}
    fixed = {"PACKED": packed, "BLOCK_E": triton.next_power_of_2(constants.get("E", 128)), **constants,
             **({} if packed else {"w1_scale": None, "w3_scale": None, "w2_scale": None})}
    form = "mxfp4" if packed else dtype
    return [_variant(f"moe_{name}_{mode}_{dtype}_w{form}", fn, types,
                     {**fixed, "BLOCK_P": t.block_p, "BLOCK_W": t.block_w, "BLOCK_K": t.block_k}, t)
            for name, fn, t in (("gate_up", _moe_gate_up_kernel, tiles.gate_up),
                                ("down", _moe_down_kernel, tiles.down))]


def group_variant(constants: dict[str, Any] | None = None) -> KernelVariant:
    """The grouping kernel; `constants` compiles E and OFFSET in (the AOT form)."""
    return _variant("moe_group", _moe_group_kernel, {}, {**(constants or {}), "BLOCK": GROUP_BLOCK}, None)


def combine_variant(constants: dict[str, Any] | None = None) -> KernelVariant:
    """The weighted sum of each token's slots; `constants` compiles L and TOP_K in (the AOT form)."""
    return _variant("moe_combine", _moe_combine_kernel, {}, {**(constants or {}), "BLOCK_L": COMBINE_BLOCK},
                    None)


def kernel_variants() -> list[KernelVariant]:
    """Every (kernel, activation dtype, weight form, tiles) combination the launchers can pick."""
    torch_dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    return [group_variant(), combine_variant()] + [
        v for dtype in DTYPES for packed in (False, True)
        for mode, tiles in tile_choices(torch_dtypes[dtype], packed).items()
        for v in grouped_variants(dtype, packed, tiles, mode)]
