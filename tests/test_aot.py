"""Every Triton kernel variant compiles ahead of time without a GPU, fits in shared memory and does
not spill registers, per the bundled `ptxas -v`: the JIT plugins' variants for sm_90a, and the
kernels full TensorRT's AOT plugins embed (k3plugins.trt_aot), at the published model's widths, for
sm_90a (H100/H200) and sm_100a (B200)."""

from __future__ import annotations

import os
import re

import pytest

import k3plugins
from k3export.config import K3Config
from k3plugins import trt_aot
from k3plugins.aot import MAX_SHARED_BYTES, compile_variant, kernel_stats

# Under the interpreter @triton.jit yields interpreted functions, which do not compile.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="TRITON_INTERPRET is set: run `pytest tests/kernels` separately")


def assert_fits(kernel, target: str) -> None:
    stats = kernel_stats(kernel)
    assert stats.shared_bytes <= MAX_SHARED_BYTES[target], stats
    assert stats.spill_stores == 0 and stats.spill_loads == 0, stats


@pytest.mark.parametrize("variant", k3plugins.kernel_variants(), ids=lambda v: v.name)
def test_variant_compiles_for_sm90(variant: k3plugins.KernelVariant) -> None:
    assert_fits(compile_variant(variant, "sm90"), "sm90")


def published_aot_kernels() -> list[k3plugins.KernelVariant]:
    """The AOT kernels of a kimi-k3 engine (one rank of 8: 112 experts held) in each dtype: KDA,
    LatentMLA, and the routed experts as float tensors and as MXFP4 words."""
    c = K3Config.from_preset("kimi-k3")
    return trt_aot.aot_kernels(c, c.num_experts // 8)


@pytest.mark.parametrize("target", ["sm90", "sm100"])
@pytest.mark.parametrize("variant", published_aot_kernels(), ids=lambda v: v.name)
def test_aot_kernel_compiles_for_datacenter_gpus(variant: k3plugins.KernelVariant, target: str) -> None:
    kernel = compile_variant(variant, target)
    arch = re.search(r"^\.target\s+(\w+)", kernel.asm["ptx"], re.MULTILINE).group(1)
    assert arch == {"sm90": "sm_90a", "sm100": "sm_100a"}[target]
    assert_fits(kernel, target)


def test_routed_experts_aot_parameters_are_inputs_then_output() -> None:
    """TensorRT passes an AOT kernel its input pointers, scalar args (none here: every width is
    compiled in), then output pointers; Triton appends two scratch pointers."""
    variant = trt_aot.routed_experts_aot_kernel("bfloat16", True, 64, 64, 4, 2, 0, 4.0, 25.0)
    ptx = compile_variant(variant, "sm90").asm["ptx"]
    params = re.search(r"\.entry\s+\w+\((.*?)\)", ptx, re.S).group(1)
    # z, experts, weights, six MXFP4 tensors, u, then the scratch pointers.
    assert re.findall(r"\.param\s+\.(u64|u32)", params) == ["u64"] * 10 + ["u64"] * 2
