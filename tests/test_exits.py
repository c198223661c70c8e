"""How a process that has used gloo ends (k3export.exits.end_process): through os._exit, so that the
interpreter's teardown never meets gloo's threads (issue 46: "terminate called without an active
exception", SIGABRT, after the work was done)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from launch import failure, gloo_pair

WORKER = Path(__file__).with_name("gloo_exit_worker.py")


def test_a_gloo_process_ends_through_end_process() -> None:
    """The smallest program that aborted (2 ranks: a gloo sum, its tensor dropped, the group destroyed,
    the end), its gloo threads at SCHED_IDLE, ends 0 on both ranks without "terminate called".
    Its power against the race is the abort rate without end_process (K3EXPORT_GLOO_TEARDOWN=1): the
    issue measured 8 aborts in 14 runs of this program beside two CPU hogs; on this 2-core machine,
    loaded, 0 in 6 at SCHED_IDLE beside two hogs (docs/benchmarks.md, "gloo exits"), where it holds
    only the end's own exit status."""
    for code, stderr in gloo_pair(str(WORKER), "--idle"):
        assert code == 0 and "terminate called" not in stderr, (code, stderr[-2000:])


# torchrun's stderr when worker 1 aborted (tests/partial_outputs_worker.py's in CI, shortened): the
# workers' lines, then torchrun's log, traceback and report.
ABORTED_RUN = """\
*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid ...
*****************************************
rank 0 wrote OUT/rank-0.json
terminate called without an active exception
E1207 14:23:16.123000 20399 torch/distributed/elastic/multiprocessing/api.py:984] failed (exitcode: -6)
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
tests/partial_outputs_worker.py FAILED
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-07_14:23:16
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 20420)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 20420
======================================================
"""


def test_a_failed_torchrun_names_the_workers_exit_and_last_lines() -> None:
    message = failure(subprocess.CompletedProcess([], 1, "", ABORTED_RUN))
    assert message.splitlines()[0] == "torchrun exited 1: rank 1 killed by SIGABRT (pid 20420)"
    assert message.splitlines()[-2:] == ["rank 0 wrote OUT/rank-0.json",
                                         "terminate called without an active exception"]
    assert "Traceback" not in message and "OMP_NUM_THREADS" not in message and "E1207" not in message
