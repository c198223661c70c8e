"""Prefill and decode tokens/s of one model unsplit (N = 1, one process) and split over N ranks
(k3export/model/parallel.py; N processes under torchrun, gloo), each rank's graph in ONNX Runtime pieces with
torch.distributed sums between them (k3export.runtime.segments), and where the time goes.

    python tools/bench_parallel.py --preset k3-small --out /tmp/bench --ranks 2 --threads 2

Exports (once, reused when OUT holds them) the unsplit model to OUT/n1 and each rank to
OUT/n{N}/rank-{r}. The unsplit model runs with --threads intra-op threads; each rank with
threads / N, so both use the same cores. float32 (the sums go through numpy).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from k3export.cli import main as k3export
from k3export.exits import run_to_end
from k3export.onnx.runner import PAST, PRESENT, Signature
from k3export.runtime.segments import SegmentedGraph


def export(args: argparse.Namespace, out: Path, ranks: int, rank: int) -> None:
    if not (out / "export.json").exists():
        assert k3export(["export", "--preset", args.preset, "--dtype", "float32", "--seed", "0",
                         "--capacity", str(args.prompt_len + args.decode_steps + 8), "--ranks", str(ranks),
                         "--rank", str(rank), "--out", str(out), "--quiet"]) == 0


def run(folder: Path, args: argparse.Namespace, threads: int) -> dict[str, float]:
    """A prefill of `prompt_len` tokens then `decode_steps` greedy steps (batch 1); seconds of each,
    and of the graph's pieces and sums over both."""
    signature = Signature(json.loads((folder / "export.json").read_text()))
    graph = SegmentedGraph(folder / "model.onnx", threads=threads)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab, (1, args.prompt_len))
    caches, cache_lengths = signature.empty_caches(1), np.zeros(1, dtype=np.int64)
    seconds = {}
    for phase, steps in (("prefill", 1), ("decode", args.decode_steps)):
        start = time.perf_counter()
        for _ in range(steps):
            lengths = np.array([ids.shape[1]])
            results = graph({"input_ids": ids, "cache_lengths": cache_lengths, "input_lengths": lengths,
                             **caches})
            caches = {PAST + k.removeprefix(PRESENT): v for k, v in results.items() if k.startswith(PRESENT)}
            cache_lengths = cache_lengths + lengths
            ids = results["logits"][:, -1:].argmax(-1)
        seconds[phase] = time.perf_counter() - start
    return {**seconds, "pieces": graph.compute_seconds, "sums": graph.collective_seconds}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    ranks = dist.get_world_size()
    result = run(Path(args.worker) / f"rank-{dist.get_rank()}", args, max(1, args.threads // ranks))
    every = [None] * ranks
    dist.all_gather_object(every, result)
    if dist.get_rank() == 0:
        print(json.dumps(every))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="k3-small")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_parallel"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="cores in all")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a rank's process under torchrun
    args = parser.parse_args()
    if args.worker:
        run_to_end(lambda: worker(args))  # a gloo process ends so (k3export.exits)
    split_dir = args.out / f"n{args.ranks}"
    export(args, args.out / "n1", 1, 0)
    for rank in range(args.ranks):
        export(args, split_dir / f"rank-{rank}", args.ranks, rank)
    rows = [("1", [run(args.out / "n1", args, args.threads)])]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), __file__,
                           "--worker", str(split_dir), *sys.argv[1:]],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    rows.append((str(args.ranks), json.loads(proc.stdout.strip().splitlines()[-1])))
    print(f"{args.preset}, float32, batch 1, prompt {args.prompt_len} tokens, {args.decode_steps} decode "
          f"steps, {args.threads} cores in all")
    print("ranks  prefill tok/s  decode tok/s  per rank: ONNX Runtime pieces s  torch.distributed sums s")
    for ranks, results in rows:
        slowest = max(results, key=lambda r: r["prefill"] + r["decode"])
        pieces = "/".join(f"{r['pieces']:.2f}" for r in results)
        sums = "/".join(f"{r['sums']:.2f}" for r in results)
        print(f"{ranks:>5}  {args.prompt_len / slowest['prefill']:>13.1f}  "
              f"{args.decode_steps / slowest['decode']:>12.1f}  {pieces:>30}  {sums:>24}")


if __name__ == "__main__":
    main()
