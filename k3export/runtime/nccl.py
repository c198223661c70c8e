"""A split stage's NCCL communicator for its ranks' engines, and the abort of a process's
communicators.

An engine of a rank sums over its stage's ranks in TensorRT's DIST_COLLECTIVE layers, through the
NCCL communicator its execution context is given: `IExecutionContext.set_communicator(capsule)`, an
`ncclComm_t` in a PyCapsule (TensorRT reads the pointer whatever the capsule's name). The stage's
ranks share a torch NCCL process group; its communicator is the one handed over (torch's
ProcessGroupNCCL backend gives it as an integer, `_comm_ptr()`), so the stage has one communicator.

NOT RUN HERE (no GPU): `communicator_capsule` and `abort` (docs/kernels.md lists them); the capsule
around a pointer is tested (tests/test_runtime_engines.py).
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from k3export.errors import UserError

# A prototype of its own, so that no other user of ctypes.pythonapi.PyCapsule_New sees our argtypes.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


def pointer_capsule(pointer: int) -> object:
    """A PyCapsule holding `pointer`, without a name or a destructor: what it points to stays its
    owner's (torch's process group, which outlives the engines)."""
    if not pointer:
        raise ValueError("a capsule cannot hold a null pointer")
    return _capsule_new(pointer, None, None)


def communicator_capsule(group: dist.ProcessGroup) -> object:
    """The ncclComm_t of torch's NCCL process group `group` on the current CUDA device, in a capsule.
    torch makes a group's communicator at its first collective, so one all-reduce of one value comes
    first: a collective over `group`, called by each of its ranks (as set_communicator is)."""
    device = torch.device("cuda", torch.cuda.current_device())
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    torch.cuda.synchronize(device)
    pointer = group._get_backend(device)._comm_ptr()
    if not pointer:
        raise UserError(f"torch's NCCL process group of ranks {dist.get_process_group_ranks(group)} has no "
                        "communicator after an all-reduce (_comm_ptr() is 0); its engines cannot sum")
    return pointer_capsule(pointer)


def abort(groups: list[dist.ProcessGroup]) -> None:
    """Aborts the NCCL communicators of `groups` this process is in, so that no kernel of this process
    waits on a peer that is gone (NCCL has no deadline of its own). Every process makes every stage's
    group (torch.distributed's rule), and for one it is not in `new_group` gives
    `GroupMember.NON_GROUP_MEMBER` (an int, -100: torch/distributed/distributed_c10d.py), which has
    no communicator."""
    for group in groups:
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            group.abort()
