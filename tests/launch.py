"""How the tests start processes under torchrun (gloo on 127.0.0.1, a free port), and what a failed run
says: `torchrun(...)` returns the finished run; `succeeded(proc)` fails the test with each failed
worker's exit (its signal by name) and the last lines its workers wrote on stderr, which torchrun's own
30-line report (its traceback, ChildFailedError) would otherwise push out of the message."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

STDERR_LINES = 20  # the workers' last lines a failure message carries
# torchrun's report of a failed worker: "rank : 0 (local_rank: 0)" then "exitcode : -6 (pid: 123)".
FAILED_WORKER = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")
# torchrun's own lines: its log (glog's "E1207 14:05:01.123 4567 torch/distributed/...") and its
# banner about OMP_NUM_THREADS.
TORCHRUN_LOG = re.compile(r"^[EWIF]\d{4} [\d:.]+ \d+ \S*torch/distributed/|^\*+$|^Setting OMP_NUM_THREADS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(processes: int, *args: str, monitor_interval: float = 0.1) -> list[str]:
    """torchrun of `processes` workers running `args` (a script and its arguments, or -m MODULE ...);
    it polls its workers every `monitor_interval` seconds (0.1, its default)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "--monitor-interval", str(monitor_interval), *args]


def torchrun(processes: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The finished run of torchrun_command(processes, *args), its output captured as text."""
    return subprocess.run(torchrun_command(processes, *args), capture_output=True, text=True, timeout=timeout)


def gloo_pair(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> list[tuple[int, str]]:
    """Two processes of `python ARGS`, ranks 0 and 1 of a gloo group (env://, without torchrun's own
    processes): each one's exit status and stderr."""
    common = {**(env or os.environ), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
              "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, *args], env={**common, "RANK": str(rank)},
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    errors = [rank.communicate(timeout=timeout)[1] for rank in ranks]
    return [(rank.returncode, error) for rank, error in zip(ranks, errors, strict=True)]


def exit_name(code: int) -> str:
    """A worker's exit status as torchrun reports it: a negative one is the signal that ended it."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def failure(proc: subprocess.CompletedProcess) -> str:
    """Why a torchrun failed, for a test's message: each failed worker's exit from torchrun's report,
    then the last STDERR_LINES lines the workers wrote (interleaved as they came), without torchrun's
    report and log lines."""
    workers = [f"rank {rank} {exit_name(int(code))} (pid {pid})"
               for rank, code, pid in FAILED_WORKER.findall(proc.stderr)]
    theirs = proc.stderr
    report = theirs.rfind("Traceback (most recent call last):")
    if report >= 0 and "ChildFailedError" in theirs[report:]:
        theirs = theirs[:report]
    lines = [line for line in theirs.splitlines() if not TORCHRUN_LOG.match(line)]
    return (f"torchrun exited {proc.returncode}: {'; '.join(workers) or 'no failed worker in its report'}\n"
            f"the workers' last {STDERR_LINES} lines of stderr:\n" + "\n".join(lines[-STDERR_LINES:]))


def succeeded(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """`proc`, once it exited 0; else the test fails with `failure(proc)`."""
    assert proc.returncode == 0, failure(proc)
    return proc
