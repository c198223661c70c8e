"""Completes a pip-installed TensorRT-RTX: `python -m k3export.engine.rtx_setup` (idempotent).

The tensorrt-rtx wheels ship `libtensorrt_rtx.so.1` without the unversioned `libtensorrt_rtx.so`
beside it, which the ONNX parser loads by that name when it meets its first plugin node; without it
the process aborts ("terminate called without an active exception"). This adds the symlink.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

LIBS_PACKAGE = "tensorrt_rtx_libs"
LINK, TARGET = "libtensorrt_rtx.so", "libtensorrt_rtx.so.1"


def library_dir() -> Path:
    """The folder of the TensorRT-RTX shared libraries (the tensorrt_rtx_libs wheel's package)."""
    spec = importlib.util.find_spec(LIBS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{LIBS_PACKAGE} is not installed: pip install tensorrt-rtx-cu13")
    return Path(next(iter(spec.submodule_search_locations)))


def ensure_symlink() -> Path:
    """Creates `libtensorrt_rtx.so -> libtensorrt_rtx.so.1` if missing; returns the link's path."""
    folder = library_dir()
    if not (folder / TARGET).exists():
        raise FileNotFoundError(f"{folder / TARGET}: missing; reinstall tensorrt-rtx-cu13")
    link = folder / LINK
    if not link.exists():
        if link.is_symlink():  # dangling
            link.unlink()
        link.symlink_to(TARGET)
    return link


def main() -> int:
    try:
        link = ensure_symlink()
    except (FileNotFoundError, OSError) as error:
        print(f"rtx_setup: {error}", file=sys.stderr)
        return 1
    print(f"{link} -> {link.resolve().name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
