"""ONNX Runtime against the eager model on k3-small: prefill tokens/s and decode ms/token, measured
in one run (for each shape a warm-up and the median of --repeats runs, eager then ONNX Runtime,
same thread count), reported as ratios.

    python tools/bench_onnx.py [--onnx DIR] [--threads 2]

Exports k3-small (float32: ONNX Runtime's CPU provider has no bfloat16 MatMul) to DIR unless DIR
already holds that export. ONNX Runtime's worker threads do not spin, so they leave the eager
model's threads alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from k3export.checkpoint import build_model
from k3export.config import K3Config
from k3export.onnx.check import onnxrt_session
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE, ExportGraph, example_inputs, export_model


def median_seconds(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--onnx", default="out/bench-k3-small", help="export folder (made if absent)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", default="64,256,1024", help="prompt lengths")
    parser.add_argument("--past", default="0,512,2048", help="cached tokens for the decode steps")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    config = K3Config.from_preset("k3-small")
    weights = {"seed": 0}
    model = build_model(config, torch.float32, weights)
    out = Path(args.onnx)
    manifest = json.loads((out / MANIFEST_FILE).read_text()) if (out / MANIFEST_FILE).exists() else {}
    if "capacity" not in manifest:  # absent, or an export from before fixed-capacity caches
        print(f"exporting k3-small (float32) to {out} ...", flush=True)
        manifest = export_model(model, out, weights=weights)
    capacity = manifest["capacity"]
    graph = ExportGraph(model, range(config.num_hidden_layers))
    session = onnxrt_session(out / GRAPH_FILE, threads=args.threads)
    names = [i.name for i in session.get_inputs()]

    def timed_pair(batch: int, seq: int, past: int) -> tuple[float, float]:
        inputs = list(example_inputs(config, graph.layers, torch.float32, batch, seq, capacity))
        gen = torch.Generator().manual_seed(0)
        inputs[0] = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        inputs[1], inputs[2] = torch.full((batch,), past), torch.full((batch,), seq)  # cache, input lengths
        inputs[3:] = [torch.randn(x.shape, generator=gen) * 0.5 for x in inputs[3:]]
        feed = {n: x.numpy() for n, x in zip(names, inputs, strict=True)}

        def eager() -> None:
            with torch.no_grad():
                graph(*inputs)

        def onnxrt() -> None:
            session.run(None, feed)

        return median_seconds(eager, args.repeats), median_seconds(onnxrt, args.repeats)

    rows = []
    for seq in (int(s) for s in args.prefill.split(",")):
        eager, onnxrt = timed_pair(1, seq, 0)
        rows.append(("prefill", f"{seq} tokens", "tokens/s", seq / eager, seq / onnxrt, eager / onnxrt))
    for past in (int(p) for p in args.past.split(",")):
        eager, onnxrt = timed_pair(1, 1, past)
        rows.append(("decode", f"past {past}", "ms/token", eager * 1e3, onnxrt * 1e3, eager / onnxrt))

    print(f"\nk3-small float32, batch 1, {args.threads} threads, median of {args.repeats} "
          f"(torch {torch.__version__}, onnxruntime {__import__('onnxruntime').__version__})\n")
    print("| phase | shape | unit | eager | ONNX Runtime | ONNX Runtime speed-up |")
    print("|---|---|---|---|---|---|")
    for phase, shape, unit, eager, onnxrt, speedup in rows:
        print(f"| {phase} | {shape} | {unit} | {eager:.1f} | {onnxrt:.1f} | {speedup:.2f}x |")


if __name__ == "__main__":
    main()
