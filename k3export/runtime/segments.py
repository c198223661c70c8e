"""A tensor/expert-parallel rank's graph in ONNX Runtime, which has no collective op on CPU: the graph
is cut at its `DistCollective` nodes when loaded, each piece runs as its own ONNX Runtime session, and
the sums between them are done by torch.distributed (gloo), in the order the graph has them (an
engine sums in its own DIST_COLLECTIVE layers instead, over NCCL: runtime.nccl). Every rank of a
stage runs the same sequence of pieces and sums, so each sum meets its partners on the other ranks.

    rank graph:  [piece 0] -> all_reduce -> [piece 1] -> all_reduce -> ... -> [piece K]

The nodes keep the graph's (topological) order; piece k holds those between collective k-1 and k, its
inputs are what it reads that earlier pieces, sums or the caller made, its outputs what later pieces,
sums or the caller read. The weights stay in the export's data file, which each piece's session reads
in place (no copy of the file). Each piece runs through IO binding (onnx.runner.run_bound): a call
may name buffers (`into`) for outputs, which the piece that makes them writes.

`SegmentedRunner` is such a graph as the runner of a runtime.Stage: its caches held and bound as
onnx.runner.BoundOnnxrtRunner holds them (the MLA cache written in place by the piece that scatters
into it, the KDA states double-buffered), so each micro-batch has its own rows, as on any stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.distributed as dist

from k3export.errors import UserError
from k3export.onnx.collectives import DOMAIN, OP_TYPE
from k3export.onnx.runner import BoundOnnxrtRunner, Signature, run_bound, session_options


@dataclass
class Piece:
    session: ort.InferenceSession
    inputs: list[str]
    outputs: list[str]


def _read_names(node: onnx.NodeProto) -> set[str]:
    """The tensors a node reads: its inputs, and what its subgraphs (Loop, Scan, If bodies) read from
    the enclosing scope."""
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        for graph in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs):
            inner = {name for n in graph.node for name in n.output}
            inner |= {i.name for i in graph.input} | {t.name for t in graph.initializer}
            names |= {name for n in graph.node for name in _read_names(n) if name not in inner}
    return names


def _is_collective(node: onnx.NodeProto) -> bool:
    return node.domain == DOMAIN and node.op_type == OP_TYPE


class SegmentedGraph:
    """A rank's ONNX graph as pieces between its DistCollective nodes (all_reduce, sum) and the sums
    over `group` (None: the default process group) between them. Call with the graph's feeds.
    `keep_partials`: keep each call's inputs of the sums, this rank's partial sums, in graph order in
    `partials` (check --build compares them with the eager split model's)."""

    def __init__(self, path: Path, group: dist.ProcessGroup | None = None,
                 threads: int | None = None, keep_partials: bool = False) -> None:
        model = onnx.load(path, load_external_data=False)
        graph = model.graph
        self.group = group
        self.collectives = [n for n in graph.node if _is_collective(n)]
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        for node in self.collectives:
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            operation = (attributes.get("collective_operation"), attributes.get("reduce_op"))
            if operation != (b"all_reduce", b"sum"):
                raise UserError(f"{path}: node {node.name} is a {operation} collective; only all_reduce "
                                "(sum) is run here")
            if attributes.get("nb_rank") != size:
                raise UserError(f"{path}: node {node.name} sums over nb_rank = {attributes.get('nb_rank')} "
                                f"ranks, but this process group has {size}: run the stage's ranks together "
                                "(torchrun, one process a rank)")
        inferred = onnx.shape_inference.infer_shapes(model)
        types = {v.name: v.type for v in (*inferred.graph.value_info, *graph.input, *graph.output)}
        for node in self.collectives:  # a sum has its input's type (shape inference knows no such op)
            types.setdefault(node.output[0], types[node.input[0]])
        initializers = {t.name: t for t in graph.initializer}
        groups: list[list[onnx.NodeProto]] = [[]]
        for node in graph.node:
            if _is_collective(node):
                groups.append([])
            else:
                groups[-1].append(node)
        # What each piece (and each sum, and the caller) reads later decides the pieces' outputs.
        read_later: list[set[str]] = []
        later = {o.name for o in graph.output}
        for k in reversed(range(len(groups))):
            read_later.append(set(later))
            later |= {name for node in groups[k] for name in _read_names(node)}
            if k:
                later.add(self.collectives[k - 1].input[0])
        read_later.reverse()
        options = session_options(path, threads)
        options.log_severity_level = 3  # not TensorScatter's copy warning when caches come without `into`
        self.pieces = []
        for nodes, needed in zip(groups, read_later, strict=True):
            made = {name for node in nodes for name in node.output}
            reads = sorted({name for node in nodes for name in _read_names(node)} - made)
            inputs = [name for name in reads if name not in initializers]
            outputs = sorted(made & needed)
            piece = onnx.helper.make_graph(
                nodes, f"{graph.name}_piece{len(self.pieces)}",
                [onnx.helper.make_value_info(name, types[name]) for name in inputs],
                [onnx.helper.make_value_info(name, types[name]) for name in outputs],
                [initializers[name] for name in reads if name in initializers])
            proto = onnx.helper.make_model(piece, opset_imports=model.opset_import,
                                           functions=model.functions, ir_version=model.ir_version)
            session = ort.InferenceSession(proto.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
            self.pieces.append(Piece(session, inputs, outputs))
        self.output_names = [o.name for o in graph.output]
        self.compute_seconds = self.collective_seconds = 0.0
        self.keep_partials = keep_partials
        self.partials: list[np.ndarray] = []

    def __call__(self, feed: dict[str, np.ndarray],
                 into: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The graph's outputs for `feed` (every graph input); those named in `into` written into
        its buffers."""
        values = dict(feed)
        self.partials = []
        for k, piece in enumerate(self.pieces):
            start = time.perf_counter()
            values.update(run_bound(piece.session, {name: values[name] for name in piece.inputs},
                                    piece.outputs, into or {}))
            self.compute_seconds += time.perf_counter() - start
            if k < len(self.collectives):
                node = self.collectives[k]
                start = time.perf_counter()
                partial = values[node.input[0]]
                if self.keep_partials:
                    self.partials.append(partial)
                summed = torch.tensor(partial)  # a copy: a later piece may read the partial too
                dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.group)
                values[node.output[0]] = summed.numpy()
                self.collective_seconds += time.perf_counter() - start
        return {name: values[name] for name in self.output_names}


class SegmentedRunner(BoundOnnxrtRunner):
    """A split rank's graph (`SegmentedGraph`, its sums over `group`) holding its caches as
    BoundOnnxrtRunner does. `collective_time`: the last call's seconds in sums, within its
    `inference_time`."""

    def __init__(self, path: Path, signature: Signature, group: dist.ProcessGroup | None, name: str,
                 threads: int | None = None, keep_partials: bool = False) -> None:
        super().__init__(path, signature, name, threads)
        self.group, self.keep_partials = group, keep_partials

    def activate_impl(self) -> None:
        self.graph = SegmentedGraph(self.path, self.group, self.threads, self.keep_partials)

    def deactivate_impl(self) -> None:
        del self.graph

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str],
            into: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        before = self.graph.collective_seconds
        results = self.graph(feeds, into)
        self.collective_time = self.graph.collective_seconds - before
        return results
