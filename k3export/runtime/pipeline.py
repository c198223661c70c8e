"""A build's stages chained in one process: `Stage` (one stage, or one rank of a split stage,
holding its caches, whatever runs it) and `Pipeline` (the stages in order)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from torch.distributed import ProcessGroup

from k3export.errors import UserError
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE
from k3export.onnx.runner import DRAFT_LENGTHS, BoundOnnxrtRunner, Signature
from k3export.runtime.engines import EnginePlace
from k3export.runtime.segments import SegmentedRunner


class Stage:
    """One stage, or one rank of a split stage, holding its caches: its engine when `engine` says
    where it runs (a split stage's engine sums through its communicator), else an ONNX Runtime
    session over its export folder (a rank's: its pieces, summed over `group`, the process group of
    the stage's ranks). `extra_outputs`: intermediate tensors of its graph returned too (check's
    routing choices)."""

    def __init__(self, export_dir: Path, name: str, threads: int | None = None,
                 extra_outputs: list[str] | None = None, group: ProcessGroup | None = None,
                 engine: EnginePlace | None = None) -> None:
        manifest = json.loads((export_dir / MANIFEST_FILE).read_text())
        self.signature = Signature(manifest)
        self.layers = range(*manifest["layers"])
        self.dtype = manifest["dtype"]
        if engine is not None:
            # Imported here: it needs TensorRT, which machines running the ONNX graphs may lack.
            from k3export.engine.runner import EngineRunner

            self.runner = EngineRunner(engine.path, export_dir, name=name, extra_outputs=extra_outputs,
                                       device=engine.device, host_outputs=engine.host_outputs,
                                       communicator=engine.communicator)
        elif manifest.get("parallel", {}).get("ranks", 1) > 1:
            self.runner = SegmentedRunner(export_dir / GRAPH_FILE, self.signature, group, name, threads)
        else:
            self.runner = BoundOnnxrtRunner(export_dir / GRAPH_FILE, self.signature, name=name,
                                            threads=threads, extra_outputs=extra_outputs)
        self.seconds = 0.0

    def feeds(self, request: dict[str, np.ndarray], previous: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This stage's feeds: the previous stage's outputs of the same names, else the request's."""
        feed = {}
        for spec in self.signature.feeds:
            source = previous if spec.name in previous else request
            if spec.name not in source:
                raise UserError(f"stage {self.runner.name}: input {spec.name!r} is neither an output of the "
                                "stage before nor a request input; the stages do not chain")
            feed[spec.name] = source[spec.name]
        if DRAFT_LENGTHS in request:  # no graph input: the runner's rollback reads it
            feed[DRAFT_LENGTHS] = request[DRAFT_LENGTHS]
        return feed

    def __call__(self, feed: dict[str, Any]) -> dict[str, Any]:
        """The stage's outputs for `feed`: numpy arrays, or CUDA tensors an engine keeps on its GPU."""
        outputs = self.runner.infer(feed, check_inputs=False)
        self.seconds += self.runner.inference_time
        return outputs

    def reset_slots(self, sizes: list[int]) -> None:
        """Empty caches for each micro-batch of `sizes` rows: every micro-batch its own rows of every
        cache, as if each were the only batch; `use(i)` picks micro-batch i's for the next calls.
        Every runner (ONNX Runtime's, an engine's) holds its caches in `caches`, its double buffers
        in `spares` and what a rejected draft takes back in `rollback`, and reads them at each call."""
        self.slots = []
        for size in sizes:
            self.runner.reset(size)
            # The runner swaps its double-buffered caches inside these two dicts, so they stay its own.
            self.slots.append((self.runner.caches, self.runner.spares, self.runner.rollback))

    def use(self, index: int) -> None:
        self.runner.caches, self.runner.spares, self.runner.rollback = self.slots[index]


def passed_on(stages: list[Stage], index: int) -> list[str]:
    """The outputs of stage `index` that the next stage takes (its boundary), in that stage's order."""
    produced = {s.name for s in stages[index].signature.outputs}
    return [s.name for s in stages[index + 1].signature.feeds if s.name in produced]


class Pipeline:
    """The stages in order, in this process (a split build's: one rank of each, its sums over
    `group`); `engines`: where each stage's engine runs (None: ONNX Runtime sessions)."""

    def __init__(self, export_dirs: list[Path], threads: int | None = None,
                 extra_outputs: list[list[str]] | None = None, group: ProcessGroup | None = None,
                 engines: list[EnginePlace] | None = None) -> None:
        extra_outputs = extra_outputs or [[] for _ in export_dirs]
        engines = engines or [None for _ in export_dirs]
        self.stages = [Stage(d, f"stage{i}", threads, extra, group, engine) for i, (d, extra, engine)
                       in enumerate(zip(export_dirs, extra_outputs, engines, strict=True))]
        for stage in self.stages:
            stage.runner.activate()

    def reset(self, batch: int) -> None:
        for stage in self.stages:
            stage.runner.reset(batch)

    def reset_slots(self, sizes: list[int]) -> None:
        for stage in self.stages:
            stage.reset_slots(sizes)

    def close(self) -> None:
        for stage in self.stages:
            stage.runner.deactivate()

    def calls(self, request: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """Runs the request through the stages in order, each fed the one before's outputs of its
        input names; yields each stage's outputs (its present caches are the runner's buffers, valid
        until its next call)."""
        outputs: dict[str, np.ndarray] = {}
        for stage in self.stages:
            outputs = stage(stage.feeds(request, outputs))
            yield outputs

    def __call__(self, request: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Runs the request through every stage; the last stage's outputs."""
        *_, last = self.calls(request)
        return last
