"""One rank of tests/test_parallel_grid.py's checking-outputs parity: for each case of SPEC (a served
rank graph and the same graph with check's outputs, export --routing-outputs), the prefill of a
ragged batch from empty caches, and what the test asserts, written to OUT/rank-{r}.json:

- ONNX Runtime (float32, float16: the runtime's pieces, k3export.runtime.segments, sums over gloo):
  whether every served output is bit for bit the checking graph's, and each partial.{n} the input of
  the served graph's n-th sum (the pieces' kept partials);
- the TensorRT-RTX network evaluator (float16, bfloat16; DIST_COLLECTIVE summed over gloo): the same
  bit-for-bit equality, and each partial.{n}'s relative error against the rank's split eager model
  (held to the network's routing.{layer}) with the bound check sets: twice the split model's own
  half-vs-float32 spread, never below the dtype's fixed bound.

    python -m torch.distributed.run --nproc-per-node 2 tests/partial_outputs_worker.py SPEC OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from k3export.check.compare import TOLERANCES, compare, half_precision_tolerance
from k3export.check.routing import held_routing
from k3export.config import K3Config
from k3export.engine.network import NetworkEvaluator, parse_network, to_numpy
from k3export.exits import run_to_end
from k3export.model.parallel import split_model
from k3export.onnx.export import ExportGraph, TensorSpec, resolve_shape
from k3export.ops.collectives import recording_partials
from k3export.runtime.segments import SegmentedGraph
from k3export.weights.checkpoint import build_model

LENGTHS = [6, 4]


def feeds(manifest: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A ragged prefill from empty caches, its floating tensors in `dtype` (KDA states float32)."""
    sizes = {"batch": len(LENGTHS), "seq": max(LENGTHS), "capacity": manifest["capacity"]}
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (len(LENGTHS), max(LENGTHS))))
    fed = {"input_ids": ids, "cache_lengths": torch.zeros(len(LENGTHS), dtype=torch.int64),
           "input_lengths": torch.tensor(LENGTHS)}
    for spec in manifest["inputs"]:
        if spec["name"] not in fed:
            kind = torch.float32 if spec["dtype"] == "float32" else dtype
            fed[spec["name"]] = torch.zeros(resolve_shape(TensorSpec(**spec), sizes), dtype=kind)
    return fed


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray], names: list[str]) -> bool:
    return all(np.array_equal(a[n], b[n]) for n in names)


def eager_partials(folder: Path, manifest: dict, dtype: torch.dtype, rank: int,
                   choices: list[torch.Tensor]) -> list[np.ndarray]:
    """The rank's split eager model's partial sums, its routers held to `choices`."""
    config = K3Config.from_json(folder / "config.json")
    layers = range(*manifest["layers"])
    model = split_model(build_model(config, dtype, manifest["weights"], layers), rank, 2)
    fed = feeds(manifest, dtype)
    with torch.no_grad(), recording_partials() as recorded, held_routing(model, choices):
        ExportGraph(model, layers)(*(fed[s["name"]] for s in manifest["inputs"]))
    return [p.float().numpy() for p in recorded]


def run_case(case: dict, rank: int) -> dict:
    served, checking = (Path(case[k]) / f"rank-{rank}" for k in ("served", "checking"))
    manifest = json.loads((checking / "export.json").read_text())
    dtype = getattr(torch, manifest["dtype"])
    served_names = [s["name"] for s in manifest["outputs"]]
    partial_names = [s["name"] for s in manifest["partial_outputs"]]
    result: dict = {"partials": len(partial_names)}
    if case["ort"]:
        numpy_feeds = {k: v.numpy() for k, v in feeds(manifest, dtype).items()}
        plain = SegmentedGraph(served / "model.onnx", keep_partials=True)
        outputs = [plain(numpy_feeds), SegmentedGraph(checking / "model.onnx")(numpy_feeds)]
        result["ort_outputs_equal"] = same(*outputs, served_names)
        result["ort_partials_equal"] = [np.array_equal(outputs[1][name], kept)
                                        for name, kept in zip(partial_names, plain.partials, strict=True)]
    if case["network"]:
        fed = feeds(manifest, dtype)
        outputs = [{n: to_numpy(v) for n, v in NetworkEvaluator(parse_network(f / "model.onnx")).evaluate(fed)
                    .items()} for f in (served, checking)]
        result["network_outputs_equal"] = same(*outputs, served_names)
        choices = [torch.from_numpy(outputs[1][s["name"]]) for s in manifest["routing_outputs"]]
        half, full = (eager_partials(checking, manifest, d, rank, choices) for d in (dtype, torch.float32))
        tolerance = TOLERANCES[manifest["dtype"]]
        spread = max(compare("", h, f, tolerance).rel for h, f in zip(half, full, strict=True))
        bound = half_precision_tolerance(tolerance, spread, 0.0).rel
        rows = np.concatenate([np.arange(n) + b * max(LENGTHS) for b, n in enumerate(LENGTHS)])
        valid = [(outputs[1][name].reshape(-1, ref.shape[-1])[rows], ref.reshape(-1, ref.shape[-1])[rows])
                 for name, ref in zip(partial_names, half, strict=True)]
        result["network_partials_rel"] = [compare("", mine, ref, tolerance).rel for mine, ref in valid]
        result["network_partials_bound"] = bound
    return result


def main(spec: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {case["name"]: run_case(case, rank) for case in json.loads(Path(spec).read_text())}
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    run_to_end(lambda: main(*sys.argv[1:]))  # destroys the process group
