"""The k3 ops against their peers, measured side by side in one run (alternating rounds, the same
thread count), reported as ratios so that a machine shared with other work still compares fairly.

    python tools/bench_ops.py [--threads 2] [--repeats 5] [--only kda|moe]

KDA: the eager chunked form (`chunk_kda`, what prefill runs) against our token-by-token recurrence
and flash-linear-attention's pure-torch `naive_recurrent_kda` (a benchmark dependency only:
`pip install --no-deps fla-core==0.6.0 einops`), at B=1, T=2048, H=8, K=V=128, float32.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from k3export.ops import chunk_kda, recurrent_kda

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference import kda_inputs, rel_error  # the tests' input generator


def alternating_medians(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each run, measured in alternating rounds after one warm-up each."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_kda(repeats: int) -> None:
    B, T, H, K = 1, 2048, 8, 128
    inputs = kda_inputs(B, T, H, K, K, torch.float32)
    runs: dict[str, Callable[[], object]] = {
        "chunk_kda (k3export, chunked)": lambda: chunk_kda(*inputs),
        "recurrent_kda (k3export)": lambda: recurrent_kda(*inputs),
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fla warns that Triton has no CPU backend
            from fla.ops.kda.naive import naive_recurrent_kda
    except ImportError:
        print("flash-linear-attention is not installed: pip install --no-deps fla-core==0.6.0 einops")
    else:
        # Our q is already scaled: scale=1 makes fla's contract ours.
        runs["naive_recurrent_kda (fla 0.6.0)"] = lambda: naive_recurrent_kda(
            *inputs[:5], scale=1.0, initial_state=inputs[5], output_final_state=True)
        o_ref, s_ref = runs["naive_recurrent_kda (fla 0.6.0)"]()
        o, s = chunk_kda(*inputs)
        print(f"chunk_kda vs fla's naive_recurrent_kda: relative error o {rel_error(o, o_ref):.1e}, "
              f"state {rel_error(s, s_ref):.1e}")
    with torch.no_grad():
        seconds = alternating_medians(runs, repeats)
    chunked = seconds["chunk_kda (k3export, chunked)"]
    print(f"\nKDA, B={B}, T={T}, H={H}, K=V={K}, float32, {torch.get_num_threads()} threads, "
          f"median of {repeats}")
    print("| implementation | tokens/s | chunk_kda speed-up |\n|---|---|---|")
    for name, s in seconds.items():
        print(f"| {name} | {B * T / s:,.0f} | {s / chunked:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["kda", "moe"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("$ python tools/bench_ops.py " + shlex.join(sys.argv[1:]))
    print(f"torch {torch.__version__}")
    if args.only in (None, "kda"):
        bench_kda(args.repeats)


if __name__ == "__main__":
    main()
