"""`torch.ops.k3.all_reduce`: the one collective a tensor/expert-parallel rank needs
(k3export/model/parallel.py).

In eager it sums x over the ranks of the current process group with torch.distributed (the default
group, or the one `use_group` set: a pipeline stage's ranks); its fake implementation is the identity
on shapes, so a split model exports, and the ONNX translation writes a `DistCollective` node (domain
trt) that TensorRT maps to its DIST_COLLECTIVE layer. `ranks` is the number of ranks summed over:
the node's nb_rank, and a check that the process group is the one the split was made for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from k3export.errors import UserError

_group: Any = None  # a torch.distributed.ProcessGroup, or None: the default group
_partials: list[Tensor] | None = None  # while `recording_partials` runs: the inputs of the sums


def use_group(group: Any) -> None:
    """The process group `all_reduce` sums over from now on (None: the default group)."""
    global _group
    _group = group


@contextmanager
def recording_partials() -> Iterator[list[Tensor]]:
    """Within the block, the input of every `all_reduce`, this rank's partial sum, in call order
    (check --build compares them with a rank's graph's, to name a wrong rank)."""
    global _partials
    _partials = []
    try:
        yield _partials
    finally:
        _partials = None


@torch.library.custom_op("k3::all_reduce", mutates_args=())
def all_reduce(x: Tensor, ranks: int) -> Tensor:
    """The sum of x over the `ranks` ranks of the process group (a new tensor)."""
    import torch.distributed as dist  # here: importing it at load time warns in unrelated code

    total = x.clone()
    if _partials is not None:
        _partials.append(x.clone())
    if ranks == 1:
        return total
    size = dist.get_world_size(_group) if dist.is_available() and dist.is_initialized() else 1
    if size != ranks:
        raise UserError(f"all_reduce over {ranks} ranks, but the process group has {size}: run a model split "
                        f"over {ranks} ranks under `torchrun --nproc-per-node {ranks}` (torch.distributed "
                        "initialised)")
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=_group)
    return total


@all_reduce.register_fake
def _(x, ranks):
    return torch.empty_like(x)
