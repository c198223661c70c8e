"""Decode milliseconds per token in ONNX Runtime against the cache length: concatenated caches
(before) against fixed-capacity caches written in place (after), side by side in one run.

    python tools/bench_decode.py [--out out/bench-decode] [--lengths 64,1024,4096,16384]
                                 [--threads 1] [--repeats 15] [--before REV] [--after REV]

Both sides are exported from `git worktree` checkouts of two commits, in subprocesses, so that
nothing uncommitted in this working tree (another change in progress) enters either side.
before: the graphs of REV (default: the last commit with concatenated caches):
past.{i}.mla_latent [batch, past, latent] comes in and goes out one row longer through a Concat,
run with session.run.
after: the graphs of REV (default HEAD): [batch, 1, capacity, latent] caches (capacity = the
longest length) written by TensorScatter, run two ways: session.run, where ONNX Runtime copies
past to present, and IO binding with past and present bound to one OrtValue, where it writes the
new row in place (the KDA states and conv tails go to preallocated buffers).
Two graphs each: k3-small (float32, batch 1, all layers) and one MLA mixer alone (k3-small's
first MLA layer, built from the model's own module), so that the MoE does not hide the cache
traffic. A step at length L attends over L rows (it holds L - 1 and writes one). Exports are kept
in --out and reused.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from revisions import checkout, moved, run_in
from torch import Tensor, nn

MIXER_FILE = "mixer.onnx"
# The commit before the serving-shaped graphs (94e90cd): the last with concatenated caches.
BEFORE = "94e90cd^"


class Mixer(nn.Module):
    """One MLA layer with its cache as flat tensors, in this checkout's form (capacity, lengths)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor, cache_lengths: Tensor, input_lengths: Tensor,
                past: Tensor) -> tuple[Tensor, Tensor]:
        from k3export.model import MLACache

        y, cache = self.layer(x, MLACache(past), cache_lengths, input_lengths)
        return y, cache.mla_latent


class ConcatMixer(Mixer):
    """The same layer in the old checkout's form: the cache concatenated with the new rows."""

    def forward(self, x: Tensor, past: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        from k3export.model import MLACache

        y, cache = self.layer(x, MLACache(past))
        return y, cache.mla_latent


def export_mixer(out: Path, capacity: int) -> None:
    """k3-small's first MLA layer alone, as the importable k3export defines it (this checkout's, or
    the old one's when PYTHONPATH points at its worktree)."""
    from k3export.config import K3Config
    from k3export.model.mla import LatentMLA
    from k3export.onnx.ops import export_onnx

    build_model = moved("build_model", "k3export.weights.checkpoint", "k3export.checkpoint")

    config = K3Config.from_preset("k3-small")
    index = config.mla_layers[0]
    model = build_model(config, torch.float32, {"seed": 0}, range(index, index + 1))
    layer = model.model.layers[index].self_attn
    x = torch.randn(2, 3, config.hidden_size)
    batch_seq, batch = {0: "batch", 1: "seq"}, {0: "batch"}
    if "cache_lengths" in inspect.signature(LatentMLA.forward).parameters:
        module, names = Mixer(layer), ["x", "cache_lengths", "input_lengths", "past.0.mla_latent"]
        past = torch.zeros(2, 1, capacity, config.latent_dim)
        args = (x, torch.zeros(2, dtype=torch.int64), torch.full((2,), 3), past)
        shapes, opset = (batch_seq, batch, batch, batch), 24
    else:
        module, names = ConcatMixer(layer), ["x", "past.0.mla_latent"]
        args, opset = (x, torch.zeros(2, 5, config.latent_dim)), None
        shapes = (batch_seq, {0: "batch", 1: "past"})
    with torch.no_grad():
        export_onnx(module.eval(), args, out / MIXER_FILE, dynamic_shapes=shapes, opset_version=opset,
                    input_names=names, output_names=["y", "present.0.mla_latent"])


def exports(out: Path, before: str, after: str, capacity: int,
            graphs: list[str]) -> dict[tuple[str, str], Path]:
    """The graphs, exported unless already there: (graph, 'before' | 'after') -> ONNX file."""
    paths = {}
    sides = (("before", *checkout(out, before), []),
             ("after", *checkout(out, after), ["--capacity", str(capacity)]))
    for when, commit, tree, cap_args in sides:
        folder = out / f"{when}-{commit}" / (f"capacity-{capacity}" if cap_args else "")
        small, mixer = folder / "k3-small", folder / "mixer"
        if "k3-small" in graphs and not (small / "export.json").exists():
            print(f"exporting k3-small ({when}) to {small} ...", flush=True)
            run_in(tree, "-m", "k3export.cli", "export", "--preset", "k3-small", "--dtype", "float32",
                   "--out", str(small), *cap_args)
        if "mixer" in graphs and not (mixer / MIXER_FILE).exists():
            print(f"exporting one MLA mixer ({when}) to {mixer} ...", flush=True)
            mixer.mkdir(parents=True, exist_ok=True)
            run_in(tree, str(Path(__file__).resolve()), "--export-mixer", str(mixer),
                   "--capacity", str(capacity))
        paths["k3-small", when], paths["mixer", when] = small / "model.onnx", mixer / MIXER_FILE
    return paths


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    # Idle workers sleep instead of spinning, so that CPU time counts work, not waiting.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # session.run on a TensorScatter warns of its copy on every call
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feed(sess: ort.InferenceSession, rows: int) -> dict[str, np.ndarray]:
    """A decode step (batch 1, one token) whose cache holds rows - 1 tokens: random activations and
    caches, token 1, lengths. Concatenated caches have rows - 1 rows; fixed ones their capacity."""
    gen = np.random.default_rng(0)
    sizes = {"batch": 1, "seq": 1, "past": rows - 1}
    values = {"cache_lengths": rows - 1, "input_lengths": 1, "input_ids": 1}
    tensors = {}
    for i in sess.get_inputs():
        shape = [sizes[d] if isinstance(d, str) else d for d in i.shape]
        if i.type == "tensor(int64)":
            tensors[i.name] = np.full(shape, values[i.name], np.int64)
        else:
            tensors[i.name] = (gen.standard_normal(shape) * 0.5).astype(np.float32)
    return tensors


def bound(sess: ort.InferenceSession, tensors: dict[str, np.ndarray]) -> ort.IOBinding:
    """IO binding: each present MLA cache is its past's OrtValue; other caches get their own buffer."""
    binding = sess.io_binding()
    values = {name: ort.OrtValue.ortvalue_from_numpy(x) for name, x in tensors.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    for o in sess.get_outputs():
        past = o.name.replace("present.", "past.", 1)
        if o.name.endswith("mla_latent"):
            binding.bind_ortvalue_output(o.name, values[past])
        elif past in values:
            spare = ort.OrtValue.ortvalue_from_numpy(np.empty_like(tensors[past]))
            binding.bind_ortvalue_output(o.name, spare)
        else:
            binding.bind_output(o.name, "cpu")
    return binding


def time_step(before: ort.InferenceSession, after: ort.InferenceSession, rows: int,
              repeats: int) -> dict[str, float]:
    """Milliseconds of one decode step at `rows` in the three ways, timed alternately so that
    drifts in the machine's load hit all three alike: the median of `repeats` in CPU time of this
    process (all its threads), which other jobs on a shared machine disturb far less than wall
    time, and the median wall time beside it."""
    old_feed, new_feed = feed(before, rows), feed(after, rows)
    binding = bound(after, new_feed)
    runs = {"before": lambda: before.run(None, old_feed),
            "after, session.run": lambda: after.run(None, new_feed),
            "after, IO binding": lambda: after.run_with_iobinding(binding)}
    for run in runs.values():
        run()  # warm-up
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    return {**{name: statistics.median(t) * 1e3 for name, t in cpu.items()},
            **{f"{name} (wall)": statistics.median(t) * 1e3 for name, t in wall.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/bench-decode",
                        help="exports (made if absent) and the old checkout")
    parser.add_argument("--lengths", default="64,1024,4096,16384", help="cache rows attended by the step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--before", default=BEFORE, help="the commit whose graphs are 'before'")
    parser.add_argument("--after", default="HEAD", help="the commit whose graphs are 'after'")
    parser.add_argument("--graphs", default="mixer,k3-small", help="which graphs to time")
    parser.add_argument("--export-mixer", metavar="DIR", help=argparse.SUPPRESS)  # run in a checkout
    parser.add_argument("--capacity", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.export_mixer:
        export_mixer(Path(args.export_mixer), args.capacity)
        return

    lengths = [int(n) for n in args.lengths.split(",")]
    out = Path(args.out).resolve()
    graphs = args.graphs.split(",")
    paths = exports(out, args.before, args.after, max(lengths), graphs)
    results = []
    for graph in graphs:
        before = session(paths[graph, "before"], args.threads)
        after = session(paths[graph, "after"], args.threads)
        for rows in lengths:
            ms = time_step(before, after, rows, args.repeats)
            results.append((graph, rows, ms))
            print(f"{graph} {rows}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), flush=True)

    print(f"\nONNX Runtime {ort.__version__}, float32, batch 1, one decode step, {args.threads} thread(s), "
          f"median of {args.repeats} in CPU time (wall time in parentheses); capacity {max(lengths)}; "
          f"before = {args.before}, after = {args.after}\n")
    print("| graph | cache rows | before: Concat (ms) | after: TensorScatter, session.run (ms) | "
          "after: TensorScatter, IO binding (ms) | before / after (IO binding) |")
    print("|---|---|---|---|---|---|")
    for graph, rows, ms in results:
        cells = [f"{ms[k]:.2f} ({ms[k + ' (wall)']:.2f})" for k in ("before", "after, session.run",
                                                                    "after, IO binding")]
        print(f"| {'one MLA mixer' if graph == 'mixer' else graph} | {rows} | {' | '.join(cells)} | "
              f"{ms['before'] / ms['after, IO binding']:.2f}x |")


if __name__ == "__main__":
    main()
