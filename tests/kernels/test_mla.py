"""The latent-MLA Triton kernels, and the AOT plugin's wrapper of them, against a float64 reference
of the op contract written here (and `torch.ops.k3.latent_mla` where it takes cache lengths). Rows of
the cache past each sequence's cache_lengths + T are NaN: a kernel that read them would return NaN.
bfloat16 is not tested: the interpreter's bf16 arithmetic is silently wrong."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from reference import rel_error
from torch import Tensor

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
import k3plugins
from k3plugins import mla, trt_aot
from k3plugins.trt_aot import (
    latent_mla_aot_kernel,
    latent_mla_aot_launch,
    latent_mla_combine_aot_kernel,
    latent_mla_combine_aot_launch,
)

# float16: q and kv are rounded before both sides see them; the kernel also rounds the softmax
# weights to float16 for the value product and rounds o to float16, each relative 2^-11 (5e-4)
# per element, so 2e-3 leaves room for their sum.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


GPU_SPLIT_PROGRAMS = mla.SPLIT_PROGRAMS


@pytest.fixture(autouse=True)
def few_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split counts for 8 programs, not a GPU's 264: the interpreter runs every program in turn, and a
    few splits exercise the combine as many do (test_split_count_fills_the_gpu holds the real rule)."""
    monkeypatch.setattr(mla, "SPLIT_PROGRAMS", 8)


def reference(q: Tensor, kv: Tensor, cache_lengths: Tensor, v_dim: int, scale: float) -> Tensor:
    """The contract in float64, one sequence at a time: query t of row b attends to cache rows
    0 .. cache_lengths[b] + t of kv [B, 1, C, D]; values are the first v_dim columns."""
    T = q.shape[1]
    out = []
    for b, length in enumerate(cache_lengths.tolist()):
        keys = kv[b, 0, :length + T].double()
        scores = torch.einsum("thd,sd->hts", q[b].double(), keys) * scale
        visible = torch.arange(length + T)[None, :] <= (length + torch.arange(T))[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out.append(torch.einsum("hts,sv->thv", probs, keys[:, :v_dim]))
    return torch.stack(out)


def eager_takes_lengths() -> bool:
    return len(torch.ops.k3.latent_mla.default._schema.arguments) == 5


def inputs(B: int, T: int, H: int, C: int, D: int, lengths: Sequence[int], dtype: torch.dtype,
           kv_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(B * 1000 + T * 100 + H + C + D + sum(lengths))
    q = torch.randn(B, T, H, D, generator=gen).to(dtype)
    kv = torch.randn(B, 1, C, D, generator=gen).to(kv_dtype or dtype)
    cache_lengths = torch.tensor(lengths, dtype=torch.int64)
    for b, length in enumerate(lengths):
        kv[b, 0, length + T:] = float("nan")  # beyond the row's cache and this call's rows
    return q, kv, cache_lengths


Run = Callable[[Tensor, Tensor, Tensor, int, float], Tensor]


def check(B: int, T: int, H: int, C: int, D: int, v_dim: int, lengths: Sequence[int], dtype: torch.dtype,
          kv_dtype: torch.dtype | None = None, run: Run = k3plugins.latent_mla) -> None:
    q, kv, cache_lengths = inputs(B, T, H, C, D, lengths, dtype, kv_dtype)
    scale = D**-0.5
    o = run(q, kv, cache_lengths, v_dim, scale)
    # Both kernels compute with the cache in q's dtype.
    o_ref = reference(q, kv.to(dtype), cache_lengths, v_dim, scale)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert rel_error(o, o_ref) < TOLERANCES[dtype]
    if eager_takes_lengths():
        # The eager op reads every row up to the longest one's length: no NaN rows for it.
        kv64 = kv.to(dtype).double().nan_to_num(0.0)
        eager = torch.ops.k3.latent_mla(q.double(), kv64, cache_lengths, v_dim, scale)
        assert rel_error(eager, o_ref) < 1e-12


# (B, T, H, C, D, v_dim, cache_lengths): T = 1 decode with different lengths per row, among them an
# empty cache and one that fills the capacity (length + T == C); several splits (C > 256); the
# tiny, small and published latent widths; H not a multiple of the head block; T = 4 decode is
# causal within the step.
DECODE_CASES = [(3, 1, 3, 300, 48, 32, (0, 37, 299)), (3, 1, 3, 1000, 48, 32, (999, 0, 500)),
                (2, 1, 8, 700, 160, 128, (650, 3)), (1, 1, 20, 300, 576, 512, (299,)),
                (2, 4, 2, 600, 48, 32, (0, 596))]


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode(case: tuple, dtype: torch.dtype) -> None:
    check(*case, dtype=dtype)


# Ragged prefill: a fresh sequence next to ones with cached rows, one filling the capacity, a partial
# token block (T = 37, 20).
PREFILL_CASES = [(3, 40, 3, 64, 48, 32, (0, 10, 24)), (2, 37, 2, 100, 48, 32, (63, 5)),
                 (2, 20, 4, 50, 160, 128, (0, 30))]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill(case: tuple, dtype: torch.dtype) -> None:
    check(*case, dtype=dtype)


def test_decode_splits_without_visible_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """32-row splits with T = 16: the early queries see none of the later splits' rows, a short
    row leaves most splits empty, and a row at length 0 is all in the first split."""
    monkeypatch.setattr(mla, "SPLIT_ROWS", 32)
    check(3, 16, 2, 200, 48, 32, (84, 0, 184), torch.float32)


def test_combine_stops_at_a_rows_first_empty_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """20 splits of at least 8 rows: a row at 200 fills 19 (two of the combine's 16-split steps), one at 30
    fills 4 and leaves 16 empty; the combine's weighted sum stops at each row's first empty split."""
    monkeypatch.setattr(mla, "SPLIT_PROGRAMS", 40)
    monkeypatch.setattr(mla, "SPLIT_ROWS", 8)
    assert mla.split_count(2, 1, 3) == 20
    check(2, 1, 3, 220, 48, 32, (200, 30), torch.float32)


def test_writes_into_given_output() -> None:
    q, kv, cache_lengths = inputs(2, 1, 3, 300, 48, (5, 290), torch.float32)
    out = torch.full((2, 1, 3, 32), float("nan"))
    assert k3plugins.latent_mla(q, kv, cache_lengths, 32, 0.1, out=out) is out
    assert rel_error(out, reference(q, kv, cache_lengths, 32, 0.1)) < 1e-5


def test_refuses_a_cache_without_capacity_axis() -> None:
    q = torch.zeros(1, 1, 2, 48)
    with pytest.raises(ValueError, match=r"kv \[1, 10, 48\] is not \[1, 1, capacity, 48\]"):
        k3plugins.latent_mla(q, torch.zeros(1, 10, 48), torch.zeros(1, dtype=torch.int64), 32, 0.1)


def aot_latent_mla(q: Tensor, kv: Tensor, cache_lengths: Tensor, v_dim: int, scale: float) -> Tensor:
    """The single-node AOT plugin's kernel (k3::LatentMLA), launched as TensorRT would: inputs, int32
    scalars, outputs."""
    B, T, H, D = q.shape
    dtype, kv_dtype = (str(x.dtype).removeprefix("torch.") for x in (q, kv))
    variant = latent_mla_aot_kernel(dtype, kv_dtype, D, v_dim, scale, H)
    grid, scalars = latent_mla_aot_launch(q.shape, kv.shape)
    o = q.new_empty(B, T, H, v_dim)
    variant.fn[grid](q, kv, cache_lengths, *scalars, o, **variant.constexprs, num_warps=variant.num_warps)
    return o


def aot_latent_mla_splits(q: Tensor, kv: Tensor, cache_lengths: Tensor, v_dim: int, scale: float) -> Tensor:
    """The two AOT nodes (k3::LatentMLASplits, then k3::LatentMLACombine) launched as TensorRT would, the
    partials a tensor between them of the shape the split node declares."""
    B, T, H, D = q.shape
    dtype, kv_dtype = (str(x.dtype).removeprefix("torch.") for x in (q, kv))
    variant = latent_mla_aot_kernel(dtype, kv_dtype, D, v_dim, scale, H, splits=True)
    grid, scalars = latent_mla_aot_launch(q.shape, kv.shape, splits=True)
    n_splits = grid[2]
    assert n_splits == mla.split_count(B, T, H)
    # NaN where no split writes: the combine must read only what the splits wrote.
    o_part = torch.full((n_splits, B, T, H, v_dim), float("nan"))
    lse = torch.full((n_splits, B, T, H), float("nan"))
    variant.fn[grid](q, kv, cache_lengths, *scalars, o_part, lse, **variant.constexprs,
                     num_warps=variant.num_warps)
    combine = latent_mla_combine_aot_kernel(dtype, v_dim)
    grid, scalars = latent_mla_combine_aot_launch(o_part.shape)
    o = q.new_empty(B, T, H, v_dim)
    combine.fn[grid](q, o_part, lse, *scalars, o, **combine.constexprs, num_warps=combine.num_warps)
    return o


# Decode (T = 1, rows of different lengths) and ragged prefill with a partial token block; the cache
# also in float32 under fp16; the published widths (float32 takes the values in four slices).
@pytest.mark.parametrize("case", [(3, 1, 3, 100, 48, 32, (0, 50, 99)), (2, 20, 2, 40, 48, 32, (0, 20)),
                                  (2, 20, 1, 40, 576, 512, (3, 20))], ids=str)
@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.float32, torch.float32),
                                                 (torch.float16, torch.float16),
                                                 (torch.float16, torch.float32)])
def test_aot_kernel(case: tuple, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    check(*case, dtype=dtype, kv_dtype=kv_dtype, run=aot_latent_mla)


# The split and combine nodes: 12 heads (a rank of 8) at the published widths (D 576, v_dim 512), decode
# with ragged lengths (0, not a multiple of the 16-row block, the capacity filled) and a verify call of
# K + 1 = 5 tokens; 96 heads (unsplit: six head blocks) and a short ragged prefill at the tiny widths (the
# interpreter's time grows with the combine's programs, a (query, head) row x 64 value columns each).
AOT_SPLIT_CASES = [(3, 1, 12, 90, 576, 512, (0, 37, 89)), (1, 5, 12, 70, 576, 512, (41,)),
                   (2, 1, 96, 50, 48, 32, (49, 0)), (2, 20, 2, 40, 48, 32, (3, 20))]


@pytest.mark.parametrize("case", AOT_SPLIT_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_aot_split_and_combine(case: tuple, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trt_aot, "SPLIT_ROWS", 32)  # compiled in: each split takes 32 rows or more
    check(*case, dtype=dtype, run=aot_latent_mla_splits)


def test_split_count_fills_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Splits per shape: B x T x head blocks x splits as near SPLIT_PROGRAMS (264: two a SM on 132) as it
    goes without passing it, at the issue's decode shapes (12 heads a rank: one head block; 96: six), and
    one split where the programs alone pass it (prefill, 96 heads at batch 64)."""
    assert GPU_SPLIT_PROGRAMS == 264
    monkeypatch.setattr(mla, "SPLIT_PROGRAMS", GPU_SPLIT_PROGRAMS)
    assert mla.split_count(1, 1, 12) == 264  # batch 1
    assert mla.split_count(8, 1, 12) == 33  # batch 8: 264 programs
    assert mla.split_count(64, 1, 12) == 4  # batch 64: 256
    assert mla.split_count(8, 1, 96) == 5  # 96 heads: 6 head blocks, 240
    assert mla.split_count(1, 1, 96) == 44  # 264
    assert mla.split_count(64, 1, 96) == 1  # 384 programs unsplit
    assert mla.split_count(8, 5, 12) == 6  # a verify call of 5 tokens: 240
    assert mla.split_count(1, 8192, 12) == 1


def test_many_heads_take_the_two_warp_tile() -> None:
    """96 heads in half precision run the 2-warp decode tile (each score computed once), 12 heads the
    4-warp one, float32 8 warps at any head count; the AOT split kernel follows the node's head count."""
    assert mla.decode_tiles(96, half=True) == mla.DECODE_MANY_HEADS
    assert mla.decode_tiles(12, half=True) == mla.DECODE
    assert mla.decode_tiles(96, half=False) == mla.decode_tiles(12, half=False) == mla.DECODE_FLOAT32
    args = (576, 512, 0.1)
    assert [latent_mla_aot_kernel(dtype, dtype, *args, heads, splits=True).num_warps
            for dtype, heads in (("bfloat16", 96), ("bfloat16", 12), ("float32", 96))] == [2, 4, 8]
