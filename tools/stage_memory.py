"""Peak resident memory of each stage build against that stage's weight bytes.

    python tools/stage_memory.py [--recipe engines/k3-small.toml] [--stages 2 4]
                                 [--backend onnx tensorrt-rtx:before tensorrt-rtx]

Every stage is built alone in a fresh child process (`build_recipe(..., only=[i])` into an empty
folder), and its peak RSS is the kernel's own count for that child (os.wait4's ru_maxrss), which
misses no short-lived peak the way sampling can. If a stage build is bounded by its own weights,
peak - weights stays about the same across stages and stage counts: the fixed overhead (Python,
torch, the exporter); a TensorRT-RTX build holds the parser's copy of the weights on top.

`tensorrt-rtx:before` is the TensorRT-RTX build as it was before its memory fixes, put back in the
child by two patches: the exporter's last graph is not released (stages._release_exporter_graph
does only its gc.collect) and the engine is serialized whole into an IHostMemory and then written
(build_serialized_network) instead of streamed to the file. `tensorrt-rtx:unreleased` and
`tensorrt-rtx:unstreamed` apply one patch each, to tell what each fix saves. The backends of one
stage run one after the other, so a before/after pair sees the same machine load. With `onnx` among
them, `copies` is (peak - (the onnx build's peak - weights)) / weights: how many copies of the
stage's weights a TensorRT-RTX build holds over the export's fixed overhead, for the same stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time

from k3export.shards.plan import plan_recipe
from k3export.shards.recipe import load_recipe

CHILD = """
import dataclasses, gc, sys
from k3export.shards import stages
from k3export.shards.recipe import load_recipe
backend, _, variant = sys.argv[4].partition(":")
if variant in ("before", "unreleased"):
    stages._release_exporter_graph = gc.collect
if variant in ("before", "unstreamed"):
    from k3export.engine.flavours import load_tensorrt
    def whole(builder, network, config, writer):
        serialized = builder.build_serialized_network(network, config)
        return serialized is not None and writer.write(memoryview(serialized)) == serialized.nbytes
    load_tensorrt().Builder.build_serialized_network_to_stream = whole
recipe = dataclasses.replace(load_recipe(sys.argv[1]), stage_count=int(sys.argv[2]), stage_ranges=None)
stages.build_recipe(recipe, sys.argv[3], backend=backend, only=[int(sys.argv[5])], log=lambda _: None)
"""
BACKENDS = ("onnx", "tensorrt-rtx:before", "tensorrt-rtx:unreleased", "tensorrt-rtx:unstreamed",
            "tensorrt-rtx")


def peak_rss(command: list[str]) -> tuple[int, float, str]:
    """(peak resident bytes, seconds, what it printed: a line or two) of a child process run to
    completion."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{child.stderr.read().decode()[-3000:]}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start, child.stdout.read().decode()  # KB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="engines/k3-small.toml")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--backend", nargs="+", default=["onnx"], choices=BACKENDS,
                        help="one or more, run in this order for each stage")
    args = parser.parse_args()

    recipe = load_recipe(args.recipe)
    print(f"{args.recipe} ({recipe.config.num_hidden_layers} layers, {recipe.dtype}): peak RSS of each "
          f"stage build, each in its own process; MB = 1e6 bytes")
    head = "stages  stage  layers  weights MB"
    for backend in args.backend:
        head += f"  | {backend}: peak MB  peak-w  peak/w" + ("  copies" if _copies(args, backend) else "")
    print(head + "  | seconds")
    points: dict[str, list[tuple[int, int]]] = {backend: [] for backend in args.backend}
    for count in args.stages:
        plan = plan_recipe(dataclasses.replace(recipe, stage_count=count, stage_ranges=None))
        for stage in plan.stages:
            w = stage.weight_bytes
            layers = f"{stage.layers.start:>2}-{stage.layers.stop - 1:<3}"
            row = f"{count:>6}  {stage.index:>5}  {layers}  {w / 1e6:>10.0f}"
            peaks, times = {}, []
            for backend in args.backend:
                with tempfile.TemporaryDirectory() as tmp:
                    peak, seconds, _ = peak_rss([sys.executable, "-c", CHILD, args.recipe, str(count), tmp,
                                              backend, str(stage.index)])
                peaks[backend] = peak
                points[backend].append((w, peak))
                times.append(f"{seconds:.0f}")
                pad = " " * len(backend)
                row += f"  | {pad}{peak / 1e6:>9.0f}  {(peak - w) / 1e6:>6.0f}  {peak / w:>6.2f}"
                if _copies(args, backend):
                    row += f"  {(peak - peaks['onnx'] + w) / w:>6.2f}"
            print(row + "  | " + " ".join(times), flush=True)
    # Least squares over every stage: the slope is the copies of the weights a build holds, the
    # intercept its fixed overhead, whatever the stage's size.
    for backend, xy in points.items():
        n, sx, sy = len(xy), sum(x for x, _ in xy), sum(y for _, y in xy)
        sxx, sxy = sum(x * x for x, _ in xy), sum(x * y for x, y in xy)
        if n > 1 and n * sxx != sx * sx:
            slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
            print(f"{backend}: peak RSS = {(sy - slope * sx) / n / 1e6:.0f} MB + {slope:.2f} x weights "
                  f"(least squares over {n} stage builds)")


def _copies(args: argparse.Namespace, backend: str) -> bool:
    """Whether the `copies` column is shown for `backend`: a TensorRT build after an onnx one."""
    return backend != "onnx" and "onnx" in args.backend[:args.backend.index(backend)]


if __name__ == "__main__":
    main()
