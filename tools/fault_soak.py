"""The runtime's fault tests, each N times in a row, beside busy processes (a loaded host, where
torchrun's SIGTERM, a broken link and a missed deadline race): every run must pass.

    python tools/fault_soak.py --times 10 --hogs 2

One pytest process, so the builds the tests run on are made once; it stops at the first failure
(-x) and prints pytest's summary. This file is also the pytest plugin that repeats each test (pytest
runs a test given twice once). The hogs are pure-Python busy loops, one core each.

How gloo processes end (issue 46, k3export.exits), the same way beside the hogs, every gloo thread
(pt_gloo_runloop, gloo_tcp_loop) at SCHED_IDLE, where a loaded host keeps it off the CPU until its
process ends; counts the runs that aborted ("terminate called", SIGABRT):

    python tools/fault_soak.py --gloo-exits small --times 10 [--teardown]   # tests/gloo_exit_worker.py
    python tools/fault_soak.py --gloo-exits tests --times 3 [--teardown]    # GLOO_TESTS under torchrun

--teardown bypasses end_process (K3EXPORT_GLOO_TEARDOWN=1): the processes end through the
interpreter's teardown, as before it, to show the abort it prevents.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest

from k3export.exits import TEARDOWN
from k3export.options import non_negative_int, positive_int

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from gloo_exit_worker import idle_gloo_threads  # noqa: E402
from launch import gloo_pair  # noqa: E402

FILES = ["tests/test_shards.py", "tests/test_parallel_grid.py"]
FAULT_TESTS = "test_a_killed_stage_stops_the_others or test_a_failed_rank_stops_the_others"
# Tests whose torchrun processes end normally after gloo sums (the issue's own first), each of a worker
# or of the runtime: the soak's real entry points.
GLOO_TESTS = ["tests/test_parallel_grid.py::test_checking_outputs_change_nothing_and_are_the_sums_inputs",
              "tests/test_parallel_grid.py::test_grid_generates_the_unsplit_models_tokens",
              "tests/test_parallel_grid.py::test_a_grid_rank_runs_on_its_engine"]
ABORTED = ("terminate called", "SIGABRT")
TIMES = "K3EXPORT_SOAK_TIMES"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """As a pytest plugin: every test once per run asked for (a parameter `soak_run`)."""
    if TIMES in os.environ:
        metafunc.fixturenames.append("soak_run")
        metafunc.parametrize("soak_run", range(int(os.environ[TIMES])))


def busy() -> None:
    while True:
        pass


def idle_descendants(stop: threading.Event) -> None:
    """Until `stop`: every 0.1 s, the gloo threads of this process's descendants at SCHED_IDLE (no
    other process's: the host is shared)."""
    while not stop.wait(0.1):
        for child in psutil.Process().children(recursive=True):
            idle_gloo_threads(child.pid)


def small_aborts(times: int, env: dict[str, str]) -> int:
    """Runs of tests/gloo_exit_worker.py's 2 ranks (their gloo threads at SCHED_IDLE) in which a rank
    aborted; a run that fails otherwise stops the soak."""
    aborted = 0
    for run in range(times):
        ranks = gloo_pair(str(ROOT / "tests/gloo_exit_worker.py"), "--idle", env=env)
        if any(code == -6 or ABORTED[0] in err for code, err in ranks):
            aborted += 1
        elif any(code != 0 for code, _ in ranks):
            raise SystemExit(f"fault_soak: run {run} failed otherwise: {ranks}")
    return aborted


def torchrun_aborts(times: int, env: dict[str, str]) -> tuple[int, int, int]:
    """GLOO_TESTS, `times` runs each in one pytest process, every gloo thread its processes start at
    SCHED_IDLE: (runs, runs whose torchrun worker aborted, runs failed otherwise)."""
    stop = threading.Event()
    idler = threading.Thread(target=idle_descendants, args=(stop,), daemon=True)
    idler.start()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "fault_soak", "-p", "no:cacheprovider",
                         "-p", "no:randomly", "-n0", f"--junitxml={report}", *GLOO_TESTS], cwd=ROOT,
                        env={**env, TIMES: str(times), "PYTHONPATH": str(ROOT / "tools")})
        stop.set()
        failures = [" ".join(f.get("message", "") + (f.text or "") for f in case.iter("failure"))
                    for case in ET.parse(report).getroot().iter("testcase")]
    aborted = sum(any(word in failure for word in ABORTED) for failure in failures)
    return len(failures), aborted, sum(bool(failure) for failure in failures) - aborted


def gloo_exits(args: argparse.Namespace) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.teardown:
        env[TEARDOWN] = "1"
    how = "the interpreter's teardown (--teardown)" if args.teardown else "end_process"
    if args.gloo_exits == "small":
        aborted = small_aborts(args.times, env)
        print(f"fault_soak: tests/gloo_exit_worker.py through {how}, gloo threads at SCHED_IDLE, beside "
              f"{args.hogs} busy processes: {aborted} of {args.times} runs aborted")
        return 0
    runs, aborted, failed = torchrun_aborts(args.times, env)
    print(f"fault_soak: {len(GLOO_TESTS)} torchrun tests x {args.times} through {how}, gloo threads at "
          f"SCHED_IDLE, beside {args.hogs} busy processes: {aborted} of {runs} runs aborted, {failed} failed "
          "otherwise")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--times", type=positive_int, default=10, help="runs of each fault test")
    parser.add_argument("--hogs", type=non_negative_int, default=2, help="busy processes beside the tests")
    parser.add_argument("--gloo-exits", choices=["small", "tests"],
                        help="count aborts at the end of gloo processes instead: the smallest program, or "
                        "GLOO_TESTS")
    parser.add_argument("--teardown", action="store_true",
                        help="with --gloo-exits: bypass end_process (the interpreter's teardown, as before)")
    args = parser.parse_args()
    if args.teardown and not args.gloo_exits:
        parser.error("--teardown counts aborts: it needs --gloo-exits")
    hogs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    started = time.monotonic()
    try:
        if args.gloo_exits:
            code = gloo_exits(args)
        else:
            env = {**os.environ, TIMES: str(args.times), "PYTHONPATH": str(ROOT / "tools")}
            code = subprocess.call([sys.executable, "-m", "pytest", "-x", "-v", "-p", "fault_soak", "-p",
                                    "no:cacheprovider", *FILES, "-k", FAULT_TESTS], cwd=ROOT, env=env)
            print(f"fault_soak: the fault tests x {args.times} beside {args.hogs} busy processes: "
                  f"{'passed' if code == 0 else 'FAILED'}")
    finally:
        for hog in hogs:
            hog.kill()
    print(f"fault_soak: {time.monotonic() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
