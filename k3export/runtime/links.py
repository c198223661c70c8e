"""The messages between the processes of the torchrun run, and the planes they travel on.

Runners (`--runner`, runtime.engines): ONNX Runtime on CPU, where everything crosses gloo; or the
stages' TensorRT engines, each process on the GPU torchrun's LOCAL_RANK gives it. With engines the
boundary tensors stay CUDA tensors and cross an NCCL process group over every process (the data
plane), a split stage's engines sum through their stage's NCCL communicator (runtime.nccl), and only
the last stage reads anything back to the host, its logits; headers, tokens and stop messages stay on
gloo (the control plane). Both planes are one code path: torch tensors over a process group.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from k3export.onnx.export import TensorSpec, resolve_shape
from k3export.runtime.faults import StageFailed, gloo_reason, process_name
from k3export.runtime.schedule import MicroBatch

RUN, STOP, FINISHED = 1, 2, 3  # a header's kind
TOKENS = TensorSpec("tokens", "int64", ["batch"], "the last stage's tokens for a micro-batch's next step")


@dataclass(frozen=True)
class Plane:
    """Where a message's tensors travel: over a process group (None: the default one, gloo), living on
    a device. Headers, tokens and stop messages take the control plane (gloo, CPU); the boundary
    tensors the data plane: the control plane too with ONNX Runtime's stages, an NCCL group over every
    process and this process's GPU with engines."""

    group: dist.ProcessGroup | None
    device: torch.device


CONTROL = Plane(None, torch.device("cpu"))


def as_tensor(value: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A stage's output as a tensor to send: numpy shared, not copied; a CUDA tensor as it is."""
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    return torch.from_numpy(np.ascontiguousarray(value))


class Links:
    """This process's messages, every send non-blocking and every wait on the control plane with a
    deadline (an NCCL wait returns once the transfer is ordered before this process's next GPU work,
    which the watchdog guards). A message is a header [kind, micro-batch, rows, seq] and, for RUN,
    tensors whose shapes the header gives, on the plane the caller names."""

    def __init__(self, timeout: int, window: int, ranks: int, data: Plane = CONTROL) -> None:
        self.timeout = timeout
        self.ranks = ranks  # of each stage, to name a peer
        self.window = window  # messages sent ahead before waiting for the oldest to be received
        self.data = data  # the plane of the boundary tensors
        self.header: tuple[dist.Work, torch.Tensor] | None = None  # the next one, posted ahead
        self.sending: deque[tuple[int, list[tuple[dist.Work, torch.Tensor]]]] = deque()  # kept until sent

    def send(self, peer: int, kind: int, batch: MicroBatch, values: list[np.ndarray | torch.Tensor],
             plane: Plane = CONTROL, control: list[np.ndarray] = ()) -> int:
        """Sends a message about `batch`'s current call (before its `advance`), its tensors on `plane`,
        then `control`'s on the control plane; returns its bytes."""
        header = torch.tensor([kind, batch.index, batch.size, batch.seq])
        tensors = [(header, CONTROL), *((as_tensor(v), plane) for v in values),
                   *((as_tensor(v), CONTROL) for v in control)]
        while len(self.sending) >= self.window:
            self.wait_sent()
        self.sending.append((peer, [(self.post(dist.isend, t, peer, p), t) for t, p in tensors]))
        return sum(t.nbytes for t, _ in tensors)

    def wait_sent(self) -> None:
        """Waits until the oldest message sent has been taken."""
        peer, works = self.sending.popleft()
        for work, _ in works:
            self.wait(work, peer)

    def expect(self, peer: int) -> None:
        """Posts the receive of the next header from `peer`, so that it arrives while this one computes."""
        header = torch.empty(4, dtype=torch.int64)
        self.header = (self.post(dist.irecv, header, peer, CONTROL), header)

    def receive(self, peer: int, specs: list[TensorSpec], plane: Plane = CONTROL,
                control: list[TensorSpec] = ()) -> tuple[int, int, dict[str, np.ndarray | torch.Tensor]]:
        """The expected message from `peer`: its kind, micro-batch and (RUN) tensors by name, `specs`
        taken on `plane` (numpy arrays on the CPU, CUDA tensors on a GPU), then `control`'s."""
        work, header = self.header
        self.wait(work, peer)
        kind, index, rows, seq = header.tolist()
        tensors = {}
        if kind != STOP:
            sizes = {"batch": rows, "seq": seq}
            posted = []
            for specs_on, where in ((specs, plane), (control, CONTROL)):
                for s in specs_on:
                    tensors[s.name] = torch.empty(resolve_shape(s, sizes), dtype=getattr(torch, s.dtype),
                                                  device=where.device)
                    posted.append(self.post(dist.irecv, tensors[s.name], peer, where))
            for work in posted:
                self.wait(work, peer)
        return kind, index, {name: t.numpy() if t.device.type == "cpu" else t for name, t in tensors.items()}

    def post(self, op: Callable[..., dist.Work], tensor: torch.Tensor, peer: int, plane: Plane) -> dist.Work:
        """`dist.isend` or `dist.irecv` of `tensor`: a link already broken fails here, as in `wait`."""
        try:
            return op(tensor, peer, group=plane.group)
        except RuntimeError as e:
            raise self.failure(e, peer) from None

    def wait(self, work: dist.Work, peer: int) -> None:
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise self.failure(e, peer) from None

    def failure(self, error: RuntimeError, peer: int) -> StageFailed:
        """What a failed send or receive with `peer` means, in words."""
        name = process_name(peer, self.ranks)
        if "Timed out" in str(error):
            return StageFailed(f"{name} took nothing or sent nothing for {self.timeout} s (--timeout): it "
                               "died or hangs, or a stage before it did")
        return StageFailed(f"the link with {name} broke ({gloo_reason(error)}): it died, or a stage before "
                           "it did")

    def flush(self) -> None:
        """Waits until every message sent has been taken."""
        while self.sending:
            self.wait_sent()
