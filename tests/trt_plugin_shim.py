"""Full TensorRT's own `tensorrt.plugin` package, run on CPU over TensorRT-RTX: test support.

`tensorrt.plugin` (registration, validation, the plugin and creator classes that call a plugin's
register / autotune / impl / aot_impl functions) is plain Python, shipped in the tensorrt-cu13-bindings
wheel as `tensorrt_bindings/plugin/` (a dev dependency, pinned). Every module there imports the
compiled `tensorrt`, which needs libnvinfer (not installable here). `load()` gives those modules a
`tensorrt` that is TensorRT-RTX's module plus the few names TensorRT-RTX 1.7 lacks, so that tests run
TensorRT's code on our functions rather than a copy of its rules.

`load()` installs `tensorrt` in `sys.modules`, and the plugins it registers go to TensorRT-RTX's
process-wide plugin registry (where they would clash with `k3plugins.trt`'s creators of the same
names): call it in a fresh process (`run`), never in a test process.
"""

from __future__ import annotations

import enum
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

BINDINGS = "tensorrt_cu13_bindings"


# The shims: each is a name full TensorRT 11's tensorrt.so defines and TensorRT-RTX 1.7's does not.

class QuickPluginCreationRequest(enum.Enum):
    """nvinfer1::QuickPluginCreationRequest (NvInferRuntimePlugin.h): how a creator is asked for a
    plugin's JIT or AOT form. Its presence is what `tensorrt.plugin._export.IS_AOT_ENABLED` tests, which
    gates `aot_impl`'s validation of the return annotation and the AOT plugin class."""

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


def run(code: str, timeout: float = 600) -> Any:
    """Runs `code` in a fresh Python process after `trt = tensorrt_module(); trtp = load()`; the code
    sets `result` (JSON-serialisable), which is returned. A failure raises with the process's stderr."""
    program = ("import json, sys\n"
               f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
               "import trt_plugin_shim\n"
               "trtp = trt_plugin_shim.load()\n"
               "import tensorrt as trt\n"
               f"{code}\n"
               "print('RESULT ' + json.dumps(result))\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=timeout,
                          check=False)
    if done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}:\n{done.stderr[-4000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))
