"""Peak resident memory of each stage build against that stage's weight bytes.

    python tools/stage_memory.py [--recipe engines/k3-small.toml] [--stages 2 4] [--backend onnx]

Every stage is built alone in a fresh child process (`build_recipe(..., only=[i])` into an empty
folder), and its peak RSS is the kernel's own count for that child (os.wait4's ru_maxrss), which
misses no short-lived peak the way sampling can. If a stage build is bounded by its own weights,
peak - weights stays about the same across stages and stage counts: the fixed overhead (Python,
torch, the exporter); a TensorRT-RTX build holds the parser's copy of the weights on top.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time

from k3export.plan import plan_recipe
from k3export.recipe import load_recipe

CHILD = """
import dataclasses, sys
from k3export.recipe import load_recipe
from k3export.stages import build_recipe
recipe = dataclasses.replace(load_recipe(sys.argv[1]), stage_count=int(sys.argv[2]), stage_ranges=None)
build_recipe(recipe, sys.argv[3], backend=sys.argv[4], only=[int(sys.argv[5])], log=lambda _: None)
"""


def peak_rss(command: list[str]) -> tuple[int, float]:
    """(peak resident bytes, seconds) of a child process run to completion."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{child.stderr.read().decode()[-3000:]}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start  # kilobytes on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="engines/k3-small.toml")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--backend", default="onnx", choices=["onnx", "tensorrt-rtx"])
    args = parser.parse_args()

    recipe = load_recipe(args.recipe)
    print(f"{args.recipe} ({recipe.config.num_hidden_layers} layers, {recipe.dtype}), backend "
          f"{args.backend}: peak RSS of each stage build, each in its own process")
    print("stages  stage  layers  weights MB  peak RSS MB  peak - weights MB  peak / weights  seconds")
    for count in args.stages:
        plan = plan_recipe(dataclasses.replace(recipe, stage_count=count, stage_ranges=None))
        for stage in plan.stages:
            with tempfile.TemporaryDirectory() as tmp:
                peak, seconds = peak_rss([sys.executable, "-c", CHILD, args.recipe, str(count), tmp,
                                          args.backend, str(stage.index)])
            w = stage.weight_bytes
            print(f"{count:>6}  {stage.index:>5}  {stage.layers.start:>2}-{stage.layers.stop - 1:<3}  "
                  f"{w / 1e6:>10.0f}  {peak / 1e6:>11.0f}  {(peak - w) / 1e6:>17.0f}  {peak / w:>14.2f}  "
                  f"{seconds:>7.0f}", flush=True)


if __name__ == "__main__":
    main()
