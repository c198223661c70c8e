"""One instruction-set leg of tests/test_half_precision.py: checks run in a process of its own, because
ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY are read once per process.

    python tests/cpu_verdict_worker.py SPEC.json

SPEC: [{"kind": "onnx" | "network", "folder": DIR, "steps": N, "eager": "in-memory" | "streamed"}, ...].
Prints the checks' reports, a JSON list. (The leg without a knob runs `run_checks` in the test's own
process, where no knob is set.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from k3export.check.driver import run_check
from k3export.check.runners.network import run_network_check


def run_checks(checks: list[dict]) -> list[dict]:
    """The checks' reports, as JSON gives them back (what this process prints)."""
    runs = {"onnx": run_check, "network": run_network_check}
    return json.loads(json.dumps([runs[c["kind"]](c["folder"], steps=c["steps"], eager=c["eager"],
                                                  log=lambda line: None) for c in checks], default=str))


if __name__ == "__main__":
    print(json.dumps(run_checks(json.loads(Path(sys.argv[1]).read_text()))))
