"""One rank of check --build's grid on its engine: `check.runners.grid.RankWorker` with
`grid.rank_engine` (the GPU-only path), over the CPU stand-in of an engine (tests/engine_standin.py:
the rank's parsed network evaluated on the memory the engine runner binds, refusing what TensorRT
refuses; not an engine). The stage's NCCL group and communicator are the only other stand-ins: the
network's DIST_COLLECTIVE layers sum over the gloo group this process is in. Writes OUT/rank-{r}.json:
the rank's partial sums as compared, where they were read from, and what its execution context saw.

    python -m torch.distributed.run --nproc-per-node N tests/rank_engine_worker.py BUILD_DIR OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from engine_standin import install

import k3export.runtime.nccl
from k3export.check.runners.grid import RankWorker
from k3export.exits import run_to_end
from k3export.runtime.engines import EnginePlace


def main(build_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    patch = pytest.MonkeyPatch()
    engines = install(patch, gpus=ranks)
    patch.setattr(dist, "new_group", lambda backend=None: None)  # no NCCL here: the sums run over gloo
    communicator = k3export.runtime.nccl.pointer_capsule(0x5EED000)  # as set_communicator takes it
    patch.setattr(k3export.runtime.nccl, "communicator_capsule", lambda group: communicator)
    patch.setattr(torch.cuda, "set_device", lambda device: None)
    build = Path(build_dir)
    entry = json.loads((build / "manifest.json").read_text())["stages"][0]["ranks"][rank]
    worker = RankWorker(build / entry["folder"], rank, ranks, EnginePlace(build / entry["engine"], rank))
    lengths = np.array([6, 4])
    feeds = {"input_ids": np.random.default_rng(5).integers(0, 64, (2, 6)),
             "cache_lengths": np.zeros(2, np.int64), "input_lengths": lengths}
    worker.reset(2, None)
    outputs = worker.call(feeds)
    (partials,) = worker.compare()  # the one step's, after the split model has run over it
    (context,) = engines[0].contexts
    Path(out, f"rank-{rank}.json").write_text(json.dumps({
        "partials": partials, "read_from": worker.partials_read_from, "gpu": context.gpu,
        "communicator": "the stage's communicator" if context.communicator is communicator else
                        repr(context.communicator), "refusals": context.refusals,
        "bound": sorted(context.addresses), "engine_tensors": sorted([*context.engine.inputs,
                                                                      *context.engine.outputs]),
        "routing": sorted(n for n in outputs if n.startswith("routing."))}))
    worker.close()


if __name__ == "__main__":
    run_to_end(lambda: main(*sys.argv[1:]))  # destroys the process group
