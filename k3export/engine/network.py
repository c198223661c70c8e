"""The TensorRT network the builder receives, evaluated on CPU (`k3export check --network DIR`).

TensorRT-RTX parses the export (k3 plugins registered) into an `INetworkDefinition`, exactly as
`k3export build` does; this module then runs that network layer by layer in topological order with
torch, each layer type with TensorRT's documented semantics, shape tensors included, in the
network's own dtypes (torch computes bfloat16 and float16 on CPU). It proves everything up to
TensorRT's optimizer: the parser's reading of every node, the dtypes and casts it chose, the shape
arithmetic, the plugin fields and bindings. It does not cover the optimizer, its tactics or kernels.

- Parameters are read from the parsed layers (down-cast to their classes: `IShuffleLayer` and so
  on), never from the ONNX file, with one exception: TensorRT's Python API gives no buffer for a
  bfloat16 `IConstantLayer`'s weights, so those values are read from the ONNX file's initializer of
  the layer's name (the parser names constant layers after their initializers).
- A plugin layer runs its plugin definition's reference computation, the eager op of the same name
  in `torch.ops.k3` (k3::KDA -> torch.ops.k3.kda), called with the layer's inputs in the
  definition's order (as its `reference_arguments` gives them: the MXFP4 experts' int32 words
  viewed as bytes), then its fields as the parsed plugin holds them.
- Where TensorRT leaves an order unspecified, the ONNX rule we export with is followed: TopK breaks
  ties to the lower index.
- Loops (an inlined ONNX Loop, e.g. a RoutedExperts function parsed without the plugins) run their
  body once per iteration, with TensorRT's trip-limit, recurrence and loop-output semantics.
- A layer type or mode that is not implemented raises an error naming it; nothing is skipped.
  Every result is held to the dtype and the static dims TensorRT declared for that tensor.

    evaluate_network(export_dir, feeds)   # numpy in, numpy out, by the network's tensor names

`check --network DIR` runs it as one of check's runners (k3export.check.runners.network).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import Tensor

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*, the plugins' reference computations)
from k3export.engine.build import parse
from k3export.engine.flavours import load_tensorrt
from k3export.engine.trt_log import tensorrt_logger
from k3export.errors import UserError
from k3export.onnx.export import GRAPH_FILE
from k3export.onnx.runner import NUMPY_CARRIER
from k3export.progress import track

_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
                 "INT32": torch.int32, "INT64": torch.int64, "INT8": torch.int8, "UINT8": torch.uint8,
                 "BOOL": torch.bool}


class NotImplementedLayer(UserError):
    """A layer type or mode the evaluator does not implement."""


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype of a TensorRT DataType."""
    if dtype.name not in _TORCH_DTYPES:
        raise NotImplementedLayer(f"TensorRT data type {dtype.name} is not implemented by the network "
                                  "evaluator")
    return _TORCH_DTYPES[dtype.name]


@dataclass
class ParsedNetwork:
    """A parsed network and what its evaluation needs. The parser owns the weights the network's
    constant layers point at, so it is kept alive here."""

    trt: ModuleType
    network: Any
    model_path: Path
    keep_alive: tuple[Any, ...]
    constants: dict[int, Tensor] = field(default_factory=dict)  # layer index -> value, read once
    _initializers: dict[str, onnx.TensorProto] | None = None
    kernels: bool = False  # plugin layers launch their Triton kernels (under the interpreter)
    kernel_launches: int = 0

    def close(self) -> None:
        """Frees the network, the parser that owns its weights and the values read from them; nothing
        of it can be evaluated after. (check --network closes it once the network's every step is
        recorded, so that the eager side that follows has the host's memory to itself.)"""
        self.network = self.keep_alive = self._initializers = None
        self.constants.clear()

    def initializer(self, name: str) -> Tensor:
        """An initializer of the ONNX file by name (external data read from beside the file)."""
        if self._initializers is None:
            model = onnx.load(self.model_path, load_external_data=False)
            self._initializers = {t.name: t for t in model.graph.initializer}
        if name not in self._initializers:
            raise UserError(f"{self.model_path}: constant layer {name!r} holds bfloat16 weights, which "
                            f"TensorRT's Python API does not expose, and the file has no initializer of "
                            f"that name to read them from")
        array = numpy_helper.to_array(self._initializers[name], str(self.model_path.parent))
        if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: same bits as torch's
            return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(array.copy())


def parse_network(model_path: str | Path, trt: ModuleType | None = None) -> ParsedNetwork:
    """Parses an ONNX file with TensorRT-RTX, the k3 plugins registered (as `k3export build` does)."""
    import k3plugins.trt

    model_path = Path(model_path)
    if not model_path.is_file():
        raise UserError(f"{model_path}: no such file")
    trt = trt or load_tensorrt()
    k3plugins.trt.register(trt)
    logger = tensorrt_logger(trt)
    builder, network, parser = parse(model_path, trt, logger)
    return ParsedNetwork(trt, network, model_path, (logger, builder, parser))


# ---- one function per layer type: (parsed network, down-cast layer, input values) -> output values

def _elementwise(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    a, b = x
    op = layer.op.name
    if op == "DIV" and not a.is_floating_point():
        return [torch.div(a, b, rounding_mode="trunc")]  # integer division truncates, as in C
    if op not in _ELEMENTWISE:
        raise NotImplementedLayer(f"layer {layer.name!r}: ELEMENTWISE {op} is not implemented")
    return [_ELEMENTWISE[op](a, b)]  # TensorRT broadcasts dims of size 1 as torch does


_ELEMENTWISE: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "SUM": torch.add, "PROD": torch.mul, "MAX": torch.maximum, "MIN": torch.minimum, "SUB": torch.sub,
    "DIV": torch.div, "POW": torch.pow, "FLOOR_DIV": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "AND": torch.logical_and, "OR": torch.logical_or, "XOR": torch.logical_xor,
    "EQUAL": torch.eq, "GREATER": torch.gt, "LESS": torch.lt,
}


def _unary(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    op = layer.op.name
    if op not in _UNARY:
        raise NotImplementedLayer(f"layer {layer.name!r}: UNARY {op} is not implemented")
    return [_UNARY[op](x[0])]


_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "EXP": torch.exp, "LOG": torch.log, "SQRT": torch.sqrt, "RECIP": torch.reciprocal, "ABS": torch.abs,
    "NEG": torch.neg, "SIN": torch.sin, "COS": torch.cos, "ERF": torch.erf, "FLOOR": torch.floor,
    "CEIL": torch.ceil, "NOT": torch.logical_not, "SIGN": torch.sign,
    "ROUND": torch.round,  # half to even, as TensorRT documents
}


def _activation(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    kind = layer.type.name  # IActivationLayer.type is the ActivationType once down-cast
    if kind not in _ACTIVATIONS:
        raise NotImplementedLayer(f"layer {layer.name!r}: ACTIVATION {kind} is not implemented")
    return [_ACTIVATIONS[kind](x[0], layer.alpha, layer.beta)]


_ACTIVATIONS: dict[str, Callable[[Tensor, float, float], Tensor]] = {
    "RELU": lambda x, a, b: torch.relu(x),
    "SIGMOID": lambda x, a, b: torch.sigmoid(x),
    "TANH": lambda x, a, b: torch.tanh(x),
    "LEAKY_RELU": lambda x, a, b: F.leaky_relu(x, a),
}


def _axes(mask: int, rank: int) -> list[int]:
    """Axes from TensorRT's bit mask (bit i: axis i)."""
    return [i for i in range(rank) if mask >> i & 1]


def _reduce(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    op, dims, keep = layer.op.name, _axes(layer.axes, x[0].dim()), layer.keep_dims
    reducers = {"SUM": torch.sum, "AVG": torch.mean, "MAX": torch.amax, "MIN": torch.amin}
    if op not in reducers:
        raise NotImplementedLayer(f"layer {layer.name!r}: REDUCE {op} is not implemented")
    return [reducers[op](x[0], dim=dims, keepdim=keep)]


def _matrix_multiply(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    a, b = x
    for op in (layer.op0.name, layer.op1.name):
        if op not in ("NONE", "TRANSPOSE"):
            raise NotImplementedLayer(f"layer {layer.name!r}: MATRIX_MULTIPLY operand {op} is not "
                                      "implemented")
    if layer.op0.name == "TRANSPOSE":
        a = a.transpose(-1, -2)
    if layer.op1.name == "TRANSPOSE":
        b = b.transpose(-1, -2)
    return [torch.matmul(a, b)]  # batch dims of size 1 broadcast


def _cast(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    return [x[0].to(torch_dtype(layer.to_type))]  # float to integer truncates toward zero


def _array(weights: Any) -> np.ndarray | None:
    """Layer weights as numpy (the API hands them over as arrays, or as a Weights object), or None
    for bfloat16, whose Weights give no buffer."""
    array = weights if isinstance(weights, np.ndarray) else weights.numpy()
    return array if isinstance(array, np.ndarray) else None


def _constant(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    weights = _array(layer.weights)
    # bfloat16 Weights give no buffer: read from the ONNX file (see the module's docstring).
    value = torch.from_numpy(weights.copy()) if weights is not None else net.initializer(layer.name)
    return [value.reshape(tuple(layer.shape))]


def _shuffle(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    """first transpose, reshape (static dims or input 1; 0 copies the input dim when
    zero_is_placeholder, -1 is inferred), second transpose."""
    y = x[0].permute(tuple(layer.first_transpose)[:x[0].dim()])
    dims = x[1].tolist() if len(x) > 1 and x[1] is not None else layer.reshape_dims
    if dims is not None:
        dims = [y.shape[i] if d == 0 and layer.zero_is_placeholder else d for i, d in enumerate(dims)]
        y = y.reshape(dims)
    return [y.permute(tuple(layer.second_transpose)[:y.dim()])]


def _concatenation(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    return [torch.cat(x, dim=layer.axis)]


def _shape(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    return [torch.tensor(x[0].shape, dtype=torch.int64)]


def _unsqueeze(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    rank = x[0].dim() + x[1].numel()  # axes count in the output's rank
    y = x[0]
    for axis in sorted(a % rank for a in x[1].tolist()):
        y = y.unsqueeze(axis)
    return [y]


def _squeeze(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    # The parser squeezes shape tensors without an axes input: then every unit dim goes, as in ONNX
    # (the declared output dims, checked for every result, confirm it).
    if len(x) < 2 or x[1] is None:
        return [x[0].squeeze()]
    axes = [a % x[0].dim() for a in x[1].tolist()]
    if any(x[0].shape[a] != 1 for a in axes):
        raise UserError(f"layer {layer.name!r}: SQUEEZE of axes {axes} of a {list(x[0].shape)} tensor")
    return [x[0].squeeze(tuple(axes))]


def _slice(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    """out[i] = in[start + i * stride] along each sliced axis; inputs 1-3 (when present) replace
    start, shape and stride, and `axes` names the axes they apply to (all when unset)."""
    if layer.mode.name != "STRICT_BOUNDS":
        raise NotImplementedLayer(f"layer {layer.name!r}: SLICE mode {layer.mode.name} is not implemented")
    if len(x) > 4:
        raise NotImplementedLayer(f"layer {layer.name!r}: SLICE with a fill value or axes input is not "
                                  "implemented")

    def param(index: int, static: Any) -> list[int]:
        return x[index].tolist() if len(x) > index and x[index] is not None else list(static)

    data = x[0]
    start, size, stride = param(1, layer.start or ()), param(2, layer.shape or ()), param(3, layer.stride)
    axes = list(layer.axes) if layer.axes is not None else list(range(data.dim()))
    for axis, s, n, step in zip(axes, start, size, stride, strict=True):
        axis %= data.dim()
        index = s + step * torch.arange(n)
        if n and not (int(index.min()) >= 0 and int(index.max()) < data.shape[axis]):
            raise UserError(f"layer {layer.name!r}: SLICE reads index {index.tolist()} of axis {axis} "
                            f"(size {data.shape[axis]}) out of bounds")
        data = data.index_select(axis, index)
    return [data]


def _check_indices(layer: Any, index: Tensor, size: int) -> Tensor:
    # TensorRT requires 0 <= index < size (the parser adds the ONNX wrap of negative indices).
    if index.numel() and not (int(index.min()) >= 0 and int(index.max()) < size):
        raise UserError(f"layer {layer.name!r}: index out of [0, {size}): {index.unique().tolist()[:8]}")
    return index.long()


def _gather(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    data, index = x
    axis, mode = layer.axis % data.dim(), layer.mode.name
    if mode == "DEFAULT" and layer.num_elementwise_dims == 0:
        index = _check_indices(layer, index, data.shape[axis])
        out = data.index_select(axis, index.reshape(-1))
        return [out.reshape((*data.shape[:axis], *index.shape, *data.shape[axis + 1:]))]
    if mode == "ELEMENT":
        return [torch.gather(data, axis, _check_indices(layer, index, data.shape[axis]))]
    raise NotImplementedLayer(f"layer {layer.name!r}: GATHER mode {mode} with num_elementwise_dims "
                              f"{layer.num_elementwise_dims} is not implemented")


def _scatter(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    data, index, updates = x
    if layer.mode.name != "ELEMENT":
        raise NotImplementedLayer(f"layer {layer.name!r}: SCATTER mode {layer.mode.name} is not implemented")
    axis = layer.axis % data.dim()
    return [data.scatter(axis, _check_indices(layer, index, data.shape[axis]), updates)]


def _topk(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    """A stable sort, so that ties go to the lower index (ONNX's rule; TensorRT leaves it open)."""
    (axis,) = _axes(layer.axes, x[0].dim())
    k = int(x[1]) if len(x) > 1 and x[1] is not None else layer.k
    if layer.op.name not in ("MAX", "MIN"):
        raise NotImplementedLayer(f"layer {layer.name!r}: TOPK {layer.op.name} is not implemented")
    values, indices = torch.sort(x[0], dim=axis, descending=layer.op.name == "MAX", stable=True)
    return [values.narrow(axis, 0, k), indices.narrow(axis, 0, k).to(torch_dtype(layer.indices_type))]


def _softmax(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    (axis,) = _axes(layer.axes, x[0].dim())
    return [torch.softmax(x[0], dim=axis)]


def _convolution(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    """Correlation of an N-C-spatial input with the kernel (GKCRS = torch's [K, C / groups, R, S]),
    zero pre/post padding, stride, dilation and groups as the layer holds them."""
    if len(x) > 1 or layer.padding_mode.name != "EXPLICIT_ROUND_DOWN":
        raise NotImplementedLayer(f"layer {layer.name!r}: CONVOLUTION with a kernel input or padding mode "
                                  f"{layer.padding_mode.name} is not implemented")
    kernel = _array(layer.kernel)
    if kernel is None:
        raise NotImplementedLayer(f"layer {layer.name!r}: CONVOLUTION with {layer.kernel.dtype} kernel "
                                  "weights (no buffer in the Python API) is not implemented")
    size = tuple(layer.kernel_size_nd)
    groups, maps = layer.num_groups, layer.num_output_maps
    data = x[0]
    weight = torch.from_numpy(kernel.copy()).reshape(maps, data.shape[1] // groups, *size).to(data.dtype)
    bias = _array(layer.bias)
    bias = torch.from_numpy(bias.copy()).to(data.dtype) if bias is not None and bias.size else None
    pads = [p for pre, post in zip(reversed(tuple(layer.pre_padding)), reversed(tuple(layer.post_padding)),
                                   strict=True) for p in (pre, post)]
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(size)]
    return [conv(F.pad(data, pads), weight, bias, stride=tuple(layer.stride_nd),
                 dilation=tuple(layer.dilation_nd), groups=groups)]


def _plugin(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    """The plugin definition's reference: torch.ops.k3.<op in snake case>(*inputs, *fields), the inputs
    as the definition's reference_arguments gives them."""
    plugin = layer.plugin.get_capability_interface(net.trt.PluginCapabilityType.CORE)
    definition = getattr(plugin, "definition", None)
    if definition is None:
        raise NotImplementedLayer(f"layer {layer.name!r}: plugin {plugin.plugin_namespace}::"
                                  f"{plugin.plugin_name} is not a k3 plugin; it is not implemented")
    if net.kernels:
        return _launch(net, definition, plugin, x)
    # LatentMLA -> latent_mla, LatentMLASplits -> latent_mla_splits, KDA -> kda
    op_name = re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", definition.name).lower()
    op = getattr(getattr(torch.ops, definition.namespace), op_name)
    # The definition maps the plugin's inputs to the op's (the MXFP4 experts' int32 words to bytes).
    result = op(*definition.reference_arguments(x), *(plugin.fields[f.name] for f in definition.fields))
    return list(result) if isinstance(result, tuple | list) else [result]


def _launch(net: ParsedNetwork, definition: Any, plugin: Any, x: list[Tensor]) -> list[Tensor]:
    """check --network --kernels: the definition's launch (its Triton kernels, under the interpreter
    on CPU) into outputs of the definition's shapes and dtypes, as the engine would run it."""
    fields = {f.name: plugin.fields[f.name] for f in definition.fields}
    shapes = definition.output_shapes([list(t.shape) for t in x], fields, lambda n: n)
    dtypes = definition.output_dtypes([str(t.dtype).removeprefix("torch.") for t in x])
    outputs = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in zip(shapes, dtypes,
                                                                                          strict=True)]
    definition.launch([t.contiguous() for t in x], outputs, fields)
    net.kernel_launches += 1
    return outputs


def _kv_cache_update(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    """cache [B, H, S, D] with update [B, H, T, D] written at rows write_indices[b] .. + T - 1."""
    if layer.cache_mode.name != "LINEAR" or layer.update_form.name != "PADDED_BHND":
        raise NotImplementedLayer(f"layer {layer.name!r}: KV_CACHE_UPDATE {layer.cache_mode.name} "
                                  f"{layer.update_form.name} is not implemented")
    cache, update, write_indices = x
    out, rows = cache.clone(), update.shape[2]
    for b, start in enumerate(write_indices.tolist()):
        if not 0 <= start <= cache.shape[2] - rows:
            raise UserError(f"layer {layer.name!r}: writing {rows} rows at {start} overflows the cache "
                            f"of capacity {cache.shape[2]}")
        out[b, :, start:start + rows] = update[b]
    return [out]


def _fill(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    """LINSPACE: out[i_0, .., i_n] = alpha + sum_k beta[k] i_k; the shape, alpha and beta from inputs
    0-2 when present."""
    if layer.operation.name != "LINSPACE":
        raise NotImplementedLayer(f"layer {layer.name!r}: FILL {layer.operation.name} is not implemented")

    def given(index: int) -> Tensor | None:
        return x[index] if len(x) > index and x[index] is not None else None

    shape = given(0).tolist() if given(0) is not None else list(layer.shape)
    alpha = given(1) if given(1) is not None else torch.tensor(layer.alpha)
    beta = given(2) if given(2) is not None else torch.tensor(layer.beta)
    grids = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
    value = alpha + sum(b * g for b, g in zip(beta.reshape(-1), grids, strict=True))
    return [torch.as_tensor(value).to(torch_dtype(layer.to_type))]


def _dist_collective(net: ParsedNetwork, layer: Any, x: list[Tensor]) -> list[Tensor]:
    """A sum over the layer's num_ranks ranks (torch.ops.k3.all_reduce): the parsed networks of a
    stage's ranks are evaluated together, one process each under torchrun (one rank's network alone
    cannot be). The only collective the exports write is all_reduce (sum); TensorRT's Python API
    gives the layer's rank count but not its operation."""
    return [torch.ops.k3.all_reduce(x[0], layer.num_ranks)]


# LayerType name -> (the layer class to down-cast to, its evaluation)
LAYERS: dict[str, tuple[str, Callable[[ParsedNetwork, Any, list[Tensor]], list[Tensor]]]] = {
    "ACTIVATION": ("IActivationLayer", _activation),
    "CAST": ("ICastLayer", _cast),
    "CONCATENATION": ("IConcatenationLayer", _concatenation),
    "CONSTANT": ("IConstantLayer", _constant),
    "CONVOLUTION": ("IConvolutionLayer", _convolution),
    "DIST_COLLECTIVE": ("IDistCollectiveLayer", _dist_collective),
    "ELEMENTWISE": ("IElementWiseLayer", _elementwise),
    "FILL": ("IFillLayer", _fill),
    "GATHER": ("IGatherLayer", _gather),
    "IDENTITY": ("IIdentityLayer", lambda net, layer, x: [x[0]]),
    "KV_CACHE_UPDATE": ("IKVCacheUpdateLayer", _kv_cache_update),
    "MATRIX_MULTIPLY": ("IMatrixMultiplyLayer", _matrix_multiply),
    "PLUGIN_V3": ("IPluginV3Layer", _plugin),
    "REDUCE": ("IReduceLayer", _reduce),
    "SCATTER": ("IScatterLayer", _scatter),
    # (condition, then, else), broadcast as torch does (the routed experts' sum of held slots: a Where)
    "SELECT": ("ISelectLayer", lambda net, layer, x: [torch.where(*x)]),
    "SHAPE": ("IShapeLayer", _shape),
    "SHUFFLE": ("IShuffleLayer", _shuffle),
    "SLICE": ("ISliceLayer", _slice),
    "SOFTMAX": ("ISoftMaxLayer", _softmax),
    "SQUEEZE": ("ISqueezeLayer", _squeeze),
    "TOPK": ("ITopKLayer", _topk),
    "UNARY": ("IUnaryLayer", _unary),
    "UNSQUEEZE": ("IUnsqueezeLayer", _unsqueeze),
}


def _check_result(layer: Any, index: int, value: Tensor) -> None:
    """Holds a computed tensor to the dtype and static dims TensorRT declared for it."""
    tensor = layer.get_output(index)
    expected, dims = torch_dtype(tensor.dtype), tuple(tensor.shape)
    fits = len(dims) == value.dim() and all(d in (-1, s) for d, s in zip(dims, value.shape, strict=True))
    if value.dtype != expected or not fits:
        raise RuntimeError(f"layer {layer.name!r} ({layer.type.name}) output {tensor.name!r}: computed "
                           f"{value.dtype} {list(value.shape)}, TensorRT declares {expected} {list(dims)}")


@dataclass
class _Step:
    index: int
    layer: Any
    kind: str
    inputs: list[str | None]
    outputs: list[str]
    release: list[str] = field(default_factory=list)  # values no later step reads: freed after this one


@dataclass
class _Loop:
    """A TensorRT loop: its boundary layers and its body (the layers that read a recurrence's value,
    directly or not), each in topological order."""

    trip_limits: list[_Step] = field(default_factory=list)
    recurrences: list[_Step] = field(default_factory=list)
    outputs: list[_Step] = field(default_factory=list)
    body: list[_Step] = field(default_factory=list)


_BOUNDARIES = {"TRIP_LIMIT": "ITripLimitLayer", "RECURRENCE": "IRecurrenceLayer",
               "LOOP_OUTPUT": "ILoopOutputLayer", "ITERATOR": "IIteratorLayer"}


def _loops(steps: dict[int, _Step], trt: ModuleType) -> list[_Loop]:
    """The network's loops, their boundary layers grouped by ILoop and their bodies found forward
    from the recurrences' values (a layer that reads no loop value runs once, outside: the same)."""
    loops: list[tuple[Any, _Loop]] = []  # the ILoop objects stay alive, so each loop keeps one wrapper
    for step in steps.values():
        if step.kind in _BOUNDARIES:
            step.layer.__class__ = getattr(trt, _BOUNDARIES[step.kind])
            owner = step.layer.loop
            loop = next((lp for o, lp in loops if o is owner), None)
            if loop is None:
                loop = _Loop()
                loops.append((owner, loop))
            if step.kind == "ITERATOR":
                raise NotImplementedLayer(f"layer {step.layer.name!r}: loop ITERATOR is not implemented")
            {"TRIP_LIMIT": loop.trip_limits, "RECURRENCE": loop.recurrences,
             "LOOP_OUTPUT": loop.outputs}[step.kind].append(step)
    readers: dict[str, list[_Step]] = {}
    for step in steps.values():
        for name in step.inputs:
            if name is not None:
                readers.setdefault(name, []).append(step)
    for _, loop in loops:
        body: dict[int, _Step] = {}
        frontier = [name for r in loop.recurrences for name in r.outputs]
        while frontier:
            for reader in readers.get(frontier.pop(), []):
                if reader.kind not in _BOUNDARIES and reader.index not in body:
                    body[reader.index] = reader
                    frontier.extend(reader.outputs)
        loop.body = list(body.values())
    return [loop for _, loop in loops]


def _order(steps: dict[int, _Step], after: dict[int, list[int]]) -> list[int]:
    """Step indices in topological order: the parser's, with a layer's producers moved before it
    where they are not already. A recurrence's next value (input 1) is not a dependency (it is read
    after the iteration); `after` adds dependencies (a loop output on its loop's layers)."""
    producer = {name: step.index for step in steps.values() for name in step.outputs}

    def needs(step: _Step) -> list[int]:
        names = step.inputs[:1] if step.kind == "RECURRENCE" else step.inputs
        return [producer[n] for n in names if n in producer] + after.get(step.index, [])

    placed: set[int] = set()
    order: list[int] = []
    for index in steps:
        pending, seen = [index], set()
        while pending:
            i = pending[-1]
            missing = [j for j in needs(steps[i]) if j not in placed]
            if i in placed:
                pending.pop()
            elif missing:
                if i in seen:
                    raise RuntimeError(f"layer {steps[i].layer.name!r}: a cycle outside a loop")
                seen.add(i)
                pending.extend(missing)
            else:
                placed.add(i)
                order.append(pending.pop())
    return order


class NetworkEvaluator:
    """Evaluates a parsed network on CPU: `evaluate({input name: tensor}) -> {output name: tensor}`.
    Constant layers are read once, at the first evaluation. A loop runs its body once per iteration
    (TensorRT's semantics: the trip limits are checked before each iteration; a recurrence's value
    is its initial value, then its input 1 of the previous iteration; a LAST_VALUE loop output is its
    input after the last iteration, for a recurrence its final value)."""

    def __init__(self, net: ParsedNetwork, extra_outputs: list[str] | None = None) -> None:
        self.net = net
        network = net.network
        self.inputs = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
        # Extra outputs: intermediate tensors to return too (a check's held routing).
        self.outputs = [network.get_output(i).name for i in range(network.num_outputs)]
        self.outputs += [name for name in extra_outputs or [] if name not in self.outputs]
        steps = {}
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            inputs = [None if t is None else t.name
                      for t in (layer.get_input(j) for j in range(layer.num_inputs))]
            outputs = [layer.get_output(j).name for j in range(layer.num_outputs)]
            steps[i] = _Step(i, layer, layer.type.name, inputs, outputs)
        loops = _loops(steps, net.trt)
        after = {out.index: [s.index for s in loop.body + loop.trip_limits + loop.recurrences]
                 for loop in loops for out in loop.outputs}
        order = _order(steps, after)
        position = {index: k for k, index in enumerate(order)}
        in_loop = {s.index for loop in loops for s in loop.body + loop.trip_limits + loop.recurrences}
        # Top level: the steps outside every loop, each loop run where its first output falls.
        self.sequence: list[_Step | _Loop] = []
        for index in order:
            step = steps[index]
            loop = next((lp for lp in loops if step in lp.outputs), None)
            if loop is not None and step is min(loop.outputs, key=lambda s: position[s.index]):
                loop.body.sort(key=lambda s: position[s.index])
                self.sequence.append(loop)
            elif loop is None and index not in in_loop:
                self.sequence.append(step)
        # Values read inside a loop are needed every iteration: only values read outside loops are freed.
        read_in_loops = {n for loop in loops for s in loop.body + loop.trip_limits + loop.recurrences
                         for n in s.inputs}
        last_use = {name: item for item in self.sequence if isinstance(item, _Step) for name in item.inputs
                    if name is not None}
        for name, step in last_use.items():
            if name not in self.outputs and name not in read_in_loops:
                step.release.append(name)
        self.layer_seconds: dict[str, float] = {}  # time spent per layer type in the last evaluation

    def evaluate(self, feeds: dict[str, Tensor]) -> dict[str, Tensor]:
        values: dict[str, Tensor] = {}
        for name, tensor in self.inputs.items():
            if name not in feeds:
                raise UserError(f"{self.net.model_path}: network input {name!r} was not fed "
                                f"(fed: {', '.join(sorted(feeds)) or 'nothing'})")
            values[name] = self._input(tensor, feeds[name])
        self.layer_seconds = {}
        for item in track(self.sequence, "network: layers evaluated"):
            if isinstance(item, _Loop):
                self._loop(item, values)
            else:
                self._step(item, values)
        return {name: values[name] for name in self.outputs}

    def _step(self, step: _Step, values: dict[str, Tensor]) -> None:
        net, layer, kind = self.net, step.layer, step.kind
        if kind not in LAYERS:
            raise NotImplementedLayer(f"layer {layer.name!r}: layer type {kind} is not implemented by "
                                      f"the network evaluator (implemented: {', '.join(sorted(LAYERS))}, "
                                      "and loops)")
        class_name, evaluate = LAYERS[kind]
        start = time.perf_counter()
        if kind == "CONSTANT" and step.index in net.constants:
            results = [net.constants[step.index]]
        else:
            layer.__class__ = getattr(net.trt, class_name)  # the network hands out plain ILayer objects
            results = evaluate(net, layer, [None if n is None else values[n] for n in step.inputs])
            for j, value in enumerate(results):
                _check_result(layer, j, value)
            if kind == "CONSTANT":
                net.constants[step.index] = results[0]
        values.update(zip(step.outputs, results, strict=True))
        for name in step.release:
            del values[name]
        self.layer_seconds[kind] = self.layer_seconds.get(kind, 0.0) + time.perf_counter() - start

    def _loop(self, loop: _Loop, values: dict[str, Tensor]) -> None:
        state = {r.outputs[0]: values[r.inputs[0]] for r in loop.recurrences}
        iterations = 0
        while True:
            values.update(state)
            done = False
            for limit in loop.trip_limits:
                value = values[limit.inputs[0]]
                kind = limit.layer.kind.name
                if kind == "COUNT":
                    done |= iterations >= int(value)
                elif kind == "WHILE":
                    if limit.inputs[0] not in state:
                        raise NotImplementedLayer(f"layer {limit.layer.name!r}: a WHILE trip limit on a "
                                                  "value other than a recurrence's is not implemented")
                    done |= not bool(value)
                else:
                    raise NotImplementedLayer(f"layer {limit.layer.name!r}: trip limit {kind} is not "
                                              "implemented")
            if done:
                break
            for step in loop.body:
                self._step(step, values)
            state = {r.outputs[0]: values[r.inputs[1]] for r in loop.recurrences}
            iterations += 1
        for out in loop.outputs:
            if out.layer.kind.name != "LAST_VALUE":
                raise NotImplementedLayer(f"layer {out.layer.name!r}: loop output {out.layer.kind.name} is "
                                          "not implemented")
            if out.inputs[0] not in values:
                raise UserError(f"layer {out.layer.name!r}: the loop ran no iteration, so {out.inputs[0]!r} "
                                "has no last value")
            values[out.outputs[0]] = values[out.inputs[0]]

    def _input(self, tensor: Any, value: Any) -> Tensor:
        value = torch.as_tensor(value)
        expected = torch_dtype(tensor.dtype)
        if value.dtype != expected and value.dtype != NUMPY_CARRIER.get(expected):
            raise UserError(f"network input {tensor.name!r}: fed {value.dtype}, expected {expected}")
        dims = tuple(tensor.shape)
        if len(dims) != value.dim() or any(d not in (-1, s) for d, s in zip(dims, value.shape, strict=True)):
            raise UserError(f"network input {tensor.name!r}: fed shape {list(value.shape)}, expected "
                            f"{list(dims)} (-1: any)")
        return value.to(expected)


def to_numpy(value: Tensor) -> np.ndarray:
    """A tensor as numpy; bfloat16 widens to float32 (exact), as numpy has no bfloat16."""
    return value.to(NUMPY_CARRIER.get(value.dtype, value.dtype)).numpy()


def evaluate_network(export_dir: str | Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Parses export_dir/model.onnx and evaluates the network once: numpy in and out by the network's
    tensor names (a bfloat16 tensor is fed and returned as float32)."""
    evaluator = NetworkEvaluator(parse_network(Path(export_dir) / GRAPH_FILE))
    return {name: to_numpy(value) for name, value in evaluator.evaluate(feeds).items()}
