"""Which runner a build's stages run on, and on which GPU a process runs its engine.

A `k3export build RECIPE` folder built with a TensorRT backend records an engine per stage (the stage
entry's "engine") or per rank of a split stage (each rank entry's "engine"), paths relative to the
folder; its ONNX graphs are there too. `choose_runner` takes its engines when every stage (every
rank) has one and --runner does not say otherwise, else ONNX Runtime on CPU, and says why in the line
the runtime prints first. An engine needs a GPU and TensorRT: without them `--runner engine` (or the
default on an engine build) is refused before any process group or session is made.

The manifest records places ("stage", "rank", "folder"), not GPU numbers: a process runs on the GPU
its launcher gives it, torchrun's LOCAL_RANK (its index among the processes of its host), so a host
carrying several stages' processes puts each on its own GPU (`device_of`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3export.artifacts import BUILD_MANIFEST, read_manifest
from k3export.errors import UserError

ONNX, ENGINE = "onnx", "engine"
RUNNERS = (ONNX, ENGINE)


@dataclass(frozen=True)
class RunnerChoice:
    kind: str  # ONNX or ENGINE
    why: str  # for the line the runtime prints first
    engines: list[list[Path]]  # per stage, per rank (one for a stage that is not split); [] for ONNX

    def line(self) -> str:
        return f"runner: {self.kind} ({self.why})"

    def place(self, stage: int, rank: int, device: int, communicator: Any = None) -> EnginePlace:
        """Where stage `stage`'s (rank `rank`'s) engine runs: on `device`, only the last stage reading
        anything back to the host, its logits (sampled there); boundaries stay CUDA tensors."""
        last = stage + 1 == len(self.engines)
        return EnginePlace(self.engines[stage][rank], device, frozenset({"logits"} if last else ()),
                           communicator)


@dataclass(frozen=True)
class EnginePlace:
    """What a stage's engine runner needs beyond its export folder: the engine file, the CUDA device,
    the outputs read back to the host (None: all; the others stay CUDA tensors), and the NCCL
    communicator of a split stage's ranks (a capsule, runtime.nccl.communicator_capsule)."""

    path: Path
    device: int
    host_outputs: Collection[str] | None = None
    communicator: Any = None


def _engines(build_dir: Path, manifest: dict[str, Any]) -> list[list[Path | None]]:
    """Per stage, per rank, the engine file its manifest entry records (None: none)."""
    return [[build_dir / r["engine"] if r.get("engine") else None for r in stage.get("ranks", [stage])]
            for stage in manifest["stages"]]


def choose_runner(build_dir: str | Path, requested: str | None, command: str = "the runtime") -> RunnerChoice:
    """`--runner` (None: not given) of `command` for the build at `build_dir`, whose manifest is
    already verified (runtime.stage_ranks): its engines when asked, or by default when every stage has
    them; refused when asked for engines the build lacks, or for engines on a machine without a GPU or
    TensorRT."""
    build_dir = Path(build_dir)
    manifest = read_manifest(build_dir, BUILD_MANIFEST)
    engines = _engines(build_dir, manifest)
    lacking = [f"stage {s}" + (f" rank {r}" if len(ranks) > 1 else "")
               for s, ranks in enumerate(engines) for r, engine in enumerate(ranks) if engine is None]
    if requested == ONNX or (requested is None and lacking):
        why = "--runner onnx" if requested == ONNX else f"the build holds no TensorRT engine for {lacking[0]}"
        return RunnerChoice(ONNX, f"{why}: its ONNX graphs in ONNX Runtime on CPU", [])
    if lacking:
        recipe = manifest.get("recipe_file", "RECIPE")
        raise UserError(f"--runner engine: {build_dir / BUILD_MANIFEST} records no TensorRT engine for "
                        f"{lacking[0]} (built with backend {manifest.get('backend')!r}); build its engines "
                        f"with `k3export build {recipe} --backend tensorrt-rtx --out {build_dir}` "
                        "(or --backend tensorrt on a host with the target GPUs), or run its ONNX graphs with "
                        "--runner onnx")
    from k3export.engine.runner import require_engine_runtime

    try:
        require_engine_runtime(f"{command}'s --runner engine")
    except UserError as e:
        default = "" if requested else \
            f"{build_dir} holds TensorRT engines, which {command} runs by default: "
        raise UserError(f"{default}{e}; --runner onnx runs the build's ONNX graphs on CPU") from None
    why = "--runner engine" if requested else \
        "the build holds TensorRT engines; --runner onnx runs its ONNX graphs on CPU"
    return RunnerChoice(ENGINE, why, [[engine for engine in ranks if engine] for ranks in engines])


def device_of(env: Mapping[str, str], gpus: int) -> int:
    """The CUDA device of this process: torchrun's LOCAL_RANK (0 without torchrun), one GPU a process
    of the host, refused when the host has fewer than LOCAL_RANK + 1 GPUs (`gpus`:
    torch.cuda.device_count(), which honours CUDA_VISIBLE_DEVICES)."""
    value = env.get("LOCAL_RANK", "0")
    try:
        local = int(value)
    except ValueError:
        local = -1
    if local < 0:
        raise UserError(f"LOCAL_RANK = {value!r}: expected torchrun's index of this process on its host, an "
                        "integer >= 0")
    if local >= gpus:
        raise UserError(f"LOCAL_RANK = {local}: this host has {gpus} GPU{'s' if gpus != 1 else ''} "
                        "(torch.cuda.device_count()) and each process runs its engine on GPU LOCAL_RANK: "
                        f"start at most {gpus} processes on it (torchrun --nproc-per-node {gpus}, --nnodes "
                        "as many hosts as it takes)")
    return local
