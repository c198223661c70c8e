"""Every Triton kernel variant compiles ahead of time without a GPU, fits in shared memory and does
not spill registers, per the bundled `ptxas -v`: the JIT plugins' variants for sm_90a, and the
kernels full TensorRT's AOT plugins embed (k3plugins.trt_aot), at the published model's widths, for
sm_90a (H100/H200) and sm_100a (B200)."""

from __future__ import annotations

import os
import re

import pytest
import torch
import triton
import triton.language as tl

import k3plugins
from k3export.config import K3Config
from k3plugins import aot, moe, trt_aot
from k3plugins.aot import MAX_SHARED_BYTES, compile_variant, kernel_stats

# Under the interpreter @triton.jit yields interpreted functions, which do not compile.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="TRITON_INTERPRET is set: run `pytest tests/kernels` separately")


def assert_fits(kernel, target: str) -> None:
    stats = kernel_stats(kernel)
    assert stats.shared_bytes <= MAX_SHARED_BYTES[target], stats
    assert stats.spill_stores == 0 and stats.spill_loads == 0, stats


def assert_no_scratch(kernel) -> None:
    """Triton gives every kernel two trailing scratch pointers (global and profile), which TensorRT's AOT
    launch does not pass: a kernel that uses either (a size above 0) would read a pointer never given."""
    assert (kernel.metadata.global_scratch_size, kernel.metadata.profile_scratch_size) == (0, 0), kernel.name


@pytest.mark.parametrize("variant", k3plugins.kernel_variants(), ids=lambda v: v.name)
def test_variant_compiles_for_sm90(variant: k3plugins.KernelVariant) -> None:
    assert_fits(compile_variant(variant, "sm90"), "sm90")


def published_aot_kernels() -> list[k3plugins.KernelVariant]:
    """The AOT kernels of a kimi-k3 engine (one rank of 8: 112 experts held) in each dtype: KDA (one node and
    two), LatentMLA, and the routed experts as float tensors and as MXFP4 words."""
    c = K3Config.from_preset("kimi-k3")
    return trt_aot.aot_kernels(c, c.num_experts // 8)


@pytest.mark.parametrize("target", ["sm90", "sm100"])
@pytest.mark.parametrize("variant", published_aot_kernels(), ids=lambda v: v.name)
def test_aot_kernel_compiles_for_datacenter_gpus(variant: k3plugins.KernelVariant, target: str) -> None:
    kernel = compile_variant(variant, target)
    arch = re.search(r"^\.target\s+(\w+)", kernel.asm["ptx"], re.MULTILINE).group(1)
    assert arch == {"sm90": "sm_90a", "sm100": "sm_100a"}[target]
    assert_fits(kernel, target)
    assert_no_scratch(kernel)


@triton.jit
def _descriptor_kernel(x, n, BLOCK: tl.constexpr):
    # A tensor descriptor made on the device: Triton keeps it in global scratch.
    desc = tl.make_tensor_descriptor(x, shape=[n], strides=[1], block_shape=[BLOCK])
    desc.store([0], desc.load([0]) + 1)


def test_a_kernel_using_scratch_is_refused() -> None:
    """The scratch check refuses a kernel that uses Triton's global scratch (128 B for a device-side TMA
    descriptor on sm_90a), as a Triton upgrade that starts using scratch in the AOT kernels would be."""
    signature = {"x": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    variant = k3plugins.KernelVariant("descriptor", _descriptor_kernel, signature, {"BLOCK": 64}, num_warps=4)
    with pytest.raises(AssertionError, match="descriptor"):
        assert_no_scratch(compile_variant(variant, "sm90"))


@pytest.mark.parametrize("target", ["sm90", "sm100"])
@pytest.mark.parametrize("preset", ["kimi-k3", "k3-seed"])
def test_aot_kernels_fit_the_default_shared_memory(preset: str, target: str) -> None:
    """A CUDA launch gets 48 KB of dynamic shared memory unless the kernel's limit was raised, and nothing in
    TensorRT's sources says its AOT launch raises it: every AOT kernel of the published widths, one rank of 8,
    asks at most that (what each aot_impl puts in KernelLaunchParams.shared_mem) in every dtype."""
    c = K3Config.from_preset(preset)
    shared = trt_aot.shared_memory(c, c.num_experts // 8, target)
    # KDA (one node; prepare and recurrence), LatentMLA (one node; split and combine; in half precision the
    # one node and split again on the tile of all 96 heads), float and MXFP4 routed experts, in three dtypes
    assert len(shared) == 53  # and the grouped experts: the grouping, gate/up and down in both tactics' tiles
    assert {name: size for name, size in shared.items() if size > trt_aot.DEFAULT_SHARED_BYTES} == {}


@pytest.mark.parametrize("heads", [12, 96])
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_latent_mla_splits_pipeline_the_cache_into_tensor_cores(target: str, heads: int) -> None:
    """The split kernel at the published widths (bf16, what a kimi-k3 engine runs at decode; a rank's 12 heads
    and all 96 on their 2-warp tile) loads each block of latent rows asynchronously (cp.async: its two
    pipeline stages) and multiplies it on tensor cores for the program's 16 heads."""
    c = K3Config.from_preset("kimi-k3")
    variant = trt_aot.latent_mla_aot_kernel("bfloat16", "bfloat16", c.latent_dim, c.kv_lora_rank, c.mla_scale,
                                            heads, splits=True)
    ptx = compile_variant(variant, target).asm["ptx"]
    assert re.search(r"\bcp\.async\.(ca|cg)", ptx)
    assert re.search(r"\b(mma\.sync|wgmma\.mma_async)", ptx)


def test_device_target_is_the_current_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AOT kernels are compiled for the GPU the build runs on: the current device (a rank's build makes
    its own GPU current), not GPU 0."""
    capabilities = {0: (8, 9), 1: (10, 0)}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)

    def capability(device: int | None = None) -> tuple[int, int]:  # torch's default: the current device
        return capabilities[torch.cuda.current_device() if device is None else device]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    assert aot.device_target() == "sm100"


def test_routed_experts_aot_parameters_are_inputs_then_output() -> None:
    """TensorRT passes an AOT kernel its input pointers, scalar args (none here: every width is
    compiled in), then output pointers; Triton appends two scratch pointers."""
    variant = trt_aot.routed_experts_aot_kernel("bfloat16", True, 64, 64, 4, 2, 0, 4.0, 25.0)
    ptx = compile_variant(variant, "sm90").asm["ptx"]
    params = re.search(r"\.entry\s+\w+\((.*?)\)", ptx, re.S).group(1)
    # z, experts, weights, six MXFP4 tensors, u, then the scratch pointers.
    assert re.findall(r"\.param\s+\.(u64|u32)", params) == ["u64"] * 10 + ["u64"] * 2


def published_grouped_moe_kernels() -> list[k3plugins.KernelVariant]:
    """k3plugins.moe's grouped kernels (group, gate/up, down, combine) with kimi-k3's widths compiled in, as
    grouped AOT nodes would embed them (one rank of 8: 112 experts, top-16), bfloat16 with float and MXFP4
    experts, decode and prefill tiles."""
    c = K3Config.from_preset("kimi-k3")
    held = c.num_experts // 8
    widths = {"L": c.routed_expert_hidden_size, "I": c.moe_intermediate_size, "E": held,
              "TOP_K": c.num_experts_per_token, "BETA": c.activation_situ_beta,
              "LINEAR_BETA": c.activation_situ_linear_beta}
    variants = [moe.group_variant({"E": held, "OFFSET": 0}),
                moe.combine_variant({"L": widths["L"], "TOP_K": widths["TOP_K"]})]
    for packed in (False, True):
        for mode, tiles in moe.tile_choices(torch.bfloat16, packed).items():
            variants += moe.grouped_variants("bf16", packed, tiles, mode, widths)
    return variants


@pytest.mark.parametrize("variant", published_grouped_moe_kernels(), ids=lambda v: v.name)
def test_grouped_moe_kernels_at_the_published_widths(variant: k3plugins.KernelVariant) -> None:
    """Each compiles for sm_90a with no spills, no Triton scratch, within the 48 KB of dynamic shared memory
    an AOT launch gets, and the gate/up and down products on wgmma."""
    kernel = compile_variant(variant, "sm90")
    assert_fits(kernel, "sm90")
    assert_no_scratch(kernel)
    assert kernel.metadata.shared <= trt_aot.DEFAULT_SHARED_BYTES, variant.name
    if "gate_up" in variant.name or "down" in variant.name:
        assert "wgmma.mma_async" in kernel.asm["ptx"], variant.name
