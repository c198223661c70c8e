"""ONNX Runtime against the eager model on k3-small: prefill tokens/s and decode ms/token, measured
in one run (for each shape a warm-up and the median of --repeats runs, eager then ONNX Runtime,
same thread count), reported as ratios.

    python tools/bench_onnx.py [--onnx DIR] [--threads 2]
    python tools/bench_onnx.py --before REV [--after REV] [--rounds 2]

Exports k3-small (float32: ONNX Runtime's CPU provider has no bfloat16 MatMul) to DIR unless DIR
already holds that export. ONNX Runtime's worker threads do not spin, so they leave the eager
model's threads alone.

With --before, the same measurement runs on two commits (`git worktree` checkouts, each its own
export under out/bench-onnx/), alternating before and after for --rounds rounds so that drifts in
the machine's load hit both alike; each cell is the median over the rounds, and the table gives
after / before for eager and ONNX Runtime.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from revisions import checkout, moved, run_in

OUT = Path("out/bench-onnx")


def median_seconds(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(onnx_dir: Path, threads: int, prefill: list[int], pasts: list[int],
            repeats: int) -> list[dict]:
    """One row per shape: phase, shape, unit and the eager and ONNX Runtime figures (tokens/s for
    prefill, ms/token for decode)."""
    from k3export.config import K3Config
    from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE, ExportGraph, example_inputs, export_model

    build_model = moved("build_model", "k3export.weights.checkpoint", "k3export.checkpoint")
    onnxrt_session = moved("onnxrt_session", "k3export.onnx.runner", "k3export.onnx.check")

    torch.set_num_threads(threads)
    config = K3Config.from_preset("k3-small")
    weights = {"seed": 0}
    model = build_model(config, torch.float32, weights)
    manifest_file = onnx_dir / MANIFEST_FILE
    manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else {}
    if "capacity" not in manifest:  # absent, or an export from before fixed-capacity caches
        print(f"exporting k3-small (float32) to {onnx_dir} ...", flush=True)
        manifest = export_model(model, onnx_dir, weights=weights)
    capacity = manifest["capacity"]
    graph = ExportGraph(model, range(config.num_hidden_layers))
    session = onnxrt_session(onnx_dir / GRAPH_FILE, threads=threads)
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

        return median_seconds(eager, repeats), median_seconds(onnxrt, repeats)

    rows = []
    for seq in prefill:
        eager, onnxrt = timed_pair(1, seq, 0)
        rows.append({"phase": "prefill", "shape": f"{seq} tokens", "unit": "tokens/s",
                     "eager": seq / eager, "onnxrt": seq / onnxrt})
    for past in pasts:
        eager, onnxrt = timed_pair(1, 1, past)
        rows.append({"phase": "decode", "shape": f"past {past}", "unit": "ms/token",
                     "eager": eager * 1e3, "onnxrt": onnxrt * 1e3})
    return rows


def speedup(unit: str, new: float, old: float) -> float:
    """How many times faster `new` is than `old` (tokens/s grow, ms/token shrink)."""
    return new / old if unit == "tokens/s" else old / new


def compare(args: argparse.Namespace, options: list[str]) -> None:
    """The measurement on two commits, alternated for args.rounds rounds."""
    sides = {}
    for when, rev in (("before", args.before), ("after", args.after)):
        commit, tree = checkout(OUT.resolve(), rev)
        sides[when] = (commit, tree, OUT.resolve() / f"k3-small-{commit}")
    runs: dict[str, list[list[dict]]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        for when, (commit, tree, onnx_dir) in sides.items():
            print(f"round {round_ + 1}/{args.rounds}: {when} ({commit}) ...", flush=True)
            out = run_in(tree, str(Path(__file__).resolve()), "--json", "--onnx", str(onnx_dir), *options,
                         capture=True)
            runs[when].append(json.loads(out.splitlines()[-1]))
    merged = []
    for i, row in enumerate(runs["after"][0]):
        merged.append({**row, **{f"{backend} {when}": statistics.median(r[i][backend] for r in runs[when])
                                 for when in runs for backend in ("eager", "onnxrt")}})
    print(f"\nk3-small float32, batch 1, {args.threads} threads, median of {args.repeats} per run, median of "
          f"{args.rounds} alternating runs; before = {args.before} ({sides['before'][0]}), after = "
          f"{args.after} ({sides['after'][0]})\n")
    print("| phase | shape | unit | eager before | eager after | eager after/before | ONNX Runtime before "
          "| ONNX Runtime after | ONNX Runtime after/before |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in merged:
        cells = []
        for backend in ("eager", "onnxrt"):
            before, after = row[f"{backend} before"], row[f"{backend} after"]
            cells += [f"{before:.1f}", f"{after:.1f}", f"{speedup(row['unit'], after, before):.2f}x"]
        print(f"| {row['phase']} | {row['shape']} | {row['unit']} | {' | '.join(cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--onnx", default="out/bench-k3-small", help="export folder (made if absent)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", default="64,256,1024", help="prompt lengths")
    parser.add_argument("--past", default="0,512,2048", help="cached tokens for the decode steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", metavar="REV", help="compare this commit (before) with --after")
    parser.add_argument("--after", metavar="REV", default="HEAD")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each side (--before)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one side, for --before
    args = parser.parse_args()
    options = ["--threads", str(args.threads), "--prefill", args.prefill, "--past", args.past,
               "--repeats", str(args.repeats)]
    if args.before:
        compare(args, options)
        return
    rows = measure(Path(args.onnx), args.threads, [int(s) for s in args.prefill.split(",")],
                   [int(p) for p in args.past.split(",")], args.repeats)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"\nk3-small float32, batch 1, {args.threads} threads, median of {args.repeats} "
          f"(torch {torch.__version__}, onnxruntime {__import__('onnxruntime').__version__})\n")
    print("| phase | shape | unit | eager | ONNX Runtime | ONNX Runtime speed-up |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['phase']} | {row['shape']} | {row['unit']} | {row['eager']:.1f} | "
              f"{row['onnxrt']:.1f} | {speedup(row['unit'], row['onnxrt'], row['eager']):.2f}x |")


if __name__ == "__main__":
    main()
