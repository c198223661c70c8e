"""The latent-MLA Triton kernels, and the AOT plugin's wrapper of them, against
`torch.ops.k3.latent_mla` (run in float64 on the same inputs). bfloat16 is not tested: the
interpreter's bf16 arithmetic is silently wrong."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
import k3plugins
from k3plugins import mla
from k3plugins.trt_aot import latent_mla_aot_kernel, latent_mla_aot_launch

# float16: q and kv are rounded before both sides see them; the kernel also rounds the softmax
# weights to float16 for the value product and rounds o to float16, each relative 2^-11 (5e-4)
# per element, so 2e-3 leaves room for their sum.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


def check(B: int, T: int, H: int, S: int, D: int, v_dim: int, dtype: torch.dtype,
          kv_dtype: torch.dtype | None = None,
          run: Callable[[Tensor, Tensor, int, float], Tensor] = k3plugins.latent_mla) -> None:
    gen = torch.Generator().manual_seed(B * 1000 + T * 100 + H + S + D)
    q = torch.randn(B, T, H, D, generator=gen).to(dtype)
    kv = torch.randn(B, S, D, generator=gen).to(kv_dtype or dtype)
    scale = D**-0.5
    o = run(q, kv, v_dim, scale)
    # Both kernels compute with the cache in q's dtype.
    o_ref = torch.ops.k3.latent_mla(q.double(), kv.to(dtype).double(), v_dim, scale)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert ((o.double() - o_ref).norm() / o_ref.norm()).item() < TOLERANCES[dtype]


# (B, T, H, S, D, v_dim): the tiny, small and published latent widths; S >> T; H not a multiple
# of the head block; T = 4 decode is causal within the step.
@pytest.mark.parametrize("shape", [(2, 1, 3, 1000, 48, 32), (1, 1, 8, 700, 160, 128),
                                   (1, 1, 20, 300, 576, 512), (2, 4, 2, 600, 48, 32),
                                   (1, 1, 2, 100, 48, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check(*shape, dtype)


@pytest.mark.parametrize("shape", [(1, 40, 3, 40, 48, 32), (2, 37, 2, 100, 48, 32),
                                   (1, 20, 4, 20, 160, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check(*shape, dtype)


def test_decode_split_without_visible_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """32-row splits with T = 16: the last split lies wholly beyond the early queries' horizon."""
    monkeypatch.setattr(mla, "SPLIT_ROWS", 32)
    check(1, 16, 2, 100, 48, 32, torch.float32)


def aot_latent_mla(q: Tensor, kv: Tensor, v_dim: int, scale: float) -> Tensor:
    """The AOT plugin's kernel, launched as TensorRT would: inputs, int32 scalars, outputs."""
    B, T, H, D = q.shape
    dtype, kv_dtype = (str(x.dtype).removeprefix("torch.") for x in (q, kv))
    variant = latent_mla_aot_kernel(dtype, kv_dtype, D, v_dim, scale)
    grid, scalars = latent_mla_aot_launch(q.shape, kv.shape)
    o = q.new_empty(B, T, H, v_dim)
    variant.fn[grid](q, kv, *scalars, o, **variant.constexprs, num_warps=variant.num_warps)
    return o


# Decode (T = 1, S >> T) and prefill with a partial token block; the cache also in float32 under fp16.
@pytest.mark.parametrize("shape", [(2, 1, 3, 100, 48, 32), (1, 20, 2, 40, 48, 32)])
@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.float32, torch.float32),
                                                 (torch.float16, torch.float16),
                                                 (torch.float16, torch.float32)])
def test_aot_kernel(shape: tuple[int, ...], dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    check(*shape, dtype, kv_dtype, run=aot_latent_mla)
