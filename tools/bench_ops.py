"""The k3 ops against their peers, measured side by side in one run (alternating rounds, the same
thread count), reported as ratios so that a machine shared with other work still compares fairly.

    python tools/bench_ops.py [--threads 2] [--repeats 5] [--only kda|moe]

KDA: the eager chunked form (`chunk_kda`, what prefill runs) against our token-by-token recurrence
and flash-linear-attention's pure-torch `naive_recurrent_kda` (a benchmark dependency only:
`pip install --no-deps fla-core==0.6.0 einops`), at B=1, T=2048, H=8, K=V=128, float32; in wall
and CPU time, each with the spread of the per-round ratios.

MoE: `torch.ops.k3.routed_experts` (only the chosen experts) against the dense dispatch the model ran
before it (every expert on every token, a combine matrix selecting), at E=64, k=4 and E=56, k=1 (the
published 896 / 16 ratio) with small widths, float32: time and the peak resident memory one call
adds (Linux VmHWM after resetting it), in eager and in ONNX Runtime (the k3.RoutedExperts function
against the dense form exported in standard ops).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from k3export.ops import chunk_kda, recurrent_kda
from k3export.ops.moe import situ_glu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference import kda_inputs, rel_error  # the tests' input generator


def alternating_rounds(runs: dict[str, Callable[[], object]], repeats: int,
                       clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of each run in each round (by `clock`), in alternating rounds after one warm-up each."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = clock()
            run()
            times[name].append(clock() - start)
    return times


def alternating_medians(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each run, measured in alternating rounds after one warm-up each."""
    return {name: statistics.median(t) for name, t in alternating_rounds(runs, repeats).items()}


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
    # Wall time, and the process's CPU time: on a machine shared with other work a run is
    # descheduled at random, which wall time counts and CPU time does not (with one thread; with
    # more, CPU time also counts threads waiting for each other).
    for clock_name, clock in (("wall", time.perf_counter), ("CPU", time.process_time)):
        with torch.no_grad():
            rounds = alternating_rounds(runs, repeats, clock)
        chunked = rounds["chunk_kda (k3export, chunked)"]
        print(f"\nKDA, B={B}, T={T}, H={H}, K=V={K}, float32, {torch.get_num_threads()} threads, "
              f"{clock_name} time, median of {repeats}; speed-up per round (its time over chunk_kda's in "
              f"the same round): median [lowest, highest]")
        print("| implementation | tokens/s | chunk_kda speed-up |\n|---|---|---|")
        for name, times in rounds.items():
            ratios = sorted(t / c for t, c in zip(times, chunked, strict=True))
            print(f"| {name} | {B * T / statistics.median(times):,.0f} | {statistics.median(ratios):.2f}x "
                  f"[{ratios[0]:.2f}, {ratios[-1]:.2f}] |")


class DenseExperts(torch.nn.Module):
    """The dense dispatch the model ran before k3.routed_experts: every expert on every token."""

    def __init__(self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = (torch.nn.Parameter(w, requires_grad=False) for w in (w1, w3, w2))

    def forward(self, z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        combine = torch.zeros(z.shape[0], self.w1.shape[0]).scatter(-1, experts, weights)
        a, b = z @ self.w1.transpose(1, 2), z @ self.w3.transpose(1, 2)  # [E, N, I]
        y = situ_glu(a, b, 4.0, 25.0) @ self.w2.transpose(1, 2)
        return (y * combine.T[..., None]).sum(0)


class RoutedExperts(DenseExperts):
    def forward(self, z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.k3.routed_experts(z, experts, weights, self.w1, self.w3, self.w2, 4.0, 25.0)


L_MOE, I_MOE = 448, 384  # the published 3584 : 3072, small


def moe_case(E: int, k: int, N: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Seeded experts (w1, w3, w2) and routing inputs (z, experts, weights) for one table row."""
    gen = torch.Generator().manual_seed(E * 100 + k)
    w1, w3 = (torch.randn(E, I_MOE, L_MOE, generator=gen) * L_MOE**-0.5 for _ in range(2))
    w2 = torch.randn(E, L_MOE, I_MOE, generator=gen) * I_MOE**-0.5
    gen = torch.Generator().manual_seed(N)
    z = torch.randn(N, L_MOE, generator=gen)
    experts = torch.rand(N, E, generator=gen).argsort(-1)[:, :k]
    weights = torch.rand(N, k, generator=gen)
    return (w1, w3, w2), (z, experts, weights / weights.sum(-1, keepdim=True))


def ort_session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_cpu_mem_arena = False  # memory goes back after each run: the peak is the call's
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def memory_child(E: int, k: int, N: int, form: str, onnx_path: str, threads: int) -> None:
    """Prints the resident memory (MB) one call adds at its peak, after a warm-up call (ONNX Runtime
    prepacks weights on its first run). Run in a fresh process with MALLOC_MMAP_THRESHOLD_ low, so
    that freed buffers leave the process and VmHWM (reset before the call) measures the call."""
    torch.set_num_threads(threads)
    weights, inputs = moe_case(E, k, N)
    if onnx_path:
        session = ort_session(Path(onnx_path), threads)
        feed = dict(zip(("z", "experts", "weights"), (x.numpy() for x in inputs), strict=True))

        def run() -> object:
            return session.run(None, feed)
    else:
        module = (RoutedExperts if form == "routed" else DenseExperts)(*weights).eval()

        def run() -> object:
            with torch.no_grad():
                return module(*inputs)

    def status(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
        return int(line.split()[1])

    run()
    Path("/proc/self/clear_refs").write_text("5")
    base = status("VmRSS:")
    run()
    print((status("VmHWM:") - base) / 1024)


def peak_mb(E: int, k: int, N: int, form: str, onnx_path: Path | None, threads: int) -> float:
    command = [sys.executable, __file__, "--memory-child", str(E), str(k), str(N), form,
               str(onnx_path or ""), str(threads)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


def bench_moe(repeats: int, threads: int) -> None:
    from k3export.onnx.ops import export_onnx

    print(f"\nMoE routed experts, L={L_MOE}, I={I_MOE}, float32, {threads} threads, median of {repeats}; "
          f"MB: the resident memory one call adds at its peak (own process)")
    print("| E | k | tokens | backend | routed ms | dense ms | speed-up | routed MB | dense MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for E, k in ((64, 4), (56, 1)):
        with tempfile.TemporaryDirectory() as tmp:
            expert_weights, _ = moe_case(E, k, 1)
            modules = {"routed": RoutedExperts(*expert_weights).eval(),
                       "dense": DenseExperts(*expert_weights).eval()}
            paths = {}
            for name, module in modules.items():
                paths[name] = Path(tmp) / f"{name}.onnx"
                example = (torch.randn(5, L_MOE), torch.zeros(5, k, dtype=torch.long), torch.ones(5, k) / k)
                export_onnx(module, example, paths[name],
                            dynamic_shapes=({0: "tokens"}, {0: "tokens", 1: "k"}, {0: "tokens", 1: "k"}))
            sessions = {name: ort_session(path, threads) for name, path in paths.items()}
            for N in (1, 512):
                _, inputs = moe_case(E, k, N)
                feed = dict(zip(("z", "experts", "weights"), (x.numpy() for x in inputs), strict=True))
                runs = {
                    "eager": {name: (lambda m=m, x=inputs: m(*x)) for name, m in modules.items()},
                    "ONNX Runtime": {name: (lambda s=s, f=feed: s.run(None, f))
                                     for name, s in sessions.items()},
                }
                u_routed = runs["ONNX Runtime"]["routed"]()[0]
                with torch.no_grad():
                    assert rel_error(torch.from_numpy(u_routed), modules["dense"](*inputs)) < 1e-5
                for backend, pair in runs.items():
                    with torch.no_grad():
                        seconds = alternating_medians(pair, repeats)
                    onnx_paths = paths if backend == "ONNX Runtime" else dict.fromkeys(paths)
                    memory = {name: peak_mb(E, k, N, name, onnx_paths[name], threads) for name in pair}
                    print(f"| {E} | {k} | {N} | {backend} | {seconds['routed'] * 1e3:.2f} | "
                          f"{seconds['dense'] * 1e3:.2f} | {seconds['dense'] / seconds['routed']:.1f}x | "
                          f"{memory['routed']:.1f} | {memory['dense']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["kda", "moe"])
    parser.add_argument("--memory-child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        E, k, N, form, onnx_path, threads = args.memory_child
        memory_child(int(E), int(k), int(N), form, onnx_path, int(threads))
        return
    torch.set_num_threads(args.threads)
    print("$ python tools/bench_ops.py " + shlex.join(sys.argv[1:]))
    print(f"torch {torch.__version__}")
    if args.only in (None, "kda"):
        bench_kda(args.repeats)
    if args.only in (None, "moe"):
        bench_moe(args.repeats, args.threads)


if __name__ == "__main__":
    main()
