"""IPluginV3 adapters: present each `k3plugins.definitions` definition to a TensorRT builder.

The classes are written against a `trt` module passed in, so that the one code serves `tensorrt`
and `tensorrt_rtx` (both accept Python IPluginV3 plugins with an IPluginCreatorV3One creator):

    import tensorrt_rtx as trt
    import k3plugins.trt
    k3plugins.trt.register(trt)   # before parsing an ONNX file with k3 nodes

Shapes, dtypes, formats, fields and aliasing come from the definition. The build capability is
IPluginV3OneBuildV2 where the flavour has it (both do today), so that an output the definition
aliases to an input (KDA's final state to its initial state) shares that input's buffer: the state
is updated in place. `enqueue` hands TensorRT's device pointers to `launch_from_pointers`, which
wraps them as torch tensors and calls the definition's launch on TensorRT's stream, writing straight
into TensorRT's output buffers. That function takes no TensorRT types, so tools/gpu_check runs it on
a GPU directly; enqueue itself has not run under TensorRT (no GPU where this was written), nor has
an engine with an aliased plugin output.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from k3plugins.definitions import DEFINITIONS, PluginDefinition

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}


def _dtype_names(trt: ModuleType) -> dict[Any, str]:
    return {trt.DataType.FLOAT: "float32", trt.DataType.HALF: "float16", trt.DataType.BF16: "bfloat16",
            trt.DataType.INT64: "int64", trt.DataType.INT32: "int32", trt.DataType.UINT8: "uint8"}


def _field_types(trt: ModuleType) -> dict[type, tuple[Any, Any]]:
    # The ONNX parser hands INT attributes over as INT32 and FLOAT ones as FLOAT32.
    return {int: (trt.PluginFieldType.INT32, np.int32), float: (trt.PluginFieldType.FLOAT32, np.float32)}


class _DeviceBuffer:
    """A device allocation in the `__cuda_array_interface__` protocol, which torch.as_tensor reads."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 3}


def _as_tensor(pointer: int, dims: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    shape = tuple(dims)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    # Bytes first, then the dtype: the interface has no type string for bfloat16.
    return torch.as_tensor(_DeviceBuffer(pointer, nbytes), device="cuda").view(dtype).view(shape)


def launch_from_pointers(definition: PluginDefinition, fields: dict[str, Any],
                         input_descs: Sequence[tuple[Sequence[int], str]],
                         output_descs: Sequence[tuple[Sequence[int], str]],
                         inputs: Sequence[int], outputs: Sequence[int], stream: int) -> None:
    """The body of the plugin's enqueue, free of TensorRT types: each desc is (dims, dtype name),
    `inputs` and `outputs` are device pointers (an aliased output's is its input's) and `stream` a
    CUDA stream handle. Triton launches on torch's current stream, so that is made `stream`."""
    def wrap(descs: Sequence[tuple[Sequence[int], str]], pointers: Sequence[int]) -> list[torch.Tensor]:
        return [_as_tensor(p, dims, _TORCH_DTYPES[dtype])
                for (dims, dtype), p in zip(descs, pointers, strict=True)]

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        definition.launch(wrap(input_descs, inputs), wrap(output_descs, outputs), fields)


class _Dim:
    """A builder's IDimensionExpr with +, * and // (its SUM, PROD and FLOOR_DIV operations; the Python API
    gives the expressions no operators), so that a definition's shape arithmetic serves ints and TensorRT's
    expressions alike (LatentMLASplits' split count)."""

    def __init__(self, trt: ModuleType, builder: Any, expr: Any) -> None:
        self.trt, self.builder, self.expr = trt, builder, expr

    def _op(self, name: str, other: _Dim | int) -> _Dim:
        other = other.expr if isinstance(other, _Dim) else self.builder.constant(other)
        return _Dim(self.trt, self.builder,
                    self.builder.operation(getattr(self.trt.DimensionOperation, name), self.expr, other))

    def __add__(self, other: _Dim | int) -> _Dim:
        return self._op("SUM", other)

    def __mul__(self, other: _Dim | int) -> _Dim:
        return self._op("PROD", other)

    def __floordiv__(self, other: _Dim | int) -> _Dim:
        return self._op("FLOOR_DIV", other)


@functools.cache
def plugin_classes(trt: ModuleType) -> tuple[type, type]:
    """(plugin class, creator class) for one TensorRT flavour."""
    dtype_names = _dtype_names(trt)
    field_types = _field_types(trt)
    # V2 adds get_aliased_input (TensorRT 10.5+, TensorRT-RTX 1.7).
    build_base = getattr(trt, "IPluginV3OneBuildV2", trt.IPluginV3OneBuild)

    class K3Plugin(trt.IPluginV3, trt.IPluginV3OneCore, build_base, trt.IPluginV3OneRuntime):
        def __init__(self, definition: PluginDefinition, fields: dict[str, Any]) -> None:
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            build_base.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.definition, self.fields = definition, fields
            self.plugin_name = definition.name
            self.plugin_namespace = definition.namespace
            self.plugin_version = definition.version
            self.num_outputs = len(definition.outputs)

        def get_capability_interface(self, type):
            return self

        def clone(self):
            return K3Plugin(self.definition, dict(self.fields))

        # Build capability.
        def get_output_data_types(self, input_types):
            names = self.definition.output_dtypes([dtype_names.get(t) for t in input_types])
            by_name = {name: t for t, name in dtype_names.items()}
            return [by_name[name] for name in names]

        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            def dim(expr: Any) -> _Dim:
                return _Dim(trt, expr_builder, expr)

            dims = [[dim(d[i]) for i in range(len(d))] for d in inputs]
            shapes = self.definition.output_shapes(dims, self.fields, lambda n: dim(expr_builder.constant(n)))
            outputs = []
            for shape in shapes:
                out = trt.DimsExprs(len(shape))
                for i, d in enumerate(shape):
                    out[i] = d.expr
                outputs.append(out)
            return outputs

        def supports_format_combination(self, pos, in_out, num_inputs):
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR or desc.type not in dtype_names:
                return False
            # Positions before pos are already decided; later ones are not yet.
            dtypes = [dtype_names.get(d.desc.type) for d in in_out[:pos + 1]]
            return self.definition.supports(dtypes)

        def get_aliased_input(self, output_index):
            return self.definition.aliased_input(output_index)

        def configure_plugin(self, inp, out):
            pass

        def get_workspace_size(self, inputs, outputs):
            return 0

        def get_valid_tactics(self):
            return []

        # Runtime capability.
        def set_tactic(self, tactic):
            pass

        def on_shape_change(self, inp, out):
            pass

        def attach_to_context(self, context):
            return self.clone()

        def get_fields_to_serialize(self):
            return trt.PluginFieldCollection([
                trt.PluginField(f.name, np.array([self.fields[f.name]], dtype=field_types[f.type][1]),
                                field_types[f.type][0])
                for f in self.definition.fields])

        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            def plain(descs):
                return [(tuple(d.dims), dtype_names[d.type]) for d in descs]

            launch_from_pointers(self.definition, self.fields, plain(input_desc), plain(output_desc),
                                 inputs, outputs, stream)
            return 0

    class K3PluginCreator(trt.IPluginCreatorV3One):
        def __init__(self, definition: PluginDefinition) -> None:
            trt.IPluginCreatorV3One.__init__(self)
            self.definition = definition
            self.name = definition.name
            self.plugin_namespace = definition.namespace
            self.plugin_version = definition.version
            # Only fields declared here reach create_plugin from the ONNX node's attributes.
            self.field_names = trt.PluginFieldCollection([
                trt.PluginField(f.name, np.array([]), field_types[f.type][0]) for f in definition.fields])
            # The fields of every plugin created, in order: what the parser passed from the ONNX file.
            self.created: list[dict[str, Any]] = []

        def create_plugin(self, name, fc, phase):
            fields = self.definition.parse_fields({f.name: f.data for f in fc})
            self.created.append(fields)
            return K3Plugin(self.definition, fields)

    return K3Plugin, K3PluginCreator


# The registry does not own the Python creators: one freed while registered crashes the next lookup
# (a segfault in get_creator, seen when an engine runner's activation registered them and dropped what
# register returned), so every creator registered here lives as long as the process.
_REGISTERED: list[Any] = []


def register(trt: ModuleType) -> dict[str, Any]:
    """Registers a creator per definition with `trt`'s plugin registry; returns them by op name (the
    current version of each).
    Idempotent: a creator already registered for a definition is returned as it is."""
    _, creator_class = plugin_classes(trt)
    registry = trt.get_plugin_registry()
    creators = {}
    for definition in DEFINITIONS:
        existing = registry.get_creator(definition.name, definition.version, definition.namespace)
        if existing is None:
            existing = creator_class(definition)
            registry.register_creator(existing, definition.namespace)
            _REGISTERED.append(existing)
        creators.setdefault(definition.name, existing)  # the current version (DEFINITIONS lists it first)
    return creators
