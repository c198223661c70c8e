"""The runtime's fault tests, each N times in a row, beside busy processes (a loaded host, where
torchrun's SIGTERM, a broken link and a missed deadline race): every run must pass.

    python tools/fault_soak.py --times 10 --hogs 2

One pytest process, so the builds the tests run on are made once; it stops at the first failure
(-x) and prints pytest's summary. The hogs are pure-Python busy loops, one core each.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

FAULT_TESTS = ["tests/test_shards.py::test_a_killed_stage_stops_the_others",
               "tests/test_parallel_grid.py::test_a_failed_rank_stops_the_others[killed]",
               "tests/test_parallel_grid.py::test_a_failed_rank_stops_the_others[hung]"]


def busy() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--times", type=int, default=10, help="runs of each fault test")
    parser.add_argument("--hogs", type=int, default=2, help="busy processes beside the tests")
    args = parser.parse_args()
    hogs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    started = time.monotonic()
    try:
        # Test by test, each `times` times in a row (pytest keeps the order it is given).
        tests = [test for test in FAULT_TESTS for _ in range(args.times)]
        code = subprocess.call([sys.executable, "-m", "pytest", "-x", "-q", "--keep-duplicates",
                                "-p", "no:cacheprovider", *tests], cwd=Path(__file__).parents[1])
    finally:
        for hog in hogs:
            hog.kill()
    print(f"fault_soak: {len(FAULT_TESTS)} fault tests x {args.times} beside {args.hogs} busy processes: "
          f"{'passed' if code == 0 else 'FAILED'} in {time.monotonic() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
