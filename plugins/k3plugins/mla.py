"""Triton kernels for absorbed latent attention (the contract of `torch.ops.k3.latent_mla`).

q [B, T, H, D] attends to the shared latent cache kv [B, 1, C, D] of fixed capacity C, whose rows
cache_lengths[b] .. cache_lengths[b] + T - 1 hold this call's T new tokens: query t of row b sees
rows 0 .. cache_lengths[b] + t and no further, so each row reads only its own length (a padded query
still sees a valid prefix). The values are kv[..., :v_dim]. Every query head shares the one key
head, so a program takes a tile of (token, head) rows and loads each cache block once for all of
them. D is split into the value part [0, v_dim) and the rest [v_dim, D) (the rope slot), each padded
to a power of two with masks, so D = 576 = 512 + 64 and the tiny model's 48 = 32 + 16 need no padding
in memory.

Decode (small T) splits each row's visible cache among programs (flash-decoding) and a second kernel
combines the partial results by their log-sum-exp; prefill walks a row's visible cache in one program.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3plugins.variants import DTYPES, KernelVariant, pointer


class _Tiles(NamedTuple):
    block_t: int  # query tokens per program
    block_h: int  # query heads per program
    block_s: int  # cache rows per loop step
    num_warps: int


DECODE = _Tiles(block_t=1, block_h=16, block_s=16, num_warps=4)
PREFILL = _Tiles(block_t=16, block_h=1, block_s=16, num_warps=8)
# At 8 warps float32 prefill spills registers at the published width (v_dim 512) on sm_90, and
# at 4 warps at v_dim 128; 16 warps leave ptxas room.
PREFILL_FP32 = PREFILL._replace(num_warps=16)
DECODE_MAX_T = 16
# Decode gives each split at least SPLIT_ROWS of a row's visible cache rows; the capacity sets the number
# of splits, at most MAX_SPLITS.
SPLIT_ROWS = 256
MAX_SPLITS = 32
COMBINE_BLOCK_R = 16
COMBINE_WARPS = 4
# (value block, rope block) of the presets: v_dim 32 / 128 / 512 with rope 16 / 32 / 64.
BLOCK_DIMS = ((32, 16), (128, 32), (512, 64))


@triton.jit
def _mla_attn_kernel(q, kv, lengths, o, lse, T, C, H, D, v_dim, n_rows, split_rows, scale,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                     BDV: tl.constexpr, BDR: tl.constexpr, V_SLICES: tl.constexpr):
    n_tblocks = tl.cdiv(T, BLOCK_T)
    i_b = tl.program_id(0) // n_tblocks
    t0 = tl.program_id(0) % n_tblocks * BLOCK_T
    i_split, n_splits = tl.program_id(2), tl.num_programs(2)
    offs_m = tl.arange(0, BLOCK_T * BLOCK_H)
    t = t0 + offs_m // BLOCK_H
    h = tl.program_id(1) * BLOCK_H + offs_m % BLOCK_H
    mask_m = (t < T) & (h < H)
    row = (i_b * T + t).to(tl.int64) * H + h
    # V_SLICES > 1 (the AOT float32 kernel, whose whole float32 value block needs more than the 48 KB of
    # shared memory a launch gets): the value columns are taken BDO at a time, one pass over the cache each,
    # the scores formed a slice of columns at a time.
    BDO: tl.constexpr = BDV // V_SLICES
    if V_SLICES == 1:
        offs_v = tl.arange(0, BDV)
        mask_v = mask_m[:, None] & (offs_v < v_dim)[None, :]
        q_v = tl.load(q + row[:, None] * D + offs_v[None, :], mask=mask_v, other=0.0)
    offs_r = v_dim + tl.arange(0, BDR)
    mask_r = offs_r < D
    q_r = tl.load(q + row[:, None] * D + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)

    # Query t of this row sees cache rows 0 .. cache_len + t; the program's queries together see
    # [0, end), never past the capacity C (a row whose cache_len + T overflows reads no further).
    cache_len = tl.load(lengths + i_b).to(tl.int32)
    last = cache_len + t
    end = tl.minimum(cache_len + tl.minimum(t0 + BLOCK_T, T), C)
    # The row's own visible rows are split evenly among the splits, at least split_rows each: a short
    # row leaves the later splits empty (they store only lse = -inf). (Rounding split_len to whole
    # blocks lets Triton infer aligned rows, and ptxas then spills the half-precision tiles.)
    split_len = tl.maximum(tl.cdiv(end, n_splits), split_rows)
    lo = i_split * split_len
    hi = tl.minimum(lo + split_len, end)
    out_row = i_split * n_rows + row
    for i_slice in tl.static_range(V_SLICES):
        offs_o = i_slice * BDO + tl.arange(0, BDO)  # the value columns of this pass
        mask_o = offs_o < v_dim
        m_i = tl.full([BLOCK_T * BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_T * BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_T * BLOCK_H, BDO], dtype=tl.float32)
        for s0 in range(lo, hi, BLOCK_S):
            cols = s0 + tl.arange(0, BLOCK_S)
            mask_s = cols < hi
            kv_row = (i_b * C + cols).to(tl.int64) * D
            # Cache rows in q's dtype: the AOT plugin gets kv in its own dtype (latent_mla casts it first).
            kv_o = tl.load(kv + kv_row[:, None] + offs_o[None, :], mask=mask_s[:, None] & mask_o[None, :],
                           other=0.0).to(q.dtype.element_ty)
            kv_r = tl.load(kv + kv_row[:, None] + offs_r[None, :], mask=mask_s[:, None] & mask_r[None, :],
                           other=0.0).to(q.dtype.element_ty)
            scores = tl.dot(q_r, tl.trans(kv_r), input_precision="ieee")
            if V_SLICES == 1:
                scores += tl.dot(q_v, tl.trans(kv_o), input_precision="ieee")
            else:
                for c0 in range(0, BDV, BDO):  # a runtime loop, so that its slices share one buffer
                    offs_c = c0 + tl.arange(0, BDO)
                    mask_c = offs_c < v_dim
                    q_c = tl.load(q + row[:, None] * D + offs_c[None, :],
                                  mask=mask_m[:, None] & mask_c[None, :], other=0.0)
                    kv_c = tl.load(kv + kv_row[:, None] + offs_c[None, :],
                                   mask=mask_s[:, None] & mask_c[None, :], other=0.0).to(q.dtype.element_ty)
                    scores += tl.dot(q_c, tl.trans(kv_c), input_precision="ieee")
            visible = mask_s[None, :] & (cols[None, :] <= last[:, None])
            scores = tl.where(visible, scores * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # A row that has seen no visible key keeps m = -inf: shift it by 0 so exp gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_shift[:, None])
            alpha = tl.exp(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv_o.dtype), kv_o, input_precision="ieee")
            m_i = m_new

        # A query with no visible key in this split writes lse = -inf (weight 0 in the combine) and, in a
        # split that has rows at all, zeros; an empty split skips the store, which the combine never reads.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o_tile = (acc / l_safe[:, None]).to(o.dtype.element_ty)
        tl.store(o + out_row[:, None] * v_dim + offs_o[None, :], o_tile,
                 mask=mask_m[:, None] & mask_o[None, :] & (lo < hi))
    if lse is not None:  # None (a constexpr) for a single split that needs no combine: the AOT plugin
        tl.store(lse + out_row, m_i + tl.log(l_safe), mask=mask_m)


@triton.jit
def _mla_combine_kernel(o_part, lse, o, n_rows, v_dim, n_splits,
                        BLOCK_R: tl.constexpr, BDV: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_v = tl.arange(0, BDV)
    mask_r = rows < n_rows
    mask = mask_r[:, None] & (offs_v < v_dim)[None, :]
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BDV], dtype=tl.float32)
    for sp in range(n_splits):
        # Rows past n_rows read lse = 0 (not -inf) so that they stay finite.
        lse_s = tl.load(lse + sp * n_rows + rows, mask=mask_r, other=0.0)
        # A part with lse = -inf has weight 0 and may never have been written: it is not read.
        part = tl.load(o_part + (sp * n_rows + rows)[:, None] * v_dim + offs_v[None, :],
                       mask=mask & (lse_s > float("-inf"))[:, None], other=0.0)
        m_new = tl.maximum(m, lse_s)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_shift)
        w = tl.exp(lse_s - m_shift)
        acc = acc * alpha[:, None] + w[:, None] * part
        l_sum = l_sum * alpha + w
        m = m_new
    tl.store(o + rows[:, None] * v_dim + offs_v[None, :], (acc / l_sum[:, None]).to(o.dtype.element_ty),
             mask=mask)


def block_dims(D: int, v_dim: int) -> tuple[int, int]:
    """(value block, rope block) for head dim D and value width v_dim, one of BLOCK_DIMS."""
    dims = (max(16, triton.next_power_of_2(v_dim)), max(16, triton.next_power_of_2(D - v_dim)))
    if dims not in BLOCK_DIMS:
        raise ValueError(f"latent_mla: D={D}, v_dim={v_dim} needs blocks {dims}; the kernels are "
                         f"built for {BLOCK_DIMS}")
    return dims


def latent_mla(q: Tensor, kv: Tensor, cache_lengths: Tensor, v_dim: int, scale: float,
               out: Tensor | None = None) -> Tensor:
    """o [B, T, H, v_dim] in q's dtype (written into `out` when given): split-KV decode for
    T <= DECODE_MAX_T, else prefill. kv [B, 1, C, D] is the whole cache, the T new rows already at
    cache_lengths[b] ..; a row reads only its own cache_lengths[b] + T rows."""
    B, T, H, D = q.shape
    if kv.dim() != 4 or kv.shape[1] != 1 or kv.shape[0] != B or kv.shape[3] != D:
        raise ValueError(f"latent_mla: kv {list(kv.shape)} is not [{B}, 1, capacity, {D}] "
                         f"for q {list(q.shape)}")
    if cache_lengths.shape != (B,):
        raise ValueError(f"latent_mla: cache_lengths {list(cache_lengths.shape)} is not [{B}]")
    C = kv.shape[2]
    bdv, bdr = block_dims(D, v_dim)
    q = q.contiguous()
    # A no-op for the exports (cache and q share the model dtype); a cache of another dtype is copied
    # whole here, which keeps the compiled variants one per dtype.
    kv = kv.to(q.dtype).contiguous()
    lengths = cache_lengths.to(torch.int64).contiguous()
    n_rows = B * T * H
    o = q.new_empty(B, T, H, v_dim) if out is None else out
    tiles = DECODE if T <= DECODE_MAX_T else PREFILL_FP32 if q.dtype == torch.float32 else PREFILL
    # The split count is fixed by the capacity (the lengths stay on the device); each row divides
    # its own visible rows among them (see the kernel).
    n_splits = min(MAX_SPLITS, triton.cdiv(C, SPLIT_ROWS)) if tiles is DECODE else 1
    lse = q.new_empty(n_splits, n_rows, dtype=torch.float32)
    part = o if n_splits == 1 else q.new_empty(n_splits, n_rows, v_dim, dtype=torch.float32)
    grid = (B * triton.cdiv(T, tiles.block_t), triton.cdiv(H, tiles.block_h), n_splits)
    _mla_attn_kernel[grid](q, kv, lengths, part, lse, T, C, H, D, v_dim, n_rows, SPLIT_ROWS, scale,
                           BLOCK_T=tiles.block_t, BLOCK_H=tiles.block_h, BLOCK_S=tiles.block_s,
                           BDV=bdv, BDR=bdr, V_SLICES=1, num_warps=tiles.num_warps)
    if n_splits > 1:
        _mla_combine_kernel[(triton.cdiv(n_rows, COMBINE_BLOCK_R),)](
            part, lse, o, n_rows, v_dim, n_splits, BLOCK_R=COMBINE_BLOCK_R, BDV=bdv,
            num_warps=COMBINE_WARPS)
    return o


def kernel_variants() -> list[KernelVariant]:
    """Every (kernel, dtype, block) combination `latent_mla` can pick. The attention kernel
    writes either the final output (q's dtype) or float32 partials for the combine."""
    variants = []
    for dtype in DTYPES:
        for bdv, bdr in BLOCK_DIMS:
            prefill = PREFILL_FP32 if dtype == "fp32" else PREFILL
            for mode, tiles in (("decode", DECODE), ("prefill", prefill)):
                out_types = (dtype, "fp32") if mode == "decode" and dtype != "fp32" else (dtype,)
                for out in out_types:
                    signature = {"q": pointer(dtype), "kv": pointer(dtype), "lengths": "*i64",
                                 "o": pointer(out), "lse": "*fp32", "T": "i32", "C": "i32", "H": "i32",
                                 "D": "i32", "v_dim": "i32", "n_rows": "i32", "split_rows": "i32",
                                 "scale": "fp32"}
                    constexprs = {"BLOCK_T": tiles.block_t, "BLOCK_H": tiles.block_h,
                                  "BLOCK_S": tiles.block_s, "BDV": bdv, "BDR": bdr, "V_SLICES": 1}
                    signature.update(dict.fromkeys(constexprs, "constexpr"))
                    variants.append(KernelVariant(f"mla_{mode}_{dtype}_o{out}_v{bdv}_r{bdr}",
                                                  _mla_attn_kernel, signature, constexprs,
                                                  tiles.num_warps))
            signature = {"o_part": "*fp32", "lse": "*fp32", "o": pointer(dtype), "n_rows": "i32",
                         "v_dim": "i32", "n_splits": "i32", "BLOCK_R": "constexpr", "BDV": "constexpr"}
            variants.append(KernelVariant(f"mla_combine_{dtype}_v{bdv}", _mla_combine_kernel, signature,
                                          {"BLOCK_R": COMBINE_BLOCK_R, "BDV": bdv}, COMBINE_WARPS))
    return variants
