"""The two TensorRT flavours k3export builds with, and what differs between them: this table.

The builder (`build.build_engine`) takes the imported module (`tensorrt_rtx` or `tensorrt`) and looks
its row up here; everything else (parse, plugin check, profiles, DIST_COLLECTIVE layers with
`num_ranks` from the ONNX node, the stream writer, the record) is one code path for both.

- TensorRT-RTX names a compute capability in the builder config and builds with no GPU (SM75..SM121
  less SM90 and SM100: it has no datacenter targets).
- Full TensorRT builds for the GPU in the machine: there is no config call naming a target, so a
  target that is not the local GPU's is refused before anything is exported.
- Both take the aliased-plugin-I/O preview feature (KDA's state updated in place). Multi-device
  needs no preview feature in TensorRT 11 (its multi-device page lists only `num_ranks` at build
  time and `set_communicator` at run time; TensorRT 10.16 needed kMULTIDEVICE_RUNTIME_10_16).
- The plugins: TensorRT-RTX registers the IPluginV3 adapters (`k3plugins.trt`; Python at run time,
  TensorRT-RTX 1.7 has no ahead-of-time plugin interface); full TensorRT registers the
  `tensorrt.plugin` AOT forms (`k3plugins.trt_aot`: PTX in the engine, no Python at run time).
  One registration per op and flavour.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from k3export.engine.rtx_setup import ensure_symlink
from k3export.errors import UserError

# TensorRT-RTX's ComputeCapability names.
RTX_TARGETS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")
TARGET_PATTERN = re.compile(r"sm\d{2,3}")
# For messages: the datacenter GPUs a target means.
GPU_NAMES = {"sm80": "A100", "sm89": "L40S / RTX 4090", "sm90": "H100 / H200", "sm100": "B200 / GB200",
             "sm103": "B300", "sm120": "RTX PRO 6000 / RTX 5090"}


@dataclass(frozen=True)
class Flavour:
    backend: str  # the recipe's and --backend's name
    title: str
    module: str  # what to import
    extra: str  # the k3export install extra that brings it
    constraints: str  # the constraints file it installs with (a GPU host's for full TensorRT)
    targets: tuple[str, ...] | None  # the compute capabilities it names; None: the machine's GPU only
    preview_features: tuple[str, ...]
    network_flags: tuple[str, ...]  # NetworkDefinitionCreationFlag names
    plugins: str  # the k3plugins module whose register(trt) it uses
    setup: Callable[[], object] | None = None  # run before the import (completes the install)

    @property
    def needs_gpu(self) -> bool:
        return self.targets is None


FLAVOURS: dict[str, Flavour] = {f.backend: f for f in (
    Flavour("tensorrt-rtx", "TensorRT-RTX", "tensorrt_rtx", "engine", "constraints.txt", RTX_TARGETS,
            ("ALIASED_PLUGIN_IO_10_03",), (), "k3plugins.trt", ensure_symlink),
    # PREFER_AOT_PYTHON_PLUGINS: KDA and LatentMLA have a JIT form too; the AOT one is built.
    Flavour("tensorrt", "full TensorRT", "tensorrt", "tensorrt", "constraints-gpu.txt", None,
            ("ALIASED_PLUGIN_IO_10_03",), ("PREFER_AOT_PYTHON_PLUGINS",), "k3plugins.trt_aot"),
)}


def flavour_of(trt: ModuleType) -> Flavour:
    """The row of an imported TensorRT module."""
    for flavour in FLAVOURS.values():
        if trt.__name__ == flavour.module:
            return flavour
    raise ValueError(f"{trt.__name__}: not a TensorRT flavour k3export builds with "
                     f"({', '.join(f.module for f in FLAVOURS.values())})")


def load_tensorrt(backend: str = "tensorrt-rtx") -> ModuleType:
    """The module of a flavour, its install completed; refuses (exit 2) when it is not installed."""
    flavour = FLAVOURS[backend]
    problem = module_problem(flavour)
    if problem:
        raise UserError(problem)
    if flavour.setup is not None:
        flavour.setup()
    return importlib.import_module(flavour.module)


def network_flags(trt: ModuleType) -> int:
    """The create_network flags of `trt`'s flavour, as the bit mask the builder takes."""
    return sum(1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
               for name in flavour_of(trt).network_flags)


def register_plugins(trt: ModuleType) -> dict[str, object]:
    """Registers the k3 plugins the way `trt`'s flavour takes them; returns the creators by op."""
    return importlib.import_module(flavour_of(trt).plugins).register(trt)


def target_problem(flavour: Flavour, target: object) -> str | None:
    """Why `target` is not a target of `flavour` (its name only; see machine_problems for the GPU)."""
    if flavour.targets is not None and target not in flavour.targets:
        return (f"one of {', '.join(flavour.targets)} ({flavour.title}'s targets; it has no sm90 or sm100: "
                f"build those with --backend tensorrt on a machine with that GPU)")
    if not (isinstance(target, str) and TARGET_PATTERN.fullmatch(target)):
        return "a compute capability such as 'sm90' (H100/H200) or 'sm100' (B200)"
    return None


def gpu_targets() -> list[str]:
    """The compute capability of each GPU in this machine ("sm90", ...), from nvidia-smi; [] without."""
    if shutil.which("nvidia-smi") is None:
        return []
    result = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:  # a driver without GPUs, or none visible
        return []
    return ["sm" + line.strip().replace(".", "") for line in result.stdout.splitlines() if line.strip()]


def module_problem(flavour: Flavour) -> str | None:
    if importlib.util.find_spec(flavour.module) is not None:
        return None
    return (f"{flavour.title} is not installed (`import {flavour.module}` fails): "
            f"pip install -c {flavour.constraints} -e '.[{flavour.extra}]'")


def machine_problems(flavour: Flavour, target: str, strip: bool = False) -> list[str]:
    """What this machine lacks to build `flavour` engines for `target` (weight-stripped with `strip`):
    the module, the GPU."""
    problems = [p for p in [module_problem(flavour)] if p]
    if strip and not flavour.needs_gpu and not gpu_targets():
        # Measured (2026-12, k3-tiny, SM89): STRIP_PLAN, REFIT or REFIT_IDENTICAL make TensorRT-RTX 1.7's
        # builder run Myelin's CUDA check, which aborts the process without a GPU.
        problems.append(f"a GPU for a weight-stripped build (--strip): {flavour.title} 1.7 aborts the "
                        "process building one without a GPU")
    if flavour.needs_gpu:
        present = gpu_targets()
        if target not in present:
            has = f"this machine has {', '.join(sorted(set(present)))}" if present else \
                "this machine has none (nvidia-smi finds no GPU)"
            problems.append(f"no {target} GPU ({GPU_NAMES.get(target, target)}): {flavour.title} builds for "
                            f"the GPU it runs on, and {has}")
    return problems


def require_machine(flavour: Flavour, target: str, also: list[str] | None = None,
                    strip: bool = False) -> None:
    """Refuses (exit 2), naming everything missing, when this machine cannot build for `target`;
    `also` adds the caller's own findings (a missing checkpoint)."""
    problems = machine_problems(flavour, target, strip) + (also or [])
    if problems:
        where = (f"run it on a host with {target} GPUs and {flavour.title} installed"
                 if flavour.needs_gpu or strip else "run it where these are")
        raise UserError(f"{flavour.title} engines for {target}: this machine lacks what the build "
                        "needs:\n  - " + "\n  - ".join(problems) + f"\n{where} (or build with --backend "
                        f"onnx here and the engines from the stage graphs there)")
