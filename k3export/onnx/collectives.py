"""`torch.ops.k3.all_reduce` in ONNX: a `DistCollective` node in domain `trt`, which TensorRT's ONNX
parser (onnx-tensorrt 10.16+, TensorRT-RTX 1.7) maps to a DIST_COLLECTIVE layer. Every attribute is
written: the parser refuses a node without reduce_op or root, and takes the operation names in lower
case only ("all_reduce"; "ALL_REDUCE" is refused). ONNX Runtime has no such op on CPU: the runtime cuts
a rank's graph at these nodes and sums between the pieces with torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
import torch
from onnx.defs import OpSchema

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3export.model.parallel import RankSplit, collectives

DOMAIN = "trt"
DOMAIN_VERSION = 1
OP_TYPE = "DistCollective"

DIST_COLLECTIVE_SCHEMA = OpSchema(
    OP_TYPE, DOMAIN, DOMAIN_VERSION,
    doc="A collective over the ranks of a TensorRT multi-device engine; see k3export/model/parallel.py",
    inputs=[OpSchema.FormalParameter("input", "T")],
    outputs=[OpSchema.FormalParameter("output", "T")],
    type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
    attributes=[OpSchema.Attribute("collective_operation", OpSchema.AttrType.STRING, "all_reduce, ..."),
                OpSchema.Attribute("reduce_op", OpSchema.AttrType.STRING, "sum, or none for gathers"),
                OpSchema.Attribute("root", OpSchema.AttrType.INT, "-1: no root"),
                OpSchema.Attribute("nb_rank", OpSchema.AttrType.INT, "ranks taking part")],
)


def collective_translation_table() -> dict[Callable, Callable]:
    """The entry of onnx/ops.py's TRANSLATION_TABLE for the collectives. onnxscript is imported here,
    by the exporter only: the runtime and check read this module's names without it."""
    from onnxscript import values

    dist_collective = values.Op(values.Opset(DOMAIN, DOMAIN_VERSION), OP_TYPE, DIST_COLLECTIVE_SCHEMA)

    # Annotated so that the exporter passes the rank count as an attribute, not as a tensor.
    def all_reduce(x, ranks: int):
        return dist_collective(x, collective_operation="all_reduce", reduce_op="sum", root=-1, nb_rank=ranks)

    return {torch.ops.k3.all_reduce.default: all_reduce}


def parallel_record(split: RankSplit, graph: onnx.ModelProto, layers: range, dtype: torch.dtype) -> dict:
    """export.json's "parallel": the rank, the rank count, and each DistCollective node of the graph
    with what it sums (k3export.model.parallel.collectives), in graph order."""
    nodes = [n for n in graph.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    expected = collectives(split.config, layers)
    if len(nodes) != len(expected):
        raise RuntimeError(f"the rank's graph has {len(nodes)} DistCollective nodes; its split needs "
                           f"{len(expected)} (two per layer)")
    records = []
    for node, collective in zip(nodes, expected, strict=True):
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        records.append({"node": node.name, "input": node.input[0], "output": node.output[0],
                        "layer": collective.layer, "after": collective.after,
                        "collective_operation": attributes["collective_operation"].decode(),
                        "reduce_op": attributes["reduce_op"].decode(), "nb_rank": attributes["nb_rank"],
                        "values_per_token": collective.values, "dtype": collective.dtype,
                        "bytes_per_token": collective.bytes_per_token(dtype)})
    return {"rank": split.rank, "ranks": split.ranks,
            "config": "config.json is the unsplit model's; this rank holds 1/ranks of its heads and experts "
                      "(k3export/model/parallel.py)",
            "collectives": records}
