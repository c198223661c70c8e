"""How a process that has used gloo ends (k3export.exits.end_process): through os._exit, so that the
interpreter's teardown never meets gloo's threads (issue 46: "terminate called without an active
exception", SIGABRT, after the work was done)."""

from __future__ import annotations

from pathlib import Path

from launch import gloo_pair

WORKER = Path(__file__).with_name("gloo_exit_worker.py")


def test_a_gloo_process_ends_through_end_process() -> None:
    """The smallest program that aborted (2 ranks: a gloo sum, its tensor dropped, the group destroyed,
    the end), its gloo threads at SCHED_IDLE, ends 0 on both ranks without "terminate called".
    Its power: without end_process (K3EXPORT_GLOO_TEARDOWN=1), the issue measured 8 aborts in 14
    runs of this program beside two CPU hogs; docs/benchmarks.md ("gloo exits") has this machine's
    rates (tools/fault_soak.py --gloo-exits)."""
    for code, stderr in gloo_pair(str(WORKER), "--idle"):
        assert code == 0 and "terminate called" not in stderr, (code, stderr[-2000:])
