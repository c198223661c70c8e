"""Triton kernels for the KDA recurrence (the contract of `torch.ops.k3.kda`).

Per batch b and head h, with S the [K, V] float32 state:
    S <- diag(exp(g_t)) S;  u = v_t - S^T k_t;  S <- S + beta_t k_t u^T;  o_t = S^T q_t
q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] float32.
Both launchers return o [B, T, H, V] in v's dtype and the final state in float32. The rows of a
ragged batch are right-padded, and the graph zeroes k, beta and g at the padded positions: such a
step leaves the state as it was (exp(0) = 1, no update), so the kernels need no lengths; the outputs
at padded positions are finite and meaningless.

`recurrent_kda` walks the tokens with one program per (batch, head, V-block), the state in
registers. `chunk_kda` takes chunks of 64 tokens in the UT-transform form of
flash-linear-attention's chunk pipeline (see k3export/ops/kda.py for the math), as four kernels
so that none holds more than a few float32 tiles at once:
    intra   per chunk:  A_qk, and UT = (I + A_kk)^-1 diag(beta) by forward substitution
    wy      per chunk:  G = cumsum(g), W = UT (exp(G) * K), U = UT V
    state   per (batch, head, V-block), sequential over chunks: each chunk's start state S and
            V' = U - W S
    output  per chunk and V-block:  O = (Q * exp(G)) S + A_qk V'
Intermediates are float32, and every product is a float32 FMA ("ieee") dot: exact float32, and
TF32x3 tensor-core dots need more registers than these kernels can spare.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3plugins.variants import DTYPES, KernelVariant, pointer

CHUNK_SIZE = 64
# Head dims the state-holding kernels are built for (the presets use 32, 64 and 128).
BLOCK_KS = (32, 64, 128)
# Block sizes, sized with the launch options below so that no variant spills registers on sm_90
# (tests/test_aot.py). V columns per program of the recurrent and output kernels (the output
# kernel also steps over K in blocks of this); K or V columns per program of the wy kernel.
BLOCK_V = 32
WY_BLOCK = 16
# The state pass takes V blocks of 16 and a chunk 16 rows at a time: a [64, 128] float32 tile at
# once would spill.
STATE_BLOCK_V = 16
STATE_ROWS = 16
# A chunk whose cumulative gate falls below -STEEP_GATE has its scores formed from differences of the gates:
# exp(-G) of a factored score would pass e^80 (float32 overflows at e^88.7), as in k3export/ops/kda.py.
STEEP_GATE = tl.constexpr(80.0)
# Key channels a factored score product takes at once.
SCORE_COLUMNS = tl.constexpr(16)


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
def _kda_step(S, q, k, v, g, beta, o, tok, K, V, offs_k, offs_v, mask_k, mask_v):
    """One token (row `tok` of the [B * T * H] token-heads) on the program's [BK, BV] block of the state:
    stores o_t and returns the new block. o_t = S_new^T q = S^T q + (beta k.q) u with S the decayed state,
    so both sums over the key channels read S at once: one reduction in the step's dependent chain, not
    two."""
    b_q = tl.load(q + tok * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + tok * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    b_g = tl.load(g + tok * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + tok * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + tok).to(tl.float32)
    S = S * tl.exp(b_g)[:, None]
    u = b_v - tl.sum(S * b_k[:, None], axis=0)
    b_o = tl.sum(S * b_q[:, None], axis=0)
    beta_k = b_beta * b_k
    b_o += tl.sum(beta_k * b_q) * u
    tl.store(o + tok * V + offs_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    return S + beta_k[:, None] * u[None, :]


@triton.jit
def _recurrent_kda_kernel(q, k, v, g, beta, h0, o, ht, T, H, K, V,
                          BK: tl.constexpr, BV: tl.constexpr):
    """Token by token, the program's [BK, BV] block of the state in registers: read once, written once."""
    i_b, i_h, offs_k, offs_v, mask_k, mask_v, s_offs, mask_s, S = _state_block(h0, H, K, V, BK, BV)
    for t in range(T):
        S = _kda_step(S, q, k, v, g, beta, o, (i_b * T + t) * H + i_h, K, V, offs_k, offs_v, mask_k, mask_v)
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
    """UT = (I + A)^-1 diag(beta), A = diag(beta) A_kk strictly below the diagonal, by forward substitution:
    row i of UT = beta_i e_i - A[i, :] UT, where the rows not yet filled are zero."""
    offs_t = tl.arange(0, BT)
    A = tl.where(offs_t[:, None] > offs_t[None, :], A_kk * b_beta[:, None], 0.0)
    UT = tl.zeros([BT, BT], dtype=tl.float32)
    for i in range(BT):
        row = offs_t == i
        a_i = tl.sum(tl.where(row[:, None], A, 0.0), axis=0)
        beta_i = tl.sum(tl.where(row, b_beta, 0.0))
        ut_i = tl.where(row, beta_i, 0.0) - tl.sum(a_i[:, None] * UT, axis=0)
        UT = tl.where(row[:, None], ut_i[None, :], UT)
    return UT


@triton.jit
def _chunk_kda_intra_kernel(q, k, g, beta, a_qk, ut, T, H, K, BT: tl.constexpr):
    """Per chunk: A_qk (causal) and UT = (I + A_kk)^-1 diag(beta), each [BT, BT] per token row."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    offs_t = tl.arange(0, BT)
    # Rows past T load k = 0, beta = 0 and g = 0: they add nothing to the state.
    mask_t = i_t * BT + offs_t < T
    tok = (i_b * T + i_t * BT + offs_t) * H + i_h
    causal = offs_t[:, None] >= offs_t[None, :]
    b_beta = tl.load(beta + tok, mask=mask_t, other=0.0)
    A_qk, A_kk = _scores_from_differences(q, k, g, tok, mask_t, K, causal, BT)
    tt_offs = tok[:, None] * BT + offs_t[None, :]
    tl.store(a_qk + tt_offs, A_qk, mask=mask_t[:, None])
    tl.store(ut + tt_offs, _ut_transform(A_kk, b_beta, BT), mask=mask_t[:, None])


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
def _chunk_kda_wy_kernel(k, v, g, ut, gcum, w, u, T, H, K, V, BT: tl.constexpr, BV: tl.constexpr):
    """Per chunk and block of BV columns: G = cumsum(g) and W = UT (exp(G) * K) for the key
    column blocks, U = UT V for the value column blocks after them. One product per program
    spreads the work and needs fewer registers than a loop over the blocks holding UT."""
    i_t, i_bh, i_c = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    offs_t = tl.arange(0, BT)
    mask_t = i_t * BT + offs_t < T
    tok = (i_b * T + i_t * BT + offs_t) * H + i_h
    UT = tl.load(ut + tok[:, None] * BT + offs_t[None, :], mask=mask_t[:, None], other=0.0)
    n_kblocks = tl.cdiv(K, BV)
    if i_c < n_kblocks:
        offs_k = i_c * BV + tl.arange(0, BV)
        tk_offs = tok[:, None] * K + offs_k[None, :]
        mask_tk = mask_t[:, None] & (offs_k < K)[None, :]
        G = tl.cumsum(tl.load(g + tk_offs, mask=mask_tk, other=0.0), axis=0)
        tl.store(gcum + tk_offs, G, mask=mask_tk)
        b_k = tl.load(k + tk_offs, mask=mask_tk, other=0.0).to(tl.float32)
        tl.store(w + tk_offs, tl.dot(UT, b_k * tl.exp(G), input_precision="ieee"), mask=mask_tk)
    else:
        offs_v = (i_c - n_kblocks) * BV + tl.arange(0, BV)
        tv_offs = tok[:, None] * V + offs_v[None, :]
        mask_tv = mask_t[:, None] & (offs_v < V)[None, :]
        b_v = tl.load(v + tv_offs, mask=mask_tv, other=0.0).to(tl.float32)
        tl.store(u + tv_offs, tl.dot(UT, b_v, input_precision="ieee"), mask=mask_tv)


@triton.jit
def _chunk_kda_state_kernel(k, gcum, w, u, h0, h, v_new, ht, T, H, K, V,
                            BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The only sequential pass: one program per (batch, head, V-block) carries S across the
    chunks, stores each chunk's start state, and forms V' = U - W S. A chunk is taken BR rows at
    a time, so that no [BT, BK] float32 tile need be held at once."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    n_chunks = tl.cdiv(T, BT)
    offs_r = tl.arange(0, BR)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_s = mask_k[:, None] & mask_v[None, :]
    s_offs = offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(h0 + i_bh * K * V + s_offs, mask=mask_s, other=0.0)
    for i_t in range(n_chunks):
        tl.store(h + (i_bh * n_chunks + i_t) * K * V + s_offs, S, mask=mask_s)
        last = (i_b * T + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h
        G_last = tl.load(gcum + last * K + offs_k, mask=mask_k, other=0.0)
        # S_next = exp(G_last) S + (K exp(G_last - G))^T V', summed over the row blocks.
        S_next = S * tl.exp(G_last)[:, None]
        for r0 in range(i_t * BT, i_t * BT + BT, BR):
            mask_t = r0 + offs_r < T
            tok = (i_b * T + r0 + offs_r) * H + i_h
            tk_offs = tok[:, None] * K + offs_k[None, :]
            mask_tk = mask_t[:, None] & mask_k[None, :]
            tv_offs = tok[:, None] * V + offs_v[None, :]
            mask_tv = mask_t[:, None] & mask_v[None, :]
            b_w = tl.load(w + tk_offs, mask=mask_tk, other=0.0)
            b_u = tl.load(u + tv_offs, mask=mask_tv, other=0.0)
            V_new = b_u - tl.dot(b_w, S, input_precision="ieee")
            tl.store(v_new + tv_offs, V_new, mask=mask_tv)
            G = tl.load(gcum + tk_offs, mask=mask_tk, other=0.0)
            # Rows past T have k = 0; their exponent is zeroed so that it cannot overflow.
            decay = tl.exp(tl.where(mask_tk, G_last[None, :] - G, 0.0))
            b_k = tl.load(k + tk_offs, mask=mask_tk, other=0.0).to(tl.float32)
            S_next += tl.dot(tl.trans(b_k * decay), V_new, input_precision="ieee")
        S = S_next
    tl.store(ht + i_bh * K * V + s_offs, S, mask=mask_s)


@triton.jit
def _chunk_kda_output_kernel(q, gcum, a_qk, h, v_new, o, T, H, K, V,
                             BT: tl.constexpr, BV: tl.constexpr):
    """Per chunk and V-block, given the chunk's start state S: O = (Q * exp(G)) S + A_qk V',
    the first product BV key channels at a time."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    offs_t = tl.arange(0, BT)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_t, mask_v = i_t * BT + offs_t < T, offs_v < V
    tok = (i_b * T + i_t * BT + offs_t) * H + i_h
    tv_offs = tok[:, None] * V + offs_v[None, :]
    mask_tv = mask_t[:, None] & mask_v[None, :]

    A_qk = tl.load(a_qk + tok[:, None] * BT + offs_t[None, :], mask=mask_t[:, None], other=0.0)
    V_new = tl.load(v_new + tv_offs, mask=mask_tv, other=0.0)
    b_o = tl.dot(A_qk, V_new, input_precision="ieee")
    h_chunk = h + (i_bh * tl.cdiv(T, BT) + i_t) * K * V
    for c0 in range(0, K, BV):
        offs_k = c0 + tl.arange(0, BV)
        mask_k = offs_k < K
        tk_offs = tok[:, None] * K + offs_k[None, :]
        mask_tk = mask_t[:, None] & mask_k[None, :]
        b_q = tl.load(q + tk_offs, mask=mask_tk, other=0.0).to(tl.float32)
        G = tl.load(gcum + tk_offs, mask=mask_tk, other=0.0)
        S = tl.load(h_chunk + offs_k[:, None] * V + offs_v[None, :],
                    mask=mask_k[:, None] & mask_v[None, :], other=0.0)
        b_o += tl.dot(b_q * tl.exp(G), S, input_precision="ieee")
    tl.store(o + tv_offs, b_o.to(o.dtype.element_ty), mask=mask_tv)


class _Kernel(NamedTuple):
    fn: triton.JITFunction
    blocks: dict[str, int]  # constexpr block sizes, bar BK
    per_bk: bool  # built per padded head dim BK (the kernels that hold a [BK, BV] state)
    num_warps: int
    num_stages: int = 3  # Triton's default

    def launch(self, grid: tuple[int, ...], *args: Any, **constexprs: int) -> None:
        self.fn[grid](*args, **self.blocks, **constexprs, num_warps=self.num_warps,
                      num_stages=self.num_stages)


RECURRENT = _Kernel(_recurrent_kda_kernel, {"BV": BLOCK_V}, per_bk=True, num_warps=4)
INTRA = _Kernel(_chunk_kda_intra_kernel, {"BT": CHUNK_SIZE}, per_bk=False, num_warps=8)
WY = _Kernel(_chunk_kda_wy_kernel, {"BT": CHUNK_SIZE, "BV": WY_BLOCK}, per_bk=False, num_warps=8)
# One stage: software pipelining would hold the next row block's tiles as well, and spill. With 8
# warps ptxas still spilled a few bytes at some K; 16 leave it ample room.
STATE = _Kernel(_chunk_kda_state_kernel, {"BT": CHUNK_SIZE, "BR": STATE_ROWS, "BV": STATE_BLOCK_V},
                per_bk=True, num_warps=16, num_stages=1)
OUTPUT = _Kernel(_chunk_kda_output_kernel, {"BT": CHUNK_SIZE, "BV": BLOCK_V}, per_bk=False, num_warps=8)


def _block_k(K: int) -> int:
    for bk in BLOCK_KS:
        if bk >= K:
            return bk
    raise ValueError(f"KDA head dim K={K}: the kernels support K <= {BLOCK_KS[-1]}")


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
             initial_state: Tensor) -> tuple[Tensor, ...]:
    # g and beta go in as float32 and q, k in v's dtype: the set of compiled variants stays small.
    q, k, v = (t.to(v.dtype).contiguous() for t in (q, k, v))
    g, beta, h0 = (t.float().contiguous() for t in (g, beta, initial_state))
    return q, k, v, g, beta, h0


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
    q, k, v, g, beta, h0 = _prepare(q, k, v, g, beta, initial_state)
    o, ht = _outputs(v, h0, o, final_state)
    RECURRENT.launch((B * H, triton.cdiv(V, BLOCK_V)), q, k, v, g, beta, h0, o, ht, T, H, K, V,
                     BK=_block_k(K))
    return o, ht


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor, *,
              o: Tensor | None = None, final_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Chunked UT-transform form for prefill: chunks of 64 tokens, four launches (see above).
    Outputs as for `recurrent_kda`: only the state pass reads the initial state, and each of its
    programs reads its block before storing it, so final_state may be initial_state."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    bk = _block_k(K)
    q, k, v, g, beta, h0 = _prepare(q, k, v, g, beta, initial_state)
    n_chunks = triton.cdiv(T, CHUNK_SIZE)
    a_qk, ut = (g.new_empty(B, T, H, CHUNK_SIZE) for _ in range(2))
    gcum, w = torch.empty_like(g), torch.empty_like(g)
    u, v_new = (v.new_empty(v.shape, dtype=torch.float32) for _ in range(2))
    h = h0.new_empty(B, H, n_chunks, K, V)  # each chunk's start state
    o, ht = _outputs(v, h0, o, final_state)
    INTRA.launch((n_chunks, B * H), q, k, g, beta, a_qk, ut, T, H, K)
    WY.launch((n_chunks, B * H, triton.cdiv(K, WY_BLOCK) + triton.cdiv(V, WY_BLOCK)),
              k, v, g, ut, gcum, w, u, T, H, K, V)
    STATE.launch((B * H, triton.cdiv(V, STATE_BLOCK_V)), k, gcum, w, u, h0, h, v_new, ht, T, H, K, V,
                 BK=bk)
    OUTPUT.launch((n_chunks, B * H, triton.cdiv(V, BLOCK_V)), q, gcum, a_qk, h, v_new, o, T, H, K, V)
    return o, ht


def _signatures(x: str) -> dict[str, dict[str, str]]:
    """Each kernel's runtime arguments, with x the pointer type of the tensors in v's dtype."""
    f32 = "*fp32"
    sizes = {"T": "i32", "H": "i32", "K": "i32", "V": "i32"}
    return {
        "recurrent_kda": {"q": x, "k": x, "v": x, "g": f32, "beta": f32, "h0": f32, "o": x, "ht": f32,
                          **sizes},
        "chunk_kda_intra": {"q": x, "k": x, "g": f32, "beta": f32, "a_qk": f32, "ut": f32, "T": "i32",
                            "H": "i32", "K": "i32"},
        "chunk_kda_wy": {"k": x, "v": x, "g": f32, "ut": f32, "gcum": f32, "w": f32, "u": f32, **sizes},
        "chunk_kda_state": {"k": x, "gcum": f32, "w": f32, "u": f32, "h0": f32, "h": f32, "v_new": f32,
                            "ht": f32, **sizes},
        "chunk_kda_output": {"q": x, "gcum": f32, "a_qk": f32, "h": f32, "v_new": f32, "o": x, **sizes},
    }


def kernel_variants() -> list[KernelVariant]:
    """Every (kernel, dtype, block) combination the launchers above can pick."""
    kernels = {"recurrent_kda": RECURRENT, "chunk_kda_intra": INTRA, "chunk_kda_wy": WY,
               "chunk_kda_state": STATE, "chunk_kda_output": OUTPUT}
    variants = []
    for dtype in DTYPES:
        signatures = _signatures(pointer(dtype))
        for name, kernel in kernels.items():
            for bk in BLOCK_KS if kernel.per_bk else (None,):
                constexprs = {**kernel.blocks, **({"BK": bk} if bk else {})}
                signature = {arg: signatures[name].get(arg, "constexpr") for arg in kernel.fn.arg_names}
                suffix = f"_k{bk}" if bk else ""
                variants.append(KernelVariant(f"{name}_{dtype}{suffix}", kernel.fn, signature,
                                              constexprs, kernel.num_warps, kernel.num_stages))
    return variants
