"""Triton kernels for the KDA recurrence (the contract of `torch.ops.k3.kda`).

Per batch b and head h, with S the [K, V] float32 state:
    S <- diag(exp(g_t)) S;  u = v_t - S^T k_t;  S <- S + beta_t k_t u^T;  o_t = S^T q_t
q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] float32.
Both launchers return o [B, T, H, V] in v's dtype and the final state in float32. The rows of a
ragged batch are right-padded, and the graph zeroes k, beta and g at the padded positions: such a
step leaves the state as it was (exp(0) = 1, no update), so the kernels need no lengths; the outputs
at padded positions are finite and meaningless.

`recurrent_kda` walks the tokens with one program per (batch, head, V-block), the state in
registers: the decode path, and fine for any small T. `chunk_kda` (prefill) takes chunks of 16 tokens in
the UT-transform form of flash-linear-attention's chunk pipeline (see k3export/ops/kda.py for the math),
as two kernels, FlashKDA's shape:
    prepare     per (chunk, batch x head), all in parallel: G = cumsum(g), the scores A_qk and A_kk,
                UT = (I + A_kk)^-1 diag(beta), W = UT (K exp(G)), U = UT V, and the decayed queries and
                keys, written in v's dtype
    recurrence  per (batch, head, V-block), sequential over the chunks with the state on chip: four
                products a chunk (V' = U - W S; O = qg S + A_qk V'; S <- exp(G_last) S + kt^T V')
The prepare kernel computes in float32 with float32 FMA ("ieee") products; the recurrence's products take
v's dtype (tensor cores in float16 / bfloat16) and accumulate in float32. The state stays float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3plugins.variants import DTYPES, KernelVariant, pointer

# Tokens a chunk: short enough that a chunk's decay stays within e^-STEEP_GATE at the published gate bound
# (g >= -5), so its scores factor (as in k3export/ops/kda.py and the AOT kernel).
CHUNK_SIZE = 16
# Head dims the state-holding kernels are built for (the presets use 32, 64 and 128).
BLOCK_KS = (32, 64, 128)
# The head dims, compiled as multiples of 16 as Triton's JIT specialises them at every preset's widths: the
# token rows' offsets are then aligned, so the loads vectorise (and can be pipelined with cp.async).
HEAD_DIMS = ("K", "V")
# Value columns a step of the prepare kernel's U = UT V takes.
BLOCK_V = 32
# The recurrent kernel (decode): value columns a program and warps. 16 columns and 4 warps put 8 lanes on the
# key channels (16 state elements a thread at K = 128, 3 shuffles a sum) and 96 programs on 12 heads at
# batch 1, where 32 columns would leave 84 of 132 SMs idle (tools/kernel_estimate.py).
STEP_BLOCK_V, STEP_WARPS = 16, 4
# Value columns a program of the chunk recurrence holds, and its pipeline stages (2: the next chunk's tiles
# fetched with cp.async during this chunk's products): as many columns as fit without spilling on sm_90a at
# 8 warps and K = 128 (tests/test_aot.py): 64 with products in float16 / bfloat16 (228 registers; 128
# spill), 16 with float32 FMA products at one stage (two stages spill).
RECURRENCE_BLOCKS = {"fp32": (16, 1), "fp16": (64, 2), "bf16": (64, 2)}
_DTYPE_NAMES = dict(zip((torch.float32, torch.float16, torch.bfloat16), DTYPES, strict=True))
# A chunk whose cumulative gate falls below -STEEP_GATE has its scores formed from differences of the gates:
# exp(-G) of a factored score would pass e^80 (float32 overflows at e^88.7), as in k3export/ops/kda.py.
STEEP_GATE = tl.constexpr(80.0)
# Key channels a factored score product takes at once.
SCORE_COLUMNS = tl.constexpr(16)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _state_block(h0, H, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """The program's (batch, head) and its [BK, BV] block of the state: indices, masks, offsets and the
    initial values (float32), for the kernels with one program per (batch, head, V-block)."""
    i_bh = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_s = mask_k[:, None] & mask_v[None, :]
    s_offs = (i_bh * K + offs_k[:, None]) * V + offs_v[None, :]
    S = tl.load(h0 + s_offs, mask=mask_s, other=0.0)
    return i_bh // H, i_bh % H, offs_k, offs_v, mask_k, mask_v, s_offs, mask_s, S


@triton.jit
def _recurrent_kda_kernel(q, k, v, g, beta, h0, o, ht, T, H, K, V,
                          BK: tl.constexpr, BV: tl.constexpr, LANES_K: tl.constexpr, SHORT_K: tl.constexpr):
    """Token by token, the program's [BK, BV] block of the state in registers: read once, written once.

    The block is held as [LANES_K, BV, BK // LANES_K], key channel k_lo * (BK // LANES_K) + k_hi: one value
    column a thread, LANES_K lanes along the key channels, the warps along the value columns (BV * LANES_K =
    32 * num_warps). So the step's sums over the key channels are in-thread adds and log2(LANES_K) shuffles,
    never an exchange between warps: no barrier in the dependent chain. Triton's coalescing would give the
    token rows (contiguous along K) a layout of their own and convert them to the state's through shared
    memory each step; their pointers are therefore declared non-contiguous (tl.max_contiguous 1), which
    leaves the axes in order: the layout above. The state is read in its own coalesced layout (16-byte
    loads) and converted once, outside the token loop.
    A step: S <- diag(exp(g)) S; u = v - S^T k; o = S_new^T q = S^T q + beta (k.q) u (so the three sums over
    the key channels read the decayed state at once, none waiting on another); S <- S + k (beta u)^T."""
    K_HI: tl.constexpr = BK // LANES_K
    i_bh = tl.program_id(0).to(tl.int64)
    i_b = i_bh // H
    row0 = i_bh + i_b * (T - 1) * H  # the first token's row, (i_b T) H + i_h, with no remainder to take
    lanes = tl.arange(0, LANES_K)[:, None, None]
    if SHORT_K:  # K < K_HI (head dims below BK / LANES_K): the token rows' loads are masked
        keys = lanes * K_HI + tl.arange(0, K_HI)[None, None, :]
        mask_k = keys < K
    else:
        # A lane's K_HI channels, its window moved back to end at K - 1 where K cuts it (or it lies past K):
        # every channel a thread reads is a real one, so the token rows' loads need no mask (no register
        # zeroed before each), and the addresses stay a base plus constants. The channels a moved window
        # holds twice belong to the lane below: the state's block is zero there and k is zeroed, so they add
        # nothing.
        keys = tl.minimum(lanes * K_HI, K - K_HI) + tl.arange(0, K_HI)[None, None, :]
        mask_k = keys >= lanes * K_HI
    mask_rows, zero_rows = (mask_k, 0.0) if SHORT_K else (None, None)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)[None, :, None]
    # Zeros the compiler cannot fold away, so that the token rows' offsets keep the block's 3-D shape (and
    # with it the layout) under the hint.
    zero_k, zero_v = tl.where(lanes < 0, lanes, 0), tl.where(cols < 0, cols, 0)
    mask_v = cols < V
    mask_s = mask_k & mask_v
    h0 += i_bh * K * V
    ht += i_bh * K * V
    s_offs = keys * V + cols
    S = tl.load(h0 + s_offs, mask=mask_s, other=0.0)
    for t in range(T):
        tok = row0 + t * H
        tk = tl.max_contiguous(tok * K + keys + zero_v, [1, 1, 1])
        tv = tl.max_contiguous(tok * V + cols + zero_k, [1, 1, 1])  # [LANES_K, BV, 1]: v in every lane
        b_q = tl.load(q + tk, mask=mask_rows, other=zero_rows).to(tl.float32)
        b_k = tl.where(mask_k, tl.load(k + tk, mask=mask_rows, other=zero_rows).to(tl.float32), 0.0)
        b_g = tl.load(g + tk, mask=mask_rows, other=zero_rows)
        b_v = tl.load(v + tv, mask=mask_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + tok)
        S = S * tl.math.exp2(b_g * LOG2E)  # ex2 of the decay, without exp's denormal handling: 3 SASS less
        sk = tl.sum(tl.sum(S * b_k, axis=2, keep_dims=True), axis=0, keep_dims=True)
        sq = tl.sum(tl.sum(S * b_q, axis=2, keep_dims=True), axis=0, keep_dims=True)
        kq = tl.sum(tl.sum(b_k * b_q, axis=2, keep_dims=True), axis=0, keep_dims=True)
        beta_u = b_beta * (b_v - sk)  # one product a column, not one a state element
        # One lane of each column stores it.
        tl.store(o + tv, (sq + kq * beta_u).to(o.dtype.element_ty), mask=mask_v & (lanes == 0))
        S = S + b_k * beta_u
    tl.store(ht + s_offs, S, mask=mask_s)


@triton.jit
def _scores_from_differences(q, k, g, tok, mask_t, K, causal, BT: tl.constexpr):
    """A_qk and A_kk [BT, BT] of one chunk (rows `tok`): sum_d x_id k_jd exp(G_id - G_jd), x = q, k, one
    key channel at a time read from memory: the decay is formed from the difference of cumulative gates,
    masked to j <= i before exponentiating, so it never overflows however long the chunk's decay."""
    A_kk = tl.zeros([BT, BT], dtype=tl.float32)
    A_qk = tl.zeros([BT, BT], dtype=tl.float32)
    for d in range(K):
        k_d = tl.load(k + tok * K + d, mask=mask_t, other=0.0).to(tl.float32)
        q_d = tl.load(q + tok * K + d, mask=mask_t, other=0.0).to(tl.float32)
        G_d = tl.cumsum(tl.load(g + tok * K + d, mask=mask_t, other=0.0), axis=0)
        decay_k = k_d[None, :] * tl.exp(tl.where(causal, G_d[:, None] - G_d[None, :], float("-inf")))
        A_kk += k_d[:, None] * decay_k
        A_qk += q_d[:, None] * decay_k
    return A_qk, A_kk


@triton.jit
def _scores_factored(q, k, g, tok, mask_t, K, BT: tl.constexpr, BC: tl.constexpr):
    """A_qk and A_kk [BT, BT] of one chunk as _scores_from_differences, for a chunk whose decay stays
    within e^-STEEP_GATE: exp(G_i - G_j) = exp(G_i) exp(-G_j), as float32 products of BC key channels at a
    time read from memory (a whole row of K channels per thread would not fit in registers)."""
    offs_c = tl.arange(0, BC)
    A_kk = tl.zeros([BT, BT], dtype=tl.float32)
    A_qk = tl.zeros([BT, BT], dtype=tl.float32)
    for c0 in range(0, K, BC):
        tc_offs = tok[:, None] * K + c0 + offs_c[None, :]
        mask_tc = mask_t[:, None] & (c0 + offs_c < K)[None, :]
        b_k = tl.load(k + tc_offs, mask=mask_tc, other=0.0).to(tl.float32)
        b_q = tl.load(q + tc_offs, mask=mask_tc, other=0.0).to(tl.float32)
        decay = tl.exp(tl.cumsum(tl.load(g + tc_offs, mask=mask_tc, other=0.0), axis=0))
        k_grown = tl.trans(b_k / decay)
        A_kk += tl.dot(b_k * decay, k_grown, input_precision="ieee")
        A_qk += tl.dot(b_q * decay, k_grown, input_precision="ieee")
    return A_qk, A_kk


@triton.jit
def _ut_transform(A_kk, b_beta, BT: tl.constexpr):
    """UT = (I + A)^-1 diag(beta), A = diag(beta) A_kk strictly below the diagonal. A is nilpotent (A^BT = 0),
    so (I + A)^-1 = (I - A)(I + A^2)(I + A^4) ... (I + A^(BT/2)): log2(BT) - 1 squarings and as many
    products, float32 throughout (the eager op's doubling inverse, as whole-matrix products; BT a power of
    two, at least 16 for tl.dot)."""
    offs_t = tl.arange(0, BT)
    A = tl.where(offs_t[:, None] > offs_t[None, :], A_kk * b_beta[:, None], 0.0)
    inverse = tl.where(offs_t[:, None] == offs_t[None, :], 1.0, 0.0) - A
    power = A
    for _ in tl.static_range(BT.bit_length() - 2):
        power = tl.dot(power, power, input_precision="ieee")
        inverse += tl.dot(inverse, power, input_precision="ieee")
    return inverse * b_beta[None, :]


@triton.jit
def _fused_chunk_kda_kernel(q, k, v, g, beta, h0, o, ht, T, H, K, V,
                            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Prefill in one launch: one program per (batch, head, V-block) walks the chunks of BT tokens with
    S [BK, BV] float32 in registers, each chunk in the UT-transform form (as the four chunk kernels):
        A_qk, A_kk = (Q, K) exp(G) (K exp(-G))^T;  UT = (I + A_kk)^-1 diag(beta)
        W = UT (K exp(G));  V' = UT V - W S;  O = (Q exp(G)) S + A_qk V'
        S <- exp(G_last) S + (K exp(G_last - G))^T V'
    The scores take float32 FMA products (exp(-G) reaches e^80 in a chunk, past float16's range); every
    other product takes the inputs' dtype: tensor cores in float16 / bfloat16 (the float32 operands, the
    state among them, rounded to it), float32 FMA for float32 inputs; all accumulate in float32."""
    i_b, i_h, offs_k, offs_v, mask_k, mask_v, s_offs, mask_s, S = _state_block(h0, H, K, V, BK, BV)
    x = v.dtype.element_ty
    offs_t = tl.arange(0, BT)
    causal = offs_t[:, None] >= offs_t[None, :]
    for t0 in range(0, T, BT):
        # Rows past T load k = 0, beta = 0 and g = 0: they add nothing to the state.
        mask_t = t0 + offs_t < T
        tok = (i_b * T + t0 + offs_t) * H + i_h
        tk_offs = tok[:, None] * K + offs_k[None, :]
        mask_tk = mask_t[:, None] & mask_k[None, :]
        tv_offs = tok[:, None] * V + offs_v[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        b_q = tl.load(q + tk_offs, mask=mask_tk, other=0.0).to(tl.float32)
        b_k = tl.load(k + tk_offs, mask=mask_tk, other=0.0).to(tl.float32)
        b_v = tl.load(v + tv_offs, mask=mask_tv, other=0.0)
        b_g = tl.load(g + tk_offs, mask=mask_tk, other=0.0)
        b_beta = tl.load(beta + tok, mask=mask_t, other=0.0)
        G = tl.cumsum(b_g, axis=0)
        G_last = tl.sum(b_g, axis=0)
        decay = tl.exp(G)
        # exp(G_i - G_j) = exp(G_i) exp(-G_j) unless the chunk decays past e^-STEEP_GATE (then exp(-G_j)
        # could overflow): such a chunk's scores are formed from the differences, as the eager op does.
        if tl.min(G) > -STEEP_GATE:
            A_qk, A_kk = _scores_factored(q, k, g, tok, mask_t, K, BT, SCORE_COLUMNS)
        else:
            A_qk, A_kk = _scores_from_differences(q, k, g, tok, mask_t, K, causal, BT)
        UT = _ut_transform(A_kk, b_beta, BT).to(x)
        W = tl.dot(UT, (b_k * decay).to(x), input_precision="ieee")
        S_x = S.to(x)
        V_new = tl.dot(UT, b_v, input_precision="ieee") - tl.dot(W.to(x), S_x, input_precision="tf32x3")
        V_x = V_new.to(x)
        b_o = tl.dot((b_q * decay).to(x), S_x, input_precision="ieee") \
            + tl.dot(tl.where(causal, A_qk, 0.0).to(x), V_x, input_precision="ieee")
        tl.store(o + tv_offs, b_o.to(o.dtype.element_ty), mask=mask_tv)
        k_tail = b_k * tl.exp(G_last[None, :] - G)  # keys decayed to the chunk's end (<= 1: G_last <= G)
        S = S * tl.exp(G_last)[:, None] + tl.dot(tl.trans(k_tail.to(x)), V_x, input_precision="ieee")
    tl.store(ht + s_offs, S, mask=mask_s)


@triton.jit
def _kda_prepare_kernel(q, k, v, g, beta, qg, kt, w, u, a_qk, decay_last, T, H, K, V,
                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The parallel half of prefill, one program per (chunk of BT tokens, batch x head): everything of a
    chunk that does not depend on the state, in float32, written in v's dtype (decay_last in float32):
        G = cumsum(g);  A_qk, A_kk = (Q, K) exp(G_i - G_j) K^T (causal; A_kk below the diagonal)
        UT = (I + A_kk)^-1 diag(beta);  W = UT (K exp(G));  U = UT V
        qg = Q exp(G);  kt = K exp(G_last - G);  decay_last = exp(G_last)
    qg, kt, w: [B, T, H, K]; u: [B, T, H, V]; a_qk: [B, T, H, BT]; decay_last: [B, n_chunks, H, K]."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    x = qg.dtype.element_ty
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    # Rows past T load k = 0, beta = 0 and g = 0: they add nothing to the state.
    mask_t, mask_k = i_t * BT + offs_t < T, offs_k < K
    tok = (i_b * T + i_t * BT + offs_t) * H + i_h
    tk_offs = tok[:, None] * K + offs_k[None, :]
    mask_tk = mask_t[:, None] & mask_k[None, :]
    b_g = tl.load(g + tk_offs, mask=mask_tk, other=0.0)
    b_beta = tl.load(beta + tok, mask=mask_t, other=0.0)
    G = tl.cumsum(b_g, axis=0)
    G_last = tl.sum(b_g, axis=0)
    causal = offs_t[:, None] >= offs_t[None, :]
    # exp(G_i - G_j) = exp(G_i) exp(-G_j) unless the chunk decays past e^-STEEP_GATE (then exp(-G_j) could
    # overflow): such a chunk's scores are formed from the differences, as the eager op does.
    if tl.min(G) > -STEEP_GATE:
        A_qk, A_kk = _scores_factored(q, k, g, tok, mask_t, K, BT, SCORE_COLUMNS)
    else:
        A_qk, A_kk = _scores_from_differences(q, k, g, tok, mask_t, K, causal, BT)
    UT = _ut_transform(A_kk, b_beta, BT).to(x)
    tl.store(a_qk + tok[:, None] * BT + offs_t[None, :], tl.where(causal, A_qk, 0.0).to(x),
             mask=mask_t[:, None])
    b_q = tl.load(q + tk_offs, mask=mask_tk, other=0.0).to(tl.float32)
    b_k = tl.load(k + tk_offs, mask=mask_tk, other=0.0).to(tl.float32)
    decay = tl.exp(G)
    tl.store(qg + tk_offs, (b_q * decay).to(x), mask=mask_tk)
    tl.store(kt + tk_offs, (b_k * tl.exp(G_last[None, :] - G)).to(x), mask=mask_tk)  # <= k: G_last <= G
    tl.store(w + tk_offs, tl.dot(UT, (b_k * decay).to(x), input_precision="ieee").to(x), mask=mask_tk)
    tl.store(decay_last + ((i_b * tl.cdiv(T, BT) + i_t) * H + i_h) * K + offs_k, tl.exp(G_last), mask=mask_k)
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        tv_offs = tok[:, None] * V + offs_v[None, :]
        mask_tv = mask_t[:, None] & (offs_v < V)[None, :]
        b_v = tl.load(v + tv_offs, mask=mask_tv, other=0.0)
        tl.store(u + tv_offs, tl.dot(UT, b_v, input_precision="ieee").to(x), mask=mask_tv)


@triton.jit
def _kda_chunk_recurrence_kernel(qg, kt, w, u, a_qk, decay_last, h0, o, ht, T, H, K, V,
                                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The sequential half of prefill: one program per (batch, head, BV value columns) carries its [BK, BV]
    float32 block of the state across the chunks that _kda_prepare_kernel formed, four products a chunk:
        V' = U - W S;  O = qg S + A_qk V';  S <- decay_last S + kt^T V'
    The products take the intermediates' dtype (tensor cores in float16 / bfloat16, the state rounded to it
    as an operand; float32 FMA for float32) and accumulate in float32; nothing in a chunk's loads depends on
    the state, so the pipeliner can fetch the next chunk's tiles during this one's products."""
    i_b, i_h, offs_k, offs_v, mask_k, mask_v, s_offs, mask_s, S = _state_block(h0, H, K, V, BK, BV)
    offs_t = tl.arange(0, BT)
    n_chunks = tl.cdiv(T, BT)
    for i_t in range(n_chunks):
        mask_t = i_t * BT + offs_t < T
        tok = (i_b * T + i_t * BT + offs_t) * H + i_h
        tk_offs = tok[:, None] * K + offs_k[None, :]
        mask_tk = mask_t[:, None] & mask_k[None, :]
        tv_offs = tok[:, None] * V + offs_v[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        b_w = tl.load(w + tk_offs, mask=mask_tk, other=0.0)
        b_qg = tl.load(qg + tk_offs, mask=mask_tk, other=0.0)
        b_kt = tl.load(kt + tk_offs, mask=mask_tk, other=0.0)
        b_u = tl.load(u + tv_offs, mask=mask_tv, other=0.0).to(tl.float32)
        b_a = tl.load(a_qk + tok[:, None] * BT + offs_t[None, :], mask=mask_t[:, None], other=0.0)
        chunk_k = ((i_b * n_chunks + i_t) * H + i_h) * K + offs_k
        b_decay = tl.load(decay_last + chunk_k, mask=mask_k, other=0.0)
        S_x = S.to(b_w.dtype)
        V_new = (b_u - tl.dot(b_w, S_x, input_precision="ieee")).to(b_w.dtype)
        b_o = tl.dot(b_qg, S_x, input_precision="ieee") + tl.dot(b_a, V_new, input_precision="ieee")
        tl.store(o + tv_offs, b_o.to(o.dtype.element_ty), mask=mask_tv)
        S = S * b_decay[:, None] + tl.dot(tl.trans(b_kt), V_new, input_precision="ieee")
    tl.store(ht + s_offs, S, mask=mask_s)


def step_lanes(block_v: int, num_warps: int) -> int:
    """The recurrent kernel's lanes along the key channels for `block_v` value columns a program on
    `num_warps` warps: the warps' 32 lanes each, shared out one value column a lane."""
    return 32 * num_warps // block_v


def short_k(head_dim: int, block_k: int, lanes: int) -> bool:
    """Whether `head_dim` is shorter than the recurrent kernel's window of key channels a lane (BK /
    LANES_K): its token rows' loads are then masked (SHORT_K)."""
    return head_dim < block_k // lanes


class _Kernel(NamedTuple):
    fn: triton.JITFunction
    blocks: dict[str, int]  # constexpr block sizes, bar BK (every kernel is built per padded head dim BK)
    num_warps: int
    num_stages: int = 3  # Triton's default

    def launch(self, grid: tuple[int, ...], *args: Any, **constexprs: int) -> None:
        self.fn[grid](*args, **{**self.blocks, **constexprs}, num_warps=self.num_warps,
                      num_stages=self.num_stages)


# SHORT_K as launched (short_k); compiled variants take the head dims of BLOCK_KS, none short.
RECURRENT = _Kernel(_recurrent_kda_kernel,
                    {"BV": STEP_BLOCK_V, "LANES_K": step_lanes(STEP_BLOCK_V, STEP_WARPS), "SHORT_K": False},
                    STEP_WARPS)
PREPARE = _Kernel(_kda_prepare_kernel, {"BT": CHUNK_SIZE, "BV": BLOCK_V}, num_warps=4)
# One recurrence per dtype: its value columns and stages depend on the products' precision.
RECURRENCE = {dtype: _Kernel(_kda_chunk_recurrence_kernel, {"BT": CHUNK_SIZE, "BV": bv}, num_warps=8,
                             num_stages=stages)
              for dtype, (bv, stages) in RECURRENCE_BLOCKS.items()}


def _block_k(K: int) -> int:
    for bk in BLOCK_KS:
        if bk >= K:
            return bk
    raise ValueError(f"KDA head dim K={K}: the kernels support K <= {BLOCK_KS[-1]}")


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    # g and beta go in as float32 and q, k in v's dtype: the set of compiled variants stays small.
    q, k, v = (t.to(v.dtype).contiguous() for t in (q, k, v))
    g, beta = (t.float().contiguous() for t in (g, beta))
    return q, k, v, g, beta


def _outputs(v: Tensor, h0: Tensor, o: Tensor | None, final_state: Tensor | None) -> tuple[Tensor, Tensor]:
    # Caller-given outputs (TensorRT's buffers) are written directly; final_state may be the
    # initial state itself: every program loads its block of the state before it stores that block,
    # and no other program touches it, so the update is safe in place.
    for name, given, like in (("o", o, v), ("final_state", final_state, h0)):
        if given is not None and (given.shape != like.shape or given.dtype != like.dtype
                                  or not given.is_contiguous()):
            raise ValueError(f"KDA: {name} must be a contiguous {like.dtype} tensor of shape "
                             f"{list(like.shape)}, not {given.dtype} {list(given.shape)}")
    return (torch.empty_like(v) if o is None else o,
            torch.empty_like(h0) if final_state is None else final_state)


def recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor, *,
                  o: Tensor | None = None, final_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token by token: the decode path (T = 1), fine for any small T. `o` and `final_state` are
    optional output buffers; final_state may be initial_state (updated in place)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    h0 = initial_state.float().contiguous()
    o, ht = _outputs(v, h0, o, final_state)
    bk = _block_k(K)
    RECURRENT.launch((B * H, triton.cdiv(V, STEP_BLOCK_V)), q, k, v, g, beta, h0, o, ht, T, H, K, V, BK=bk,
                     SHORT_K=short_k(K, bk, RECURRENT.blocks["LANES_K"]))
    return o, ht


def kda_prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                intermediates: Sequence[Tensor] | None = None) -> tuple[Tensor, ...]:
    """chunk_kda's first launch: (qg, kt, w [B, T, H, K], u [B, T, H, V], a_qk [B, T, H, CHUNK_SIZE], in v's
    dtype; decay_last [B, n_chunks, H, K], float32), into `intermediates` where given (TensorRT's buffers)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    n_chunks = triton.cdiv(T, CHUNK_SIZE)
    if intermediates is None:
        intermediates = (*(torch.empty_like(q) for _ in range(3)), torch.empty_like(v),
                         v.new_empty(B, T, H, CHUNK_SIZE), g.new_empty(B, n_chunks, H, K))
    PREPARE.launch((n_chunks, B * H), q, k, v, g, beta, *intermediates, T, H, K, V, BK=_block_k(K))
    return tuple(intermediates)


def kda_chunk_recurrence(intermediates: Sequence[Tensor], initial_state: Tensor, *, o: Tensor | None = None,
                         final_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """chunk_kda's second launch: the recurrence over kda_prepare's `intermediates`. Only it reads the
    initial state, and each of its programs reads its block before storing it, so final_state may be
    initial_state."""
    qg, u = intermediates[0], intermediates[3]
    B, T, H, K = qg.shape
    V = u.shape[-1]
    h0 = initial_state.float().contiguous()
    o, ht = _outputs(u, h0, o, final_state)
    recurrence = RECURRENCE[_DTYPE_NAMES[u.dtype]]
    recurrence.launch((B * H, triton.cdiv(V, recurrence.blocks["BV"])), *intermediates, h0, o, ht, T, H, K, V,
                      BK=_block_k(K))
    return o, ht


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor, *,
              o: Tensor | None = None, final_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Prefill in two launches (see above): the chunks' terms in parallel, then the recurrence over them.
    Outputs as for `recurrent_kda`."""
    return kda_chunk_recurrence(kda_prepare(q, k, v, g, beta), initial_state, o=o, final_state=final_state)


def _signatures(x: str) -> dict[str, dict[str, str]]:
    """Each kernel's runtime arguments, with x the pointer type of the tensors in v's dtype."""
    f32 = "*fp32"
    sizes = {"T": "i32", "H": "i32", "K": "i32", "V": "i32"}
    return {
        "recurrent_kda": {"q": x, "k": x, "v": x, "g": f32, "beta": f32, "h0": f32, "o": x, "ht": f32,
                          **sizes},
        "kda_prepare": {"q": x, "k": x, "v": x, "g": f32, "beta": f32, "qg": x, "kt": x, "w": x, "u": x,
                        "a_qk": x, "decay_last": f32, **sizes},
        "kda_chunk_recurrence": {"qg": x, "kt": x, "w": x, "u": x, "a_qk": x, "decay_last": f32, "h0": f32,
                                 "o": x, "ht": f32, **sizes},
    }


def kernel_variants() -> list[KernelVariant]:
    """Every (kernel, dtype, block) combination the launchers above can pick."""
    variants = []
    for dtype in DTYPES:
        signatures = _signatures(pointer(dtype))
        kernels = {"recurrent_kda": RECURRENT, "kda_prepare": PREPARE,
                   "kda_chunk_recurrence": RECURRENCE[dtype]}
        for name, kernel in kernels.items():
            signature = {arg: signatures[name].get(arg, "constexpr") for arg in kernel.fn.arg_names}
            variants += [KernelVariant(f"{name}_{dtype}_k{bk}", kernel.fn, signature,
                                       {**kernel.blocks, "BK": bk}, kernel.num_warps, kernel.num_stages,
                                       divisible_by_16=HEAD_DIMS)
                         for bk in BLOCK_KS]
    return variants
