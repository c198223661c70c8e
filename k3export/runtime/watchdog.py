"""Every process of an engine run ends within --timeout (and the abort's wait) when a peer dies or hangs.

gloo's waits (the control plane: headers, tokens, stop messages) have deadlines of their own and
raise; NCCL's have none: a rank that dies leaves its partners blocked in an all-reduce of their
engines or in a receive of a boundary for ever. So each wait that may block in NCCL runs under
`Watchdog.guard(what)`: a thread of ours, when the guarded wait outlasts the timeout, says what this
process waited for, aborts the NCCL communicators (the `abort` hook, runtime.nccl.abort) and exits 1.
A failure the control plane finds ends the process the same way (`stop`). The hook runs once,
whichever comes first, and is waited for at most `abort_wait` seconds: an NCCL abort can hang
itself, and must not keep the process past its deadline (--timeout plus that wait). With a `cause`
(runtime.faults.FaultBoard.cause), the exit also names the process the run stopped for (within
SILENCE_SECONDS and one more) while the abort runs.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

from k3export.exits import end_process

ABORT_SECONDS = 10.0


class Watchdog:
    """Ends the process `name` (a stage and rank, as messages name it) when a `guard`ed wait lasts
    `timeout` seconds, or on `stop`: its message, `abort()` once (waited for at most `abort_wait`
    seconds), exit 1."""

    def __init__(self, name: str, timeout: float, abort: Callable[[], None],
                 abort_wait: float = ABORT_SECONDS) -> None:
        self.name, self.timeout, self.hook, self.abort_wait = name, timeout, abort, abort_wait
        self.waiting: tuple[float, str] | None = None  # the guarded wait's deadline and what it waits for
        self.changed = threading.Condition()
        self.aborted = threading.Lock()  # taken by the first abort
        self.stopping = threading.Lock()  # taken by the first stop: one exit says its lines
        # Names the process the run stopped for (runtime.faults.FaultBoard.cause), once the run's store is
        # joined.
        self.cause: Callable[[str], str] | None = None
        threading.Thread(target=self.watch, name="watchdog", daemon=True).start()

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Runs the block as a wait for `what` ("stage 1 rank 1 (process 3)'s boundary"), ended by the
        watchdog after `timeout` seconds."""
        with self.changed:
            self.waiting = (time.monotonic() + self.timeout, what)
            self.changed.notify()
        try:
            yield
        finally:
            with self.changed:
                self.waiting = None

    def watch(self) -> None:
        with self.changed:
            while self.waiting is None or self.waiting[0] > time.monotonic():
                self.changed.wait(None if self.waiting is None else self.waiting[0] - time.monotonic())
            what = self.waiting[1]
        self.stop(f"waited {self.timeout:g} s (--timeout) for {what}: a process it waits for died or hangs; "
                  "aborting the NCCL communicators")

    def say(self, message: str) -> None:
        # One write with its newline, so that processes failing together do not share a line.
        sys.stderr.write(f"k3export.runtime: {self.name}: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()

    def abort(self) -> None:
        """The abort hook, if no one has called it yet."""
        if self.aborted.acquire(blocking=False):
            self.hook()

    def stop(self, message: str) -> NoReturn:
        """Says `message` and, with a `cause`, the process the run stopped for; aborts the communicators
        (waiting at most `abort_wait`, saying so if the abort is still running then) and exits 1. A
        second caller (the signals' thread, the main thread, this one's) waits for the first's exit."""
        self.stopping.acquire()
        self.say(message)
        aborting = threading.Thread(target=self.abort, name="abort", daemon=True)
        aborting.start()
        if self.cause is not None:  # while the abort runs
            self.say(self.cause(message))
        aborting.join(self.abort_wait)
        if aborting.is_alive():
            self.say(f"the abort of the NCCL communicators did not return within {self.abort_wait:g} s; "
                     "exiting without it")
        end_process(1, fault=True)
