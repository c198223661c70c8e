"""The runtime's fault tests, each N times in a row, beside busy processes (a loaded host, where
torchrun's SIGTERM, a broken link and a missed deadline race): every run must pass.

    python tools/fault_soak.py --times 10 --hogs 2

One pytest process, so the builds the tests run on are made once; it stops at the first failure
(-x) and prints pytest's summary. This file is also the pytest plugin that repeats each test (pytest
runs a test given twice once). The hogs are pure-Python busy loops, one core each.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3export.options import non_negative_int, positive_int

FILES = ["tests/test_shards.py", "tests/test_parallel_grid.py"]
FAULT_TESTS = "test_a_killed_stage_stops_the_others or test_a_failed_rank_stops_the_others"
TIMES = "K3EXPORT_SOAK_TIMES"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """As a pytest plugin: every test once per run asked for (a parameter `soak_run`)."""
    if TIMES in os.environ:
        metafunc.fixturenames.append("soak_run")
        metafunc.parametrize("soak_run", range(int(os.environ[TIMES])))


def busy() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--times", type=positive_int, default=10, help="runs of each fault test")
    parser.add_argument("--hogs", type=non_negative_int, default=2, help="busy processes beside the tests")
    args = parser.parse_args()
    hogs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    started = time.monotonic()
    try:
        root = Path(__file__).parents[1]
        env = {**os.environ, TIMES: str(args.times), "PYTHONPATH": str(root / "tools")}
        code = subprocess.call([sys.executable, "-m", "pytest", "-x", "-v", "-p", "fault_soak", "-p",
                                "no:cacheprovider", *FILES, "-k", FAULT_TESTS], cwd=root, env=env)
    finally:
        for hog in hogs:
            hog.kill()
    print(f"fault_soak: the fault tests x {args.times} beside {args.hogs} busy processes: "
          f"{'passed' if code == 0 else 'FAILED'} in {time.monotonic() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
