"""The eager model as a check runner: the reference every artifact is compared against."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from k3export.onnx.export import ExportGraph, TensorSpec
from k3export.onnx.runner import NUMPY_CARRIER, Signature, StatefulRunner


class EagerRunner(StatefulRunner):
    """`graph` (an ExportGraph, or anything called the same way: flat tensors in and out in the
    signature's order) holding its caches as torch tensors. It casts feeds to the model's own dtypes,
    so a float32 model can take a float16 graph's feeds."""

    def __init__(self, graph: Any, name: str, signature: Signature) -> None:
        super().__init__(signature, name)
        self.graph = graph

    def empty_caches(self, batch: int) -> dict[str, torch.Tensor]:
        dtype = self.graph.model.dtype
        # KDA states are float32 in every model; the other caches take the model's dtype.
        return {name: torch.from_numpy(a).to(torch.float32 if "kda_state" in name else dtype)
                for name, a in self.signature.empty_caches(batch).items()}

    def call(self, feeds: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        model_dtype = self.graph.model.dtype
        tensors = []
        for spec in self.signature.inputs:
            if spec.name in self.caches:
                tensors.append(self.caches[spec.name])
            else:
                x = torch.from_numpy(np.asarray(feeds[spec.name]))
                tensors.append(x.to(model_dtype) if x.is_floating_point() else x)
        with torch.no_grad():
            outputs = dict(zip((s.name for s in self.signature.outputs), self.graph(*tensors), strict=True))
        self.keep_caches(outputs)
        return OrderedDict((name, value.numpy()) for name, value in outputs.items())


class Float32Boundary:
    """An ExportGraph whose bfloat16 tensors cross numpy as float32 (exact): inputs are cast to the
    graph's dtypes, bfloat16 outputs widened, so that EagerRunner serves a bfloat16 model."""

    def __init__(self, graph: ExportGraph, inputs: list[TensorSpec]) -> None:
        self.graph, self.model, self.layers = graph, graph.model, graph.layers
        self.dtypes = [getattr(torch, s.dtype) for s in inputs]

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = self.graph(*(x.to(d) for x, d in zip(inputs, self.dtypes, strict=True)))
        return tuple(o.to(NUMPY_CARRIER.get(o.dtype, o.dtype)) for o in outputs)
