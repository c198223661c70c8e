"""Ahead-of-time compilation of the kernel variants for a GPU architecture, with no GPU needed.

Triton compiles capability 90 as sm_90a (H100/H200) and 100 as sm_100a (B200): the architecture-
specific targets full TensorRT's AOT plugins embed for the GPU they are built on; sm89 and sm120 are
TensorRT-RTX's. Triton fills a kernel's register and spill counts only when a driver loads it, so the
counts come from the bundled `ptxas -v` run over the PTX instead.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3plugins.variants import KernelVariant

TARGETS = {name: GPUTarget("cuda", int(name[2:]), 32) for name in ("sm89", "sm90", "sm100", "sm120")}
# The H200's driver (CUDA 13.0) takes PTX <= 9.0. Triton 3.6.0 and 3.7.1 (a GPU host's) assemble sm_90a
# with their bundled ptxas 12.8, which takes PTX <= 8.7; for sm_100a 3.7.1 would emit 9.1 unless told.
PTX_VERSION = 87
# Shared memory one block may use (227 KB on H100/H200 and B200, 99 KB on the SM89 and SM120 GPUs).
MAX_SHARED_BYTES = {"sm89": 101376, "sm90": 232448, "sm100": 232448, "sm120": 101376}
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


class KernelStats(NamedTuple):
    registers: int
    shared_bytes: int
    spill_stores: int
    spill_loads: int


def device_target() -> str:
    """The TARGETS name of the current CUDA device: the one the build runs on (GPU only: full TensorRT's
    AOT build runs there; a rank's build makes its own GPU current, which need not be GPU 0)."""
    device = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(device)
    name = f"sm{major}{minor}"
    if name not in TARGETS:
        raise ValueError(f"GPU {device} is {name}: the k3 AOT kernels are compiled for {', '.join(TARGETS)}")
    return name


def compile_variant(variant: KernelVariant, target: str = "sm90") -> triton.compiler.CompiledKernel:
    # Pointers are assumed 16-byte aligned (torch and TensorRT allocate at 256 bytes), which lets
    # Triton vectorise loads; a launcher must not hand these kernels unaligned views.
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(variant.signature.items())
             if ty.startswith("*") or name in variant.divisible_by_16}
    source = ASTSource(variant.fn, variant.signature, variant.constexprs, attrs)
    return triton.compile(source, target=TARGETS[target],
                          options={"num_warps": variant.num_warps, "num_stages": variant.num_stages,
                                   "ptx_version": PTX_VERSION})


def kernel_stats(kernel: triton.compiler.CompiledKernel) -> KernelStats:
    """Registers and spills from `ptxas -v` on the kernel's PTX; shared memory from Triton."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        arch = re.search(r"^\.target\s+(\w+)", kernel.asm["ptx"], re.MULTILINE).group(1)
        cubin = Path(tmp) / "kernel.cubin"
        result = subprocess.run([str(PTXAS), "-v", f"-arch={arch}", str(ptx), "-o", str(cubin)],
                                capture_output=True, text=True, check=True)
    log = result.stderr + result.stdout

    def count(pattern: str) -> int:
        return int(re.search(pattern, log).group(1))

    return KernelStats(registers=count(r"Used (\d+) registers"), shared_bytes=kernel.metadata.shared,
                       spill_stores=count(r"(\d+) bytes spill stores"),
                       spill_loads=count(r"(\d+) bytes spill loads"))
