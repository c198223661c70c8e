"""Where a check ran: what makes two machines' verdicts comparable.

Both sides of a CPU check round on this CPU (the eager model and the network evaluator are torch,
the other side may be ONNX Runtime), and two knobs, each read once per process, choose the kernels
that round: ONEDNN_MAX_CPU_ISA caps oneDNN, which torch uses for bfloat16 matmuls (under an AVX2
cap torch takes its own kernel instead); ATEN_CPU_CAPABILITY caps ATen's vectorised kernels
(softmax, norms, elementwise ops; at "default" the float16/float32 matmuls too). The CPU's own
flags decide what the uncapped defaults are. `torch.backends.cpu.get_cpu_capability()` names ATen's
level only: it still says AVX512 under a oneDNN cap, so oneDNN's own ISA is read from its verbose
header.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
import sys
import tempfile
from pathlib import Path

import torch

KNOBS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
# The CPU flags that change which half-precision kernels run.
HALF_PRECISION_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "avx_vnni")


def machine() -> dict:
    """The CPU, its half-precision flags, the knobs set, ATen's and oneDNN's levels, and versions."""
    import onnxruntime

    model, flags = cpu_and_flags()
    return {"cpu": model, "cpu_flags": [f for f in HALF_PRECISION_FLAGS if f in flags],
            "knobs": {k: os.environ[k] for k in KNOBS if k in os.environ},
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn": _onednn(), "torch": torch.__version__, "onnxruntime": onnxruntime.__version__}


def machine_line(record: dict) -> str:
    """One line of `machine()`'s record, for the text report."""
    knobs = "".join(f", {k}={v}" for k, v in record["knobs"].items())
    onednn = record["onednn"]
    return (f"ran on: {record['cpu']} ({' '.join(record['cpu_flags']) or 'no AVX2'}){knobs}; ATen "
            f"{record['aten_cpu_capability']}; oneDNN {onednn['version']} bfloat16 matmul ISA: "
            f"{onednn['isa']}; "
            f"torch {record['torch']}, onnxruntime {record['onnxruntime']}")


def cpu_and_flags() -> tuple[str, set[str]]:
    """The CPU's model name and its flags (/proc/cpuinfo; elsewhere the platform's name and no flags)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return platform.processor() or platform.machine(), set()
    text = cpuinfo.read_text()
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    return (model.group(1).strip() if model else platform.machine(),
            set(flags.group(1).split()) if flags else set())


@functools.cache
def _onednn() -> dict:
    """oneDNN's version and the ISA it dispatches a bfloat16 matmul to, from the header its verbose
    mode prints (to the C stdout, so file descriptor 1 is borrowed for one matmul)."""
    version = re.search(r"MKL-DNN (v[\d.]+)", torch.__config__.show())
    if not torch.backends.mkldnn.is_available():
        return {"version": "absent", "isa": "none"}
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no standard output to borrow (a daemon)
        return {"version": version.group(1) if version else "unknown", "isa": "unknown"}
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                a = torch.ones(64, 256, dtype=torch.bfloat16)
                a @ a.T
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        header = captured.read().decode(errors="replace")
    isa = re.search(r"cpu,isa:(.+)", header)
    return {"version": version.group(1) if version else "unknown",
            "isa": isa.group(1).strip() if isa else "none (torch's own bfloat16 kernel)"}


def reset_peak_memory() -> None:
    """Starts the process's resident-memory high-water mark afresh (Linux: 5 > /proc/self/clear_refs),
    so that peak_memory() gives the peak of what runs from now on; elsewhere a no-op."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory() -> int:
    """The process's resident-memory high-water mark in bytes (VmHWM), or 0 where it is not known."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0
