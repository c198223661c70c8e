"""Peak resident memory of `k3export export` against the bytes of the weights it writes.

    python tools/export_memory.py [--preset k3-small] [--dtype bfloat16] [-- more export args]

Runs the export in a child process and reads the child's peak RSS from the kernel
(getrusage), so nothing in this process is counted.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from k3export.config import K3Config
from k3export.model.accounting import parameter_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="k3-small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("extra", nargs="*", help="more `k3export export` arguments (after --)")
    args = parser.parse_args()

    config = K3Config.from_preset(args.preset)
    config.torch_dtype = args.dtype
    weight_bytes = parameter_report(config).weight_bytes
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "export"
        command = [sys.executable, "-m", "k3export.cli", "export", "--preset", args.preset,
                   "--dtype", args.dtype, "--out", str(out), *args.extra]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        seconds = time.perf_counter() - start
        written = sum(f.stat().st_size for f in out.iterdir())
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # kilobytes on Linux
    print(f"k3export export --preset {args.preset} --dtype {args.dtype} {' '.join(args.extra)}".rstrip())
    print(f"  weights {weight_bytes / 1e6:.0f} MB, files written {written / 1e6:.0f} MB, "
          f"peak RSS {peak / 1e6:.0f} MB = {peak / weight_bytes:.2f}x the weights, {seconds:.0f} s")


if __name__ == "__main__":
    main()
