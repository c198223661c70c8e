"""Full TensorRT's own `tensorrt.plugin` package, run on CPU over TensorRT-RTX: test support.

`tensorrt.plugin` (registration, validation, the plugin and creator classes that call a plugin's
register / autotune / impl / aot_impl functions) is plain Python, shipped in the tensorrt-cu13-bindings
wheel as `tensorrt_bindings/plugin/` (a dev dependency, pinned). Every module there imports the
compiled `tensorrt`, which needs libnvinfer (not installable here). `load()` gives those modules a
`tensorrt` that is TensorRT-RTX's module plus the few names TensorRT-RTX 1.7 lacks, so that tests run
TensorRT's code on our functions rather than a copy of its rules.

`load()` installs `tensorrt` in `sys.modules`, and the plugins it registers go to TensorRT-RTX's
process-wide plugin registry (where they would clash with `k3plugins.trt`'s creators of the same
names): call it in a fresh process (tests/trt_plugin_worker.py), never in a test process.
"""

from __future__ import annotations

import ctypes
import enum
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np

BINDINGS = "tensorrt_cu13_bindings"


# The shims: each is a name full TensorRT 11's tensorrt.so defines and TensorRT-RTX 1.7's does not.

class QuickPluginCreationRequest(enum.Enum):
    """nvinfer1::QuickPluginCreationRequest (TensorRT's include/impl/NvInferPythonPlugin.h, these values):
    how a creator is asked for a plugin's JIT or AOT form. Its presence is what
    `tensorrt.plugin._export.IS_AOT_ENABLED` tests, which gates `aot_impl`'s validation of the return
    annotation and the AOT plugin class."""

    UNKNOWN = 0
    PREFER_JIT = 1
    PREFER_AOT = 2
    STRICT_JIT = 3
    STRICT_AOT = 4


class IPluginV3QuickAOTBuild:
    """The AOT build capability `_TemplateAOTPlugin` derives from (get_kernel, get_launch_params,
    get_timing_cache_id are the plugin's own Python methods); only its __init__ is called on it."""


class ISymExpr:
    """The base of `tensorrt.plugin`'s SymExprImpl, a scalar argument expression that an AOT plugin hands
    TensorRT (`type`, `dtype`, `expr` are set by SymExprImpl itself)."""


def tensorrt_module() -> types.ModuleType:
    """A module named `tensorrt`: TensorRT-RTX's names, then the shims above."""
    import tensorrt_rtx

    trt = types.ModuleType("tensorrt")
    trt.__dict__.update({k: v for k, v in vars(tensorrt_rtx).items() if not k.startswith("__")})
    # Each missing from TensorRT-RTX 1.7 (the classes say what tensorrt.plugin does with it).
    trt.QuickPluginCreationRequest = QuickPluginCreationRequest
    trt.IPluginV3QuickAOTBuild = IPluginV3QuickAOTBuild
    trt.ISymExpr = ISymExpr
    return trt


def plugin_dir() -> Path:
    """`tensorrt_bindings/plugin/` of the installed wheel (found without importing its package, whose
    __init__ loads tensorrt.so)."""
    return Path(str(importlib.metadata.distribution(BINDINGS).locate_file("tensorrt_bindings/plugin")))


def load() -> types.ModuleType:
    """`import tensorrt.plugin` as full TensorRT has it, over `tensorrt_module()`; returns the plugin
    module. Once per process (see the module's docstring)."""
    trt = tensorrt_module()
    sys.modules["tensorrt"] = trt
    path = plugin_dir()
    spec = importlib.util.spec_from_file_location("tensorrt.plugin", path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    plugin = importlib.util.module_from_spec(spec)
    sys.modules["tensorrt.plugin"] = plugin
    trt.plugin = plugin
    spec.loader.exec_module(plugin)
    return plugin


# Stand-ins for what TensorRT's C++ builder hands a plugin while it builds: dimension expressions and their
# builder, the launch-parameter and scalar-argument setters. No builder here can call a tensorrt.plugin
# plugin (TensorRT-RTX's parser refuses it: "TensorRT-RTX imports IPluginV3 plugins registered with an
# IPluginCreatorV3One creator only"), so tests call the plugin's methods themselves with these.

class DimExpr:
    """Stands for trt.IDimensionExpr: a constant, or a function of named sizes (a dynamic dimension)."""

    def __init__(self, evaluate: Any, constant: int | None = None) -> None:
        self.evaluate, self.constant = evaluate, constant

    def is_constant(self) -> bool:
        return self.constant is not None

    def get_constant_value(self) -> int:
        return self.constant


def symbol(name: str) -> DimExpr:
    """A dynamic dimension, its value the size `name` given to `DimExpr.evaluate`."""
    return DimExpr(lambda sizes: sizes[name])


def dim(value: int | str) -> DimExpr:
    return symbol(value) if isinstance(value, str) else ExprBuilder().constant(value)


_OPERATIONS = {"SUM": lambda a, b: a + b, "PROD": lambda a, b: a * b, "MAX": max, "MIN": min,
               "SUB": lambda a, b: a - b, "EQUAL": lambda a, b: int(a == b), "LESS": lambda a, b: int(a < b),
               "FLOOR_DIV": lambda a, b: a // b, "CEIL_DIV": lambda a, b: -(-a // b)}


class ExprBuilder:
    """Stands for trt.IExprBuilder (`constant`, `operation`), folding constants as TensorRT does."""

    def constant(self, value: int) -> DimExpr:
        return DimExpr(lambda sizes: value, value)

    def operation(self, op: Any, a: DimExpr, b: DimExpr) -> DimExpr:
        f = _OPERATIONS[op.name]
        if a.is_constant() and b.is_constant():
            return self.constant(f(a.constant, b.constant))
        return DimExpr(lambda sizes: f(a.evaluate(sizes), b.evaluate(sizes)))


class LaunchParams:
    """Stands for the IKernelLaunchParams an AOT plugin fills (each field a SymExprImpl)."""

    KEYS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")


class SymExprSetter(list):
    """Stands for the ISymExprs an AOT plugin fills with its scalar arguments."""

    nbSymExprs = 0  # TensorRT's name

    def __setitem__(self, index: int, value: Any) -> None:
        self.extend([None] * (index + 1 - len(self)))
        super().__setitem__(index, value)


def use_stand_ins(trt: types.ModuleType) -> None:
    """Makes tensorrt.plugin take the stand-ins' expressions: its `isinstance(value, trt.IDimensionExpr)`
    (tensorrt/plugin/_tensor.py) and `trt.DimsExprs(n)` (_plugin_class.py, get_output_shapes)."""
    trt.IDimensionExpr = DimExpr
    trt.DimsExprs = lambda n: [None] * n


def use_host_memory(torch: types.ModuleType) -> None:
    """Lets a JIT `impl` launch on the CPU (Triton's interpreter, host memory): `torch.as_tensor(x,
    device="cuda")` reads `x.__cuda_array_interface__` as CUDA torch does and wraps the host memory it points
    to; CUDA streams are none. Device pointers handed to a plugin are then host addresses."""
    as_tensor = torch.as_tensor

    def as_host_tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        if device != "cuda":
            return as_tensor(data, *args, device=device, **kwargs)
        interface = data.__cuda_array_interface__  # raises where TensorRT's Tensor has no interface (BF16)
        dtype, shape = np.dtype(interface["typestr"]), tuple(interface["shape"])
        contiguous = tuple(int(np.prod(shape[i + 1:])) * dtype.itemsize for i in range(len(shape)))
        if interface.get("strides") not in (None, contiguous):
            raise ValueError(f"not contiguous: strides {interface['strides']} for shape {shape}")
        size = int(np.prod(shape)) * dtype.itemsize
        memory = (ctypes.c_byte * size).from_address(interface["data"][0])
        return torch.from_numpy(np.frombuffer(memory, dtype=dtype).reshape(shape))

    torch.as_tensor = as_host_tensor
    torch.cuda.ExternalStream = lambda handle: None  # torch.cuda.stream(None) changes nothing
