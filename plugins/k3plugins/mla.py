"""Triton kernels for absorbed latent attention (the contract of `torch.ops.k3.latent_mla`).

q [B, T, H, D] attends to the shared latent cache kv [B, 1, C, D] of fixed capacity C, whose rows
cache_lengths[b] .. cache_lengths[b] + T - 1 hold this call's T new tokens: query t of row b sees
rows 0 .. cache_lengths[b] + t and no further, so each row reads only its own length (a padded query
still sees a valid prefix). The values are kv[..., :v_dim]. Every query head shares the one key
head, so a program takes a tile of (token, head) rows and loads each cache block once for all of
them. D is split into the value part [0, v_dim) and the rest [v_dim, D) (the rope slot), each padded
to a power of two with masks, so D = 576 = 512 + 64 and the tiny model's 48 = 32 + 16 need no padding
in memory.

Each row's visible cache is split among programs where B x T x head blocks alone would leave SMs idle
(`split_count`, flash-decoding; FlashMLA's shape: a block of latent rows loaded once for all the heads of
the program and multiplied on tensor cores), and a second kernel combines the splits' float32 partial
outputs by their log-sum-exp; a prefill's many token blocks take one split and write o directly.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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
    num_stages: int = 2


# Decode: a program's 16 product rows are 16 heads of one token (12 heads a rank fill 12, 96 heads take
# 6 programs), so each block of cache rows is loaded once (cp.async, two stages) and multiplied on tensor
# cores (mma.sync) for all of them. At the published widths in half precision: 158-176 registers, 37,376 B of
# shared memory (within the 48 KB a launch gets: three stages take 55,808 B), no spills, sm_90a and sm_100a.
DECODE = _Tiles(block_t=1, block_h=16, block_s=16, num_warps=4)
# More heads than one block (96 unsplit: 6 programs a row and split, each running the whole loop for a cache
# block their loads share), in half precision: the same tile on 2 warps, each warp 8 cache rows of the
# scores and 256 value columns, where 4 warps split 16 cache rows four ways and so compute each score
# twice. 0.058 SASS a FLOP in the loop against 0.085 (tools/kernel_estimate.py), 255 registers, no spills;
# at 12 heads 4 warps stay, since a batch-1 row's few programs (one a SM) issue from 4 warps, not 2. A
# 64-head tile on wgmma (FlashMLA's) needs q's 64 x 576 block in shared memory, 73,728 B, over the 48 KB an
# AOT launch gets.
DECODE_MANY_HEADS = DECODE._replace(num_warps=2)
# Float32 (any head count) on 8 warps: at 4 its FMA products spill at the published width.
DECODE_FLOAT32 = DECODE._replace(num_warps=8)
# Prefill (the JIT plugin, T > DECODE_MAX_T): 16 tokens of one head, 8 warps in every dtype (16 warps spill
# float32 at the published width with two stages).
PREFILL = _Tiles(block_t=16, block_h=1, block_s=16, num_warps=8)
DECODE_MAX_T = 16
# Each split takes at least SPLIT_ROWS of a row's visible cache rows. The split count is chosen per shape
# (`split_count`): at most SPLIT_PROGRAMS programs, two on each of an H100's 132 SMs (3-4 fit a SM by
# registers, so every SM keeps at least two blocks of cache rows in flight).
SPLIT_ROWS = 256
SPLIT_PROGRAMS = 2 * 132
# The combine: one program per (query, head) row and COMBINE_BLOCK_V value columns, COMBINE_SPLITS splits
# at a time, so that a batch-1 decode's few rows still spread over the SMs.
COMBINE_BLOCK_V = 64
COMBINE_SPLITS = 16
COMBINE_WARPS = 4
# (value block, rope block) of the presets: v_dim 32 / 128 / 512 with rope 16 / 32 / 64.
BLOCK_DIMS = ((32, 16), (128, 32), (512, 64))


@triton.jit
def _attend_block(q, kv_row0, row, mask_m, q_v, q_r, offs_o, mask_o, offs_r, mask_r, s0, hi, last, scale, m_i,
                  l_i, acc, D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BDV: tl.constexpr,
                  BDO: tl.constexpr, V_SLICES: tl.constexpr, MASKED: tl.constexpr):
    # One block of BLOCK_S cache rows from s0 for the program's rows: the online softmax's running max m_i,
    # sum l_i and output acc updated. MASKED: rows from hi on and those past a query's own (`last`) are
    # not read and weigh 0; else every row of the block is visible to every query (no row masks).
    cols = s0 + tl.arange(0, BLOCK_S)
    kv_rows = kv_row0 + cols[:, None] * D
    mask_s = cols < hi
    if MASKED:
        mask_ko, mask_kr = mask_s[:, None] & mask_o[None, :], mask_s[:, None] & mask_r[None, :]
    else:
        mask_ko, mask_kr = mask_o[None, :], mask_r[None, :]
    # Cache rows in q's dtype: the AOT plugin gets kv in its own dtype (latent_mla casts it first).
    kv_o = tl.load(kv_rows + offs_o[None, :], mask=mask_ko, other=0.0).to(q.dtype.element_ty)
    kv_r = tl.load(kv_rows + offs_r[None, :], mask=mask_kr, other=0.0).to(q.dtype.element_ty)
    scores = tl.dot(q_r, tl.trans(kv_r), input_precision="ieee")
    if V_SLICES == 1:
        scores = tl.dot(q_v, tl.trans(kv_o), scores, input_precision="ieee")
    else:
        for c0 in range(0, BDV, BDO):  # a runtime loop, so that its slices share one buffer
            offs_c = c0 + tl.arange(0, BDO)
            mask_c = offs_c < V_DIM
            q_c = tl.load(q + row[:, None] * D + offs_c[None, :], mask=mask_m[:, None] & mask_c[None, :],
                          other=0.0)
            mask_kc = mask_s[:, None] & mask_c[None, :] if MASKED else mask_c[None, :]
            kv_c = tl.load(kv_rows + offs_c[None, :], mask=mask_kc, other=0.0).to(q.dtype.element_ty)
            scores = tl.dot(q_c, tl.trans(kv_c), scores, input_precision="ieee")
    if MASKED:
        visible = mask_s[None, :] & (cols[None, :] <= last[:, None])
        scores = tl.where(visible, scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row that has seen no visible key keeps m = -inf: shift it by 0 so exp gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        scores = scores * scale
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_shift = m_new  # finite: every row of the block is visible
    p = tl.exp(scores - m_shift[:, None])
    alpha = tl.exp(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(kv_o.dtype), kv_o, acc * alpha[:, None], input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _mla_attn_kernel(q, kv, lengths, o, lse, T, C, H, split_rows, scale, D: tl.constexpr,
                     V_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                     BDV: tl.constexpr, BDR: tl.constexpr, V_SLICES: tl.constexpr):
    # Program (row b and block of BLOCK_T tokens, block of BLOCK_H heads, split): its BLOCK_T x BLOCK_H
    # (token, head) rows are the M side of every product, against one block of the row's cache a step.
    # The grid's third axis is the split count; o (and lse) hold each split's results one after another.
    n_tblocks = tl.cdiv(T, BLOCK_T)
    i_b = tl.program_id(0) // n_tblocks
    t0 = tl.program_id(0) % n_tblocks * BLOCK_T
    i_split, n_splits = tl.program_id(2), tl.num_programs(2)
    n_rows = tl.num_programs(0) // n_tblocks * T * H
    offs_m = tl.arange(0, BLOCK_T * BLOCK_H)
    t = t0 + offs_m // BLOCK_H
    h = tl.program_id(1) * BLOCK_H + offs_m % BLOCK_H
    mask_m = (t < T) & (h < H)
    row = (i_b * T + t).to(tl.int64) * H + h
    out_row = i_split * n_rows + row

    # Query t of this row sees cache rows 0 .. cache_len + t; the program's queries together see
    # [0, end), never past the capacity C (a row whose cache_len + T overflows reads no further).
    cache_len = tl.load(lengths + i_b).to(tl.int32)
    last = cache_len + t
    end = tl.minimum(cache_len + tl.minimum(t0 + BLOCK_T, T), C)
    # The row's own visible rows are split evenly among the splits, at least split_rows each: a short
    # row leaves the later splits empty, which store only lse = -inf (weight 0: the combine reads nothing
    # else of them) and load nothing.
    split_len = tl.maximum(tl.cdiv(end, n_splits), split_rows)
    lo = i_split * split_len
    hi = tl.minimum(lo + split_len, end)
    if lo >= hi:
        if lse is not None:
            tl.store(lse + out_row, tl.full([BLOCK_T * BLOCK_H], float("-inf"), tl.float32), mask=mask_m)
        return

    # V_SLICES > 1 (the AOT float32 kernel, whose whole float32 value block needs more than the 48 KB of
    # shared memory a launch gets): the value columns are taken BDO at a time, one pass over the cache each,
    # the scores formed a slice of columns at a time.
    BDO: tl.constexpr = BDV // V_SLICES
    q_v = None  # V_SLICES > 1 loads it a slice at a time
    if V_SLICES == 1:
        offs_v = tl.arange(0, BDV)
        mask_v = mask_m[:, None] & (offs_v < V_DIM)[None, :]
        q_v = tl.load(q + row[:, None] * D + offs_v[None, :], mask=mask_v, other=0.0)
    offs_r = V_DIM + tl.arange(0, BDR)
    mask_r = offs_r < D
    q_r = tl.load(q + row[:, None] * D + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    kv_row0 = kv + i_b.to(tl.int64) * C * D
    # A decode tile's one query sees every row of [lo, hi): in half precision its whole blocks take no row
    # masks (`_attend_block`'s MASKED: about a sixth of the loop's instructions), only the last partial
    # one. Prefill tiles (a causal band) and float32 mask every block: two loops made ptxas spill there.
    UNMASKED: tl.constexpr = BLOCK_T == 1 and q.dtype.element_ty != tl.float32
    unmasked_end = lo + (hi - lo) // BLOCK_S * BLOCK_S if UNMASKED else lo
    for i_slice in tl.static_range(V_SLICES):
        offs_o = i_slice * BDO + tl.arange(0, BDO)  # the value columns of this pass
        mask_o = offs_o < V_DIM
        m_i = tl.full([BLOCK_T * BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_T * BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_T * BLOCK_H, BDO], dtype=tl.float32)
        if UNMASKED:
            for s0 in range(lo, unmasked_end, BLOCK_S):
                m_i, l_i, acc = _attend_block(q, kv_row0, row, mask_m, q_v, q_r, offs_o, mask_o, offs_r,
                                              mask_r, s0, hi, last, scale, m_i, l_i, acc, D, V_DIM, BLOCK_S,
                                              BDV, BDO, V_SLICES, False)
        for s0 in range(unmasked_end, hi, BLOCK_S):
            m_i, l_i, acc = _attend_block(q, kv_row0, row, mask_m, q_v, q_r, offs_o, mask_o, offs_r, mask_r,
                                          s0, hi, last, scale, m_i, l_i, acc, D, V_DIM, BLOCK_S, BDV, BDO,
                                          V_SLICES, True)

        # A query with no visible key in this split writes lse = -inf (weight 0 in the combine) and zeros.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o_tile = (acc / l_safe[:, None]).to(o.dtype.element_ty)
        tl.store(o + out_row[:, None] * V_DIM + offs_o[None, :], o_tile,
                 mask=mask_m[:, None] & mask_o[None, :])
    if lse is not None:  # None (a constexpr) for a single split that needs no combine
        tl.store(lse + out_row, m_i + tl.log(l_safe), mask=mask_m)


@triton.jit
def _mla_combine_kernel(o_part, lse, o, n_rows, n_splits, V_DIM: tl.constexpr, BLOCK_V: tl.constexpr,
                        BLOCK_SPLITS: tl.constexpr):
    # Program (one query and head row, BLOCK_V value columns): the splits' partial outputs weighted by
    # exp(lse - max lse), BLOCK_SPLITS splits a step; the largest lse first, so that no weight overflows.
    # A query's splits with no row it sees (lse = -inf) are its last ones: split s starts at s x the split's
    # length, and a query that sees no row from there sees none further on. So the weighted sum stops at the
    # first of them (a short cache at batch 1: 16 of 264 splits hold rows at 4K).
    r = tl.program_id(0).to(tl.int64)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V_DIM
    offs_s = tl.arange(0, BLOCK_SPLITS)
    m = tl.full([BLOCK_SPLITS], float("-inf"), dtype=tl.float32)
    live = tl.zeros([BLOCK_SPLITS], dtype=tl.int32)
    for s0 in range(0, n_splits, BLOCK_SPLITS):
        lse_s = tl.load(lse + (s0 + offs_s) * n_rows + r, mask=s0 + offs_s < n_splits, other=float("-inf"))
        m = tl.maximum(m, lse_s)
        live += (lse_s > float("-inf")).to(tl.int32)
    m_max = tl.max(m, axis=0)  # finite: every query sees at least its own row
    n_live = tl.sum(live, axis=0)
    l_sum = tl.zeros([BLOCK_SPLITS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_SPLITS, BLOCK_V], dtype=tl.float32)
    for s0 in range(0, n_live, BLOCK_SPLITS):
        splits = s0 + offs_s
        lse_s = tl.load(lse + splits * n_rows + r, mask=splits < n_live, other=float("-inf"))
        # A part with lse = -inf has weight 0 and may never have been written: it is not read.
        part = tl.load(o_part + (splits * n_rows + r)[:, None] * V_DIM + offs_v[None, :],
                       mask=(lse_s > float("-inf"))[:, None] & mask_v[None, :], other=0.0)
        w = tl.exp(lse_s - m_max)
        l_sum += w
        acc += w[:, None] * part
    out = tl.sum(acc, axis=0) / tl.sum(l_sum, axis=0)
    tl.store(o + r * V_DIM + offs_v, out.to(o.dtype.element_ty), mask=mask_v)


def block_dims(D: int, v_dim: int) -> tuple[int, int]:
    """(value block, rope block) for head dim D and value width v_dim, one of BLOCK_DIMS."""
    dims = (max(16, triton.next_power_of_2(v_dim)), max(16, triton.next_power_of_2(D - v_dim)))
    if dims not in BLOCK_DIMS:
        raise ValueError(f"latent_mla: D={D}, v_dim={v_dim} needs blocks {dims}; the kernels are "
                         f"built for {BLOCK_DIMS}")
    return dims


def decode_tiles(H: int, half: bool) -> _Tiles:
    """The decode tile for H query heads, q in half precision (`half`) or float32."""
    if not half:
        return DECODE_FLOAT32
    return DECODE_MANY_HEADS if DECODE.block_h < H else DECODE  # more heads than one block


def split_count(B: Any, T: Any, H: Any) -> Any:
    """How many splits each row's visible cache is divided into for q [B, T, H, D]: as many as keep the
    decode tile's programs (B x T x head blocks of DECODE) times the splits at most SPLIT_PROGRAMS, at
    least 1 (prefill): never over, since a third program on some SMs would take half as long again as the
    two on the rest (96 heads at batch 8: 6 splits gave 288 programs). The dims may be ints or a builder's
    shape expressions: only +, * and // with the dimension on the left."""
    bt, bh = DECODE.block_t, DECODE.block_h
    units = B * ((T + (bt - 1)) // bt) * ((H + (bh - 1)) // bh)
    n = (units * 0 + SPLIT_PROGRAMS) // units  # floor(SPLIT_PROGRAMS / units), the constant as an expression
    return (n * (n + 1) + 1) // (n + 1)  # max(n, 1): n for n >= 1, 1 for n = 0


def _check_inputs(q: Tensor, kv: Tensor, cache_lengths: Tensor) -> None:
    B, _, _, D = q.shape
    if kv.dim() != 4 or kv.shape[1] != 1 or kv.shape[0] != B or kv.shape[3] != D:
        raise ValueError(f"latent_mla: kv {list(kv.shape)} is not [{B}, 1, capacity, {D}] "
                         f"for q {list(q.shape)}")
    if cache_lengths.shape != (B,):
        raise ValueError(f"latent_mla: cache_lengths {list(cache_lengths.shape)} is not [{B}]")


def latent_mla_splits(q: Tensor, kv: Tensor, cache_lengths: Tensor, v_dim: int, scale: float, o_part: Tensor,
                      lse: Tensor | None) -> None:
    """Each split's softmax-normalised output into o_part [S, B, T, H, v_dim] (float32) and its
    log-sum-exp into lse [S, B, T, H] (float32, -inf where a query saw no row of the split): split s of
    row b covers its own visible rows s * n .. (s + 1) * n - 1, n = max(ceil(rows / S), SPLIT_ROWS).
    With lse None, o_part is the one split's output in q's dtype ([1, B, T, H, v_dim] or [B, T, H, v_dim]).
    Decode tiles for T <= DECODE_MAX_T, else prefill tiles."""
    _check_inputs(q, kv, cache_lengths)
    B, T, H, D = q.shape
    bdv, bdr = block_dims(D, v_dim)
    q = q.contiguous()
    # A no-op for the exports (cache and q share the model dtype); a cache of another dtype is copied
    # whole here, which keeps the compiled variants one per dtype.
    kv = kv.to(q.dtype).contiguous()
    lengths = cache_lengths.to(torch.int64).contiguous()
    n_splits = 1 if lse is None else o_part.shape[0]
    tiles = decode_tiles(H, q.dtype != torch.float32) if T <= DECODE_MAX_T else PREFILL
    grid = (B * triton.cdiv(T, tiles.block_t), triton.cdiv(H, tiles.block_h), n_splits)
    _mla_attn_kernel[grid](q, kv, lengths, o_part, lse, T, kv.shape[2], H, SPLIT_ROWS, scale, D=D,
                           V_DIM=v_dim, BLOCK_T=tiles.block_t, BLOCK_H=tiles.block_h, BLOCK_S=tiles.block_s,
                           BDV=bdv, BDR=bdr, V_SLICES=1, num_warps=tiles.num_warps,
                           num_stages=tiles.num_stages)


def latent_mla_combine(o_part: Tensor, lse: Tensor, out: Tensor) -> None:
    """out [B, T, H, v_dim] (its dtype) from the splits' o_part [S, B, T, H, v_dim] and lse [S, B, T, H]."""
    n_splits, v_dim = o_part.shape[0], o_part.shape[-1]
    n_rows = out.numel() // v_dim
    grid = (n_rows, triton.cdiv(v_dim, COMBINE_BLOCK_V))
    _mla_combine_kernel[grid](o_part, lse, out, n_rows, n_splits, V_DIM=v_dim, BLOCK_V=COMBINE_BLOCK_V,
                              BLOCK_SPLITS=COMBINE_SPLITS, num_warps=COMBINE_WARPS)


def latent_mla(q: Tensor, kv: Tensor, cache_lengths: Tensor, v_dim: int, scale: float,
               out: Tensor | None = None) -> Tensor:
    """o [B, T, H, v_dim] in q's dtype (written into `out` when given): the splits `split_count` chooses,
    then their combine (none for one split). kv [B, 1, C, D] is the whole cache, the T new rows already at
    cache_lengths[b] ..; a row reads only its own cache_lengths[b] + T rows."""
    B, T, H, _ = q.shape
    o = q.new_empty(B, T, H, v_dim) if out is None else out
    n_splits = split_count(B, T, H)
    if n_splits == 1:
        latent_mla_splits(q, kv, cache_lengths, v_dim, scale, o, None)
        return o
    o_part = q.new_empty(n_splits, B, T, H, v_dim, dtype=torch.float32)
    lse = q.new_empty(n_splits, B, T, H, dtype=torch.float32)
    latent_mla_splits(q, kv, cache_lengths, v_dim, scale, o_part, lse)
    latent_mla_combine(o_part, lse, o)
    return o


def _attention_variant(name: str, dtype: str, splits: bool, D: int, v_dim: int,
                       tiles: _Tiles) -> KernelVariant:
    """The attention kernel as `latent_mla_splits` launches it, q and the cache in `dtype`: float32 partials
    and their lse (`splits`), or one split's output in `dtype` and no lse."""
    bdv, bdr = block_dims(D, v_dim)
    signature = {"q": pointer(dtype), "kv": pointer(dtype), "lengths": "*i64",
                 "o": pointer("fp32" if splits else dtype), "lse": "*fp32" if splits else "constexpr",
                 "T": "i32", "C": "i32", "H": "i32", "split_rows": "i32", "scale": "fp32"}
    constexprs = {**({} if splits else {"lse": None}), "D": D, "V_DIM": v_dim, "BLOCK_T": tiles.block_t,
                  "BLOCK_H": tiles.block_h, "BLOCK_S": tiles.block_s, "BDV": bdv, "BDR": bdr, "V_SLICES": 1}
    signature.update({k: "constexpr" for k in constexprs})
    return KernelVariant(name, _mla_attn_kernel, signature, constexprs, tiles.num_warps, tiles.num_stages)


def combine_variant(name: str, dtype: str, v_dim: int) -> KernelVariant:
    """The combine kernel writing o in `dtype` for value width v_dim."""
    signature = {"o_part": "*fp32", "lse": "*fp32", "o": pointer(dtype), "n_rows": "i32", "n_splits": "i32",
                 "V_DIM": "constexpr", "BLOCK_V": "constexpr", "BLOCK_SPLITS": "constexpr"}
    constexprs = {"V_DIM": v_dim, "BLOCK_V": COMBINE_BLOCK_V, "BLOCK_SPLITS": COMBINE_SPLITS}
    return KernelVariant(name, _mla_combine_kernel, signature, constexprs, COMBINE_WARPS)


def kernel_variants() -> list[KernelVariant]:
    """Every (kernel, dtype, width) combination `latent_mla` can pick: the attention kernel writing the
    output (q's dtype, one split) or float32 partials and their lse, and the combine."""
    variants = []
    for dtype in DTYPES:
        for bdv, bdr in BLOCK_DIMS:
            D = bdv + bdr
            decode = [("decode", DECODE_FLOAT32)] if dtype == "fp32" else [
                ("decode", DECODE), ("decode_many_heads", DECODE_MANY_HEADS)]
            for mode, tiles in [*decode, ("prefill", PREFILL)]:
                for splits in (False, True):
                    name = f"mla_{mode}_{dtype}_{'splits' if splits else 'o'}_v{bdv}_r{bdr}"
                    variants.append(_attention_variant(name, dtype, splits, D, bdv, tiles))
            variants.append(combine_variant(f"mla_combine_{dtype}_v{bdv}", dtype, bdv))
    return variants
