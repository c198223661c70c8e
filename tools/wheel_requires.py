"""Refreshes wheel-requires.json: what the wheels we pin require, in their own metadata.

    python tools/wheel_requires.py

tests/test_constraints.py checks constraints-gpu.txt (a GPU host's) and constraints.txt (this
machine's and CI's) against that file offline. pip reads each wheel's Requires-Dist (`install
--dry-run --no-deps --report`; nothing is installed) for the version the file of its world pins:

- torch on a GPU host: PyPI's Linux x86_64 wheel (the CUDA 13.0 build) for Python 3.11. This
  machine's pip configuration (/etc/xdg/pip: a cap, and the CPU wheel on disk, which pip would take
  instead) is set aside. The index here serves no separate metadata, so pip downloads the whole
  wheel (527 MB, about a minute).
- tensorrt-cu13 on a GPU host: an sdist on PyPI whose libraries come from pypi.nvidia.com (out of
  reach here); pip builds its metadata only.
- torch on this machine: the CPU wheel that this machine's pip configuration finds on disk.

A full resolution of the GPU host's install cannot run here: PyPI's index as seen from these
machines offers nvidia-cudnn-cu13 only as 0.0.0a0, so pip stops at torch's first NVIDIA pin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "wheel-requires.json"
# The GPU host: the wheel tags and Python of a Linux x86_64 host with Python 3.11 (as here).
GPU_HOST = ["--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--only-binary=:all:"]


def pin(name: str, constraints: str) -> str:
    """The `name==VERSION` line of the constraints file `constraints`."""
    for line in (REPO / constraints).read_text().splitlines():
        if line.split("==")[0].strip() == name:
            return line.strip()
    raise SystemExit(f"{constraints}: no pin for {name}")


def report(requirement: str, *options: str, pypi_only: bool = False) -> dict:
    """pip's installation report entry for `requirement` alone, trimmed to what the checks read;
    `pypi_only`: with this machine's pip configuration set aside (PIP_CONFIG_FILE=/dev/null skips
    every configuration file, --isolated the PIP_* variables)."""
    isolated = ["--isolated"] if pypi_only else []
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull} if pypi_only else None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "report.json"
        # pip 23 takes --platform only with --target, even with --dry-run; nothing is written there.
        subprocess.run([sys.executable, "-m", "pip", *isolated, "install", "-q", "--dry-run", "--no-deps",
                        "--ignore-installed", "--target", str(Path(tmp) / "t"), "--report", str(path),
                        *options, requirement], check=True, env=env)
        (entry,) = json.loads(path.read_text())["install"]
    metadata, download = entry["metadata"], entry["download_info"]
    return {"name": metadata["name"], "version": metadata["version"],
            "file": unquote(download["url"].rsplit("/", 1)[-1]),
            "sha256": download.get("archive_info", {}).get("hashes", {}).get("sha256"),
            "requires_dist": metadata.get("requires_dist", [])}


def main() -> None:
    torch, gpu_torch, tensorrt = (pin("torch", "constraints.txt"), pin("torch", "constraints-gpu.txt"),
                                  pin("tensorrt-cu13", "constraints-gpu.txt"))
    wheels = {"gpu_host": {"torch": report(gpu_torch, *GPU_HOST, pypi_only=True),
                           "tensorrt-cu13": report(tensorrt, pypi_only=True)},
              "this_machine": {"torch": report(torch)}}
    if not wheels["this_machine"]["torch"]["version"].endswith("+cpu"):
        raise SystemExit(f"this machine's pip found {wheels['this_machine']['torch']['file']} for {torch}, "
                         "not the CPU wheel CI installs (see /etc/xdg/pip)")
    OUT.write_text(json.dumps({"refresh": "python tools/wheel_requires.py", **wheels}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
