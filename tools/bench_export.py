"""Export time per phase and peak memory, before and after a change, measured side by side.

    python tools/bench_export.py --before REV [--after REV] [--rounds 2] [--cases tiny,small,stage0]

Each case is one `k3export export` of each commit's own CLI (a `git worktree` per commit, so the
tree's modules may have moved), in a child process of its own, alternating before and after over
--rounds rounds so that drifts in this machine's load hit both alike. Each cell is the median over
the rounds; the last column is before / after (the speed-up).

The cases: k3-tiny and k3-small with seeded weights (float32), and the published model's first
pipeline stage of engines/kimi-k3-16x1.toml's 16-stage plan (layers 0-5, bfloat16, MXFP4 experts,
131,072-token MLA cache) without weights, the graph at real shapes.

Phases are read from the child by wrapping torch's own functions (stable across our commits):
setup (imports, the eager model) until torch.export starts; capture (torch.export.export);
decompose (ExportedProgram.run_decompositions, which retraces); promote (the exporter's type
promotion pass, which re-runs the graph); translate (FX to ONNX); rest (the optimizer, the k3
functions, writing the files). Peak RSS is the child's own (getrusage).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from revisions import checkout

OUT = Path("out/bench-export")
CASES = {
    "tiny": ["--preset", "k3-tiny"],
    "small": ["--preset", "k3-small", "--dtype", "float32"],
    "stage0": ["--preset", "kimi-k3", "--layers", "0:6", "--dtype", "bfloat16", "--no-weights",
               "--packed-experts", "--capacity", "131072"],
}
PHASES = ("setup", "capture", "decompose", "promote", "translate", "rest", "total")

# Runs in the child: wraps torch's phase functions with timers, runs the tree's CLI, prints the
# phases and the peak RSS as one JSON line on stderr's last line.
CHILD = r"""
import json, resource, sys, time
start = time.perf_counter()
import torch.export
from torch.onnx._internal.exporter import _core, _fx_passes
spans = {}
def timed(owner, name, phase):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spans.setdefault(phase, []).append((begin, time.perf_counter()))
    setattr(owner, name, wrapper)
timed(torch.export, "export", "capture")
timed(torch.export.ExportedProgram, "run_decompositions", "decompose")
timed(_fx_passes, "insert_type_promotion_nodes", "promote")
timed(_core, "_exported_program_to_onnx_program", "translate")
from k3export.cli import main
code = main(sys.argv[1:])
end = time.perf_counter()
phases = {p: sum(b - a for a, b in s) for p, s in spans.items()}
phases["setup"] = spans["capture"][0][0] - start
phases["rest"] = end - spans["translate"][-1][1]
phases["total"] = end - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"phases": phases, "peak_rss": peak}), file=sys.stderr)
sys.exit(code)
"""


def export_once(tree: Path, case: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-c", CHILD, "export", *CASES[case], "--out", str(Path(tmp) / "x"),
                   "--quiet"]
        result = subprocess.run(command, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                                capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{tree.name} {case}: exit {result.returncode}\n{result.stderr[-3000:]}")
    return json.loads(result.stderr.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare with")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    cases = args.cases.split(",")
    OUT.mkdir(parents=True, exist_ok=True)
    trees = dict(before=checkout(OUT, args.before), after=checkout(OUT, args.after))
    runs: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for case in cases:
            for side, (commit, tree) in trees.items():
                run = export_once(tree, case)
                runs.setdefault((case, side), []).append(run)
                print(f"round {round_ + 1} {case} {side} {commit}: {run['phases']['total']:.1f} s, "
                      f"peak {run['peak_rss'] / 1e6:.0f} MB", flush=True)

    def median(case: str, side: str, phase: str) -> float:
        return statistics.median(r["phases"].get(phase, 0.0) for r in runs[case, side])

    print(f"\nbefore {trees['before'][0]}, after {trees['after'][0]}; median of {args.rounds} rounds, "
          "seconds")
    print(f"| case | side | {' | '.join(PHASES)} | peak RSS MB |")
    print(f"|---|---|{'---:|' * (len(PHASES) + 1)}")
    for case in cases:
        for side in trees:
            cells = [f"{median(case, side, p):.2f}" for p in PHASES]
            peak = statistics.median(r["peak_rss"] for r in runs[case, side]) / 1e6
            print(f"| {case} | {side} | {' | '.join(cells)} | {peak:.0f} |")
        speedup = median(case, "before", "total") / median(case, "after", "total")
        print(f"| {case} | before/after | {speedup:.2f}x |" + " |" * len(PHASES))


if __name__ == "__main__":
    main()
