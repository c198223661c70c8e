"""Triton kernels for the KDA recurrence (the contract of `torch.ops.k3.kda`).

Per batch b and head h, with S the [K, V] float32 state:
    S <- diag(exp(g_t)) S;  u = v_t - S^T k_t;  S <- S + beta_t k_t u^T;  o_t = S^T q_t
q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] float32.
Both launchers return o [B, T, H, V] in v's dtype and the final state in float32.

Each program owns one (batch, head, V-block) slice of the state and walks the whole sequence,
so the state stays in registers and never round-trips through memory between tokens or chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3plugins.variants import DTYPES, KernelVariant, pointer

CHUNK_SIZE = 64
# Head dims the kernels are built for (the presets use 32, 64 and 128); K <= 128 keeps a chunk's
# [64, K] float32 tiles in registers.
BLOCK_KS = (32, 64, 128)
RECURRENT_BLOCK_V = 32
RECURRENT_WARPS = 4
CHUNK_BLOCK_V = 32
CHUNK_WARPS = 8


@triton.jit
def _recurrent_kda_kernel(q, k, v, g, beta, h0, o, ht, T, H, K, V,
                          BK: tl.constexpr, BV: tl.constexpr):
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_s = mask_k[:, None] & mask_v[None, :]
    s_offs = (i_bh * K + offs_k[:, None]) * V + offs_v[None, :]
    S = tl.load(h0 + s_offs, mask=mask_s, other=0.0)
    for t in range(T):
        tok = (i_b * T + t) * H + i_h
        b_q = tl.load(q + tok * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + tok * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        b_g = tl.load(g + tok * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + tok * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + tok).to(tl.float32)
        S = S * tl.exp(b_g)[:, None]
        u = b_v - tl.sum(S * b_k[:, None], axis=0)
        S += (b_beta * b_k)[:, None] * u[None, :]
        b_o = tl.sum(S * b_q[:, None], axis=0)
        tl.store(o + tok * V + offs_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    tl.store(ht + s_offs, S, mask=mask_s)


@triton.jit
def _chunk_kda_kernel(q, k, v, g, beta, h0, o, ht, T, H, K, V,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_s = mask_k[:, None] & mask_v[None, :]
    s_offs = (i_bh * K + offs_k[:, None]) * V + offs_v[None, :]
    S = tl.load(h0 + s_offs, mask=mask_s, other=0.0)
    causal = offs_t[:, None] >= offs_t[None, :]
    for start in range(0, T, BT):
        # Rows past T load k = 0, beta = 0 and g = 0: they add nothing to the state.
        mask_t = start + offs_t < T
        tok = (i_b * T + start + offs_t) * H + i_h
        tk_offs = tok[:, None] * K + offs_k[None, :]
        mask_tk = mask_t[:, None] & mask_k[None, :]
        b_beta = tl.load(beta + tok, mask=mask_t, other=0.0).to(tl.float32)

        # A_kk[i, j] = sum_d k_id k_jd exp(G_id - G_jd) (and A_qk with q_i), one key channel at a
        # time: the decay is formed from the difference of cumulative gates, masked to j <= i
        # before exponentiating, so it never overflows however long the chunk's decay.
        A_kk = tl.zeros([BT, BT], dtype=tl.float32)
        A_qk = tl.zeros([BT, BT], dtype=tl.float32)
        for d in range(K):
            k_d = tl.load(k + tok * K + d, mask=mask_t, other=0.0).to(tl.float32)
            q_d = tl.load(q + tok * K + d, mask=mask_t, other=0.0).to(tl.float32)
            G_d = tl.cumsum(tl.load(g + tok * K + d, mask=mask_t, other=0.0).to(tl.float32), axis=0)
            decay_k = k_d[None, :] * tl.exp(tl.where(causal, G_d[:, None] - G_d[None, :], float("-inf")))
            A_kk += k_d[:, None] * decay_k
            A_qk += q_d[:, None] * decay_k
        A_kk = tl.where(causal & (offs_t[:, None] != offs_t[None, :]), A_kk * b_beta[:, None], 0.0)

        # T = (I + A_kk)^-1 diag(beta) by forward substitution: row i = beta_i e_i - A_kk[i, :] T,
        # where the rows of T not yet filled are zero.
        T_mat = tl.zeros([BT, BT], dtype=tl.float32)
        for i in range(BT):
            row = offs_t == i
            a_i = tl.sum(tl.where(row[:, None], A_kk, 0.0), axis=0)
            beta_i = tl.sum(tl.where(row, b_beta, 0.0))
            t_i = tl.where(row, beta_i, 0.0) - tl.sum(a_i[:, None] * T_mat, axis=0)
            T_mat = tl.where(row[:, None], t_i[None, :], T_mat)

        b_g = tl.load(g + tk_offs, mask=mask_tk, other=0.0).to(tl.float32)
        G = tl.cumsum(b_g, axis=0)
        b_k = tl.load(k + tk_offs, mask=mask_tk, other=0.0).to(tl.float32)
        tv_offs = tok[:, None] * V + offs_v[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        b_v = tl.load(v + tv_offs, mask=mask_tv, other=0.0).to(tl.float32)
        # float32 products on tensor cores as three TF32 products: near float32 accuracy, and fewer
        # registers than the FMA ("ieee") path at these tile sizes.
        W = tl.dot(T_mat, b_k * tl.exp(G), input_precision="tf32x3")
        U = tl.dot(T_mat, b_v, input_precision="tf32x3")
        V_new = U - tl.dot(W, S, input_precision="tf32x3")

        b_q = tl.load(q + tk_offs, mask=mask_tk, other=0.0).to(tl.float32)
        b_o = tl.dot(b_q * tl.exp(G), S, input_precision="tf32x3") \
            + tl.dot(A_qk, V_new, input_precision="tf32x3")
        tl.store(o + tv_offs, b_o.to(o.dtype.element_ty), mask=mask_tv)

        G_last = tl.sum(b_g, axis=0)
        k_decayed = b_k * tl.exp(G_last[None, :] - G)
        S = S * tl.exp(G_last)[:, None] + tl.dot(tl.trans(k_decayed), V_new, input_precision="tf32x3")
    tl.store(ht + s_offs, S, mask=mask_s)


def _block_k(K: int) -> int:
    for bk in BLOCK_KS:
        if bk >= K:
            return bk
    raise ValueError(f"KDA head dim K={K}: the kernels support K <= {BLOCK_KS[-1]}")


def _launch(kernel: triton.JITFunction, block_v: int, num_warps: int, q: Tensor, k: Tensor,
            v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
            **constexprs: int) -> tuple[Tensor, Tensor]:
    B, T, H, K = q.shape
    V = v.shape[-1]
    # g and beta go in as float32 and q, k in v's dtype: the set of compiled variants stays small.
    q, k, v = (t.to(v.dtype).contiguous() for t in (q, k, v))
    g, beta, h0 = (t.float().contiguous() for t in (g, beta, initial_state))
    o = torch.empty_like(v)
    ht = torch.empty_like(h0)
    grid = (B * H, triton.cdiv(V, block_v))
    kernel[grid](q, k, v, g, beta, h0, o, ht, T, H, K, V, BK=_block_k(K), BV=block_v,
                 num_warps=num_warps, **constexprs)
    return o, ht


def recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """Token by token: the decode path (T = 1), fine for any small T."""
    return _launch(_recurrent_kda_kernel, RECURRENT_BLOCK_V, RECURRENT_WARPS,
                   q, k, v, g, beta, initial_state)


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """Chunked UT-transform form for prefill: chunks of 64 tokens, state carried in registers."""
    return _launch(_chunk_kda_kernel, CHUNK_BLOCK_V, CHUNK_WARPS, q, k, v, g, beta, initial_state,
                   BT=CHUNK_SIZE)


def kernel_variants() -> list[KernelVariant]:
    """Every (kernel, dtype, block) combination the launchers above can pick."""
    kernels = [
        ("recurrent_kda", _recurrent_kda_kernel, RECURRENT_BLOCK_V, RECURRENT_WARPS, {}),
        ("chunk_kda", _chunk_kda_kernel, CHUNK_BLOCK_V, CHUNK_WARPS, {"BT": CHUNK_SIZE}),
    ]
    variants = []
    for name, fn, block_v, num_warps, extra in kernels:
        for dtype in DTYPES:
            for bk in BLOCK_KS:
                signature = {"q": pointer(dtype), "k": pointer(dtype), "v": pointer(dtype),
                             "g": "*fp32", "beta": "*fp32", "h0": "*fp32", "o": pointer(dtype),
                             "ht": "*fp32", "T": "i32", "H": "i32", "K": "i32", "V": "i32"}
                constexprs = {**extra, "BK": bk, "BV": block_v}
                signature.update(dict.fromkeys(constexprs, "constexpr"))
                variants.append(KernelVariant(f"{name}_{dtype}_k{bk}", fn, signature, constexprs,
                                              num_warps))
    return variants
