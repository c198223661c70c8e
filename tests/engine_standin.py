"""A CPU stand-in for a TensorRT engine and its execution context, under the engine runner in tests.

Not an engine: it is the network TensorRT-RTX parses from the engine's export, evaluated on CPU
(k3export.engine.network.NetworkEvaluator), and its numbers are the evaluator's. What it holds is the
contract of the ICudaEngine / IExecutionContext calls the runner makes (read in TensorRT's
include/NvInferRuntime.h), so that a runner that breaks it fails here as it would on a GPU:

- it reads its inputs from, and writes its outputs to, the memory at the addresses it is given
  (setTensorAddress), nothing else: an output the runner does not bind is never seen;
- its GPU memory is `DeviceMemory`: what the runner allocates (k3export.engine.runner.device_allocation),
  laid out as CUDA's allocator does; any other memory is host memory to it, as to TensorRT;
- every rule it holds is in `RULES`, each with where TensorRT states it; a refusal is False (or, for
  set_communicator, the TypeError of TensorRT's Python binding) and the rule and the tensor named in
  `refusals`;
- a context starts on profile 0 and keeps the profile it is given until it is given another
  (setOptimizationProfileAsync: "used in subsequent calls"), forgetting the input shapes set before;
- it reports the shape TensorRT would of every tensor (getTensorShape): an input's as set, an output's
  from the network's dimensions, each dynamic one named in the export's graph by the input dimension it
  equals (and held to what the network computes when it runs);
- a context belongs to the GPU current when it was made, and is enqueued with that GPU current.

`install(monkeypatch)` puts it under the engine runner: `k3export.engine.build.load_engine` gives a
NetworkEngine, and torch.cuda's device, stream and device count are CPU stand-ins that keep the
current GPU (starting at 0, as CUDA does). `CpuMemoryEngineRunner` is the real EngineRunner with its
buffers in host memory, which the stand-in's addresses point at.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Collection, Iterator
from math import prod
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch

from k3export.engine.network import NetworkEvaluator, ParsedNetwork, parse_network, torch_dtype
from k3export.engine.runner import ALIGNMENT, EngineRunner, engine_record


def traced_aliases(network: Any, trt: Any) -> dict[str, str]:
    """Network output -> the network input whose buffer it must be bound to, traced in the parsed
    network itself: the cache input of the KV_CACHE_UPDATE layer that makes it, or the input a plugin
    layer's build capability says its output aliases (get_aliased_input)."""
    producer = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        for k in range(layer.num_outputs):
            producer[layer.get_output(k).name] = (layer, k)
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    aliases = {}
    for i in range(network.num_outputs):
        name = network.get_output(i).name
        layer, index = producer[name]
        if layer.type.name == "KV_CACHE_UPDATE":
            source = layer.get_input(0).name
        elif layer.type == trt.LayerType.PLUGIN_V3:
            layer.__class__ = trt.IPluginV3Layer
            build = layer.plugin.get_capability_interface(trt.PluginCapabilityType.BUILD)
            aliased = build.get_aliased_input(index)
            source = layer.get_input(aliased).name if aliased >= 0 else None
        else:
            source = None
        if source in inputs:
            aliases[name] = source
    return aliases


def at_address(address: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The host memory at `address` as a tensor of `shape` and `dtype` (no copy)."""
    count = prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    memory = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)


# Every rule the stand-in holds, with where TensorRT states it: include/NvInferRuntime.h of NVIDIA/TensorRT
# (TensorRT 11, commit a892d22), IExecutionContext, unless another file is named. TensorRT is given an
# address alone: of the rules on what lies there, it checks the alignment when the address is set and the
# rest on a GPU only by their effect (a write past a buffer, numbers read in another dtype or layout); the
# stand-in refuses each at enqueue, so that a runner that breaks one fails here.
RULES = {
    "not an engine tensor": "setTensorAddress and setInputShape return false 'if the provided name does "
                            "not map to an input (or output) tensor'",
    "profile out of range": "setOptimizationProfileAsync: an index below getNbOptimizationProfiles()",
    "static dimension": "setInputShape: 'Each dimension must agree with the network dimension unless "
                        "the latter was -1'",
    "outside the profile": "setInputShape fails outside the active profile's min..max (kMIN and kMAX, "
                           "IOptimizationProfile::setDimensions in NvInfer.h)",
    "misaligned": "setTensorAddress: 'The pointer must have at least 256-byte alignment' "
                  "(setInputTensorAddress and setOutputTensorAddress return false if it 'does not meet "
                  "alignment requirements')",
    "wrong GPU": "an execution context's memory and kernels are on the GPU current when it was made",
    "no shape since the profile": "setOptimizationProfileAsync 'must be called before calling "
                                  "setInputShape() for all dynamic input tensors ..., which in turn must "
                                  "be called before executeV2()/enqueueV3()'",
    "null address": "setTensorAddress: 'Before calling enqueueV3(), each input must have a non-null "
                    "address and each output must have a non-null address' (zero-element ones too)",
    "host memory": "setTensorAddress: for a kDEVICE tensor 'The pointer must point to a device buffer'",
    "buffer too small": "setTensorAddress: 'a device buffer of sufficient size' for its getTensorShape()",
    "wrong dtype": "the engine reads and writes its own getTensorDataType() (ICudaEngine) at the address",
    "not contiguous": "the engine reads and writes the strides getTensorStrides() gives, a contiguous "
                      "layout for a linear-format tensor, from the address alone",
    "shared buffer": "an input and an output share a buffer exactly where the engine aliases them "
                     "(ICudaEngine::getAliasedInputTensor; TensorRT-Model-Connect refuses both ways before "
                     "a run: src/runtime/backend/trt_module_impl.cpp, its alias groups)",
    "not a communicator": "setCommunicator(void* communicator), bound by python/src/infer/pyCore.cpp with "
                          "pybind11, whose void* caster takes a PyCapsule (or None, a null pointer) and "
                          "raises TypeError for anything else",
}

# CUDA's caching allocator starts every block on a 512-byte boundary (its kMinBlockSize).
BLOCK_ALIGNMENT = 512


class DeviceMemory:
    """The stand-in's GPU memory, and what CUDA knows of a pointer (the allocation it lies in, or that it
    is host memory): blocks of host memory laid out as CUDA's caching allocator lays them out, each on a
    512-byte boundary, and no block (a null pointer) for zero bytes. `tensors` holds the tensor whose
    data_ptr() last gave each address (the runner takes every address it binds so), which the stand-in
    reads a bound buffer's dtype and layout from."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int, weakref.ref]] = {}  # start -> (bytes, its storage while alive)
        self.tensors: dict[int, weakref.ref] = {}

    def allocate(self, count: int, dtype: torch.dtype, device: Any = None) -> torch.Tensor:
        """k3export.engine.runner.device_allocation's stand-in."""
        size = count * dtype.itemsize
        if not size:
            return torch.empty(0, dtype=dtype)
        self.blocks = {start: block for start, block in self.blocks.items() if block[1]() is not None}
        raw = torch.empty(size + BLOCK_ALIGNMENT, dtype=torch.uint8)
        offset = -raw.data_ptr() % BLOCK_ALIGNMENT
        tensor = raw[offset:offset + size].view(dtype)
        self.blocks[tensor.data_ptr()] = (size, weakref.ref(tensor.untyped_storage()))
        return tensor

    def block(self, address: int) -> tuple[int, int] | None:
        """(start, bytes) of the live block that holds `address`; None for host memory."""
        return next(((start, size) for start, (size, storage) in self.blocks.items()
                     if start <= address < start + size and storage() is not None), None)

    def tensor(self, address: int) -> torch.Tensor | None:
        held = self.tensors.get(address)
        return held() if held else None


class Device:
    """torch.cuda's current device, as the stand-ins keep it (0 until a `device` context changes it)."""

    current = 0

    @classmethod
    @contextlib.contextmanager
    def context(cls, index: Any) -> Iterator[None]:
        index = index.index if isinstance(index, torch.device) else index
        previous, cls.current = cls.current, index
        try:
            yield
        finally:
            cls.current = previous


class Stream:
    """A CUDA stream's calls the runner makes; on CPU the work is done when it is issued."""

    cuda_stream = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Stream) -> None:
        pass


class NetworkEngine:
    """The ICudaEngine calls the runner makes, answered from the parsed network of the engine's export
    and the profiles its build record lists. The outputs it writes in place are those traced in the
    network, less `copies`: those for which TensorRT inserted a copy (which it may do for a plugin's
    aliased output: NvInferRuntime.h, kALIASED_PLUGIN_IO) and reports no alias. Its contexts read and
    write `memory`."""

    def __init__(self, net: ParsedNetwork, profiles: list[dict[str, list[list[int]]]],
                 copies: Collection[str] = (), memory: DeviceMemory | None = None) -> None:
        self.net, self.trt, self.profiles = net, net.trt, profiles
        self.memory = memory or DeviceMemory()
        network = net.network
        self.inputs = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
        self.outputs = {network.get_output(i).name: network.get_output(i) for i in range(network.num_outputs)}
        self.aliases = {o: i for o, i in traced_aliases(network, net.trt).items() if o not in copies}
        graph = onnx.load(net.model_path, load_external_data=False).graph
        # Each dimension's name in the export's graph (batch, seq, ...; "" where it is a number).
        self.dim_names = {v.name: [d.dim_param for d in v.type.tensor_type.shape.dim]
                          for v in [*graph.input, *graph.output]}
        self.evaluator = NetworkEvaluator(net)
        self.contexts: list[NetworkContext] = []

    @property
    def num_io_tensors(self) -> int:
        return len(self.inputs) + len(self.outputs)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def get_tensor_name(self, index: int) -> str:
        return [*self.inputs, *self.outputs][index]

    def get_tensor_mode(self, name: str) -> Any:
        mode = self.trt.TensorIOMode
        return mode.INPUT if name in self.inputs else mode.OUTPUT if name in self.outputs else mode.NONE

    def get_tensor_dtype(self, name: str) -> Any:
        return {**self.inputs, **self.outputs}[name].dtype

    def get_aliased_input_tensor(self, name: str) -> str | None:
        return self.aliases.get(name)

    def create_execution_context(self) -> NetworkContext:
        self.contexts.append(NetworkContext(self, Device.current))
        return self.contexts[-1]


class NetworkContext:
    """The IExecutionContext calls the runner makes, refusing what TensorRT refuses (RULES), evaluating
    the network on the memory at the bound addresses."""

    def __init__(self, engine: NetworkEngine, gpu: int) -> None:
        self.engine, self.gpu = engine, gpu
        self.active_optimization_profile = 0  # "The newly created execution context will be assigned
        self.shapes: dict[str, list[int]] = {}  # optimization profile 0"
        self.addresses: dict[str, int] = {}
        self.communicator: Any = None
        self.refusals: list[str] = []
        self.calls: list[tuple[int, dict[str, int]]] = []  # (profile, output name -> address)

    def refuse(self, rule: str, detail: str) -> bool:
        """False, TensorRT's answer, with the rule (a key of RULES) and what broke it kept."""
        assert rule in RULES, rule
        self.refusals.append(f"{rule}: {detail}")
        return False

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        if not 0 <= index < self.engine.num_optimization_profiles:
            return self.refuse("profile out of range", f"{index} of {self.engine.num_optimization_profiles}")
        self.active_optimization_profile = index
        self.shapes = {}  # the shapes set before were the previous profile's: "no shape since the profile"
        return True

    def set_input_shape(self, name: str, shape: list[int]) -> bool:
        if name not in self.engine.inputs:
            return self.refuse("not an engine tensor", f"set_input_shape: {name!r} is not an input")
        shape, declared = list(shape), list(self.engine.inputs[name].shape)
        if len(shape) != len(declared) or any(d not in (-1, n)
                                              for d, n in zip(declared, shape, strict=False)):
            return self.refuse("static dimension", f"{name!r} {shape}, the network's {declared}")
        index = self.active_optimization_profile
        low, _, high = self.engine.profiles[index].get(name, (declared,) * 3)
        if any(n < lo for n, lo in zip(shape, low, strict=True)):
            return self.refuse("outside the profile", f"{name!r} {shape} below profile {index}'s min {low}")
        if any(n > hi for n, hi in zip(shape, high, strict=True)):
            return self.refuse("outside the profile", f"{name!r} {shape} above profile {index}'s max {high}")
        self.shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        """An input's shape as set (-1 where a dynamic one is not); an output's from the network's, each
        -1 resolved by its name in the export's graph (an input dimension's, or a product of them such
        as batch*seq) once those inputs are set."""
        if name in self.engine.inputs:
            return tuple(self.shapes.get(name, self.engine.inputs[name].shape))
        known = {dim: self.shapes[i][k] for i, dims in self.engine.dim_names.items() if i in self.shapes
                 for k, dim in enumerate(dims) if dim}

        def size(n: int, dim: str) -> int:
            factors = dim.split("*") if dim else []
            return n if n >= 0 or not all(f in known for f in factors) else prod(known[f] for f in factors)

        dims = zip(self.engine.outputs[name].shape, self.engine.dim_names[name], strict=True)
        return tuple(size(n, dim) for n, dim in dims)

    def set_tensor_address(self, name: str, address: int) -> bool:
        if name not in self.engine.inputs and name not in self.engine.outputs:
            return self.refuse("not an engine tensor", f"set_tensor_address: {name!r}")
        if address % ALIGNMENT:
            return self.refuse("misaligned", f"{name!r} at {address:#x}")
        self.addresses[name] = address  # null included: "Pass data=nullptr to reset to the default state"
        return True

    def set_communicator(self, communicator: Any) -> bool:
        if communicator is None:
            return self.refuse("not a communicator", "None, a null communicator")
        if type(communicator).__name__ != "PyCapsule":
            self.refuse("not a communicator", type(communicator).__name__)
            raise TypeError("set_communicator(): incompatible function arguments. The following argument "
                            "types are supported: (self, communicator: capsule) -> bool; invoked with a "
                            f"{type(communicator).__name__}")
        self.communicator = communicator
        return True

    def binding_refusal(self, name: str) -> tuple[str, str] | None:
        """The rule (and its detail) the memory at `name`'s address breaks for this call, if any."""
        address = self.addresses.get(name, 0)
        if not address:
            return "null address", f"{name!r}" + ("" if name in self.addresses else " (never set)")
        shape = list(self.get_tensor_shape(name))
        dtype = torch_dtype(self.engine.get_tensor_dtype(name))
        size = prod(shape) * dtype.itemsize
        block = self.engine.memory.block(address)
        if block is None:
            return "host memory", f"{name!r} at {address:#x}, in no block of the GPU's"
        start, length = block
        if address + size > start + length:
            return "buffer too small", (f"{name!r} {shape} {dtype} needs {size} B; its block ends "
                                        f"{start + length - address} B past {address:#x}")
        tensor = self.engine.memory.tensor(address)
        if size and tensor is not None and tensor.dtype != dtype:
            return "wrong dtype", f"{name!r}: a {tensor.dtype} buffer, the engine's {dtype}"
        if size and tensor is not None and not tensor.is_contiguous():
            return "not contiguous", f"{name!r}: strides {tensor.stride()} of shape {list(tensor.shape)}"
        return None

    def execute_async_v3(self, stream: int) -> bool:
        engine = self.engine
        if Device.current != self.gpu:
            return self.refuse("wrong GPU", f"GPU {Device.current} current; the context is GPU {self.gpu}'s")
        unshaped = [n for n in engine.inputs if n not in self.shapes]
        if unshaped:
            return self.refuse("no shape since the profile", f"input {unshaped[0]!r}")
        for name in [*engine.inputs, *engine.outputs]:
            refusal = self.binding_refusal(name)
            if refusal:
                return self.refuse(*refusal)
        owners = {self.addresses[n]: n for n in engine.inputs}
        for output in engine.outputs:
            shared, aliased = owners.get(self.addresses[output]), engine.aliases.get(output)
            if shared != aliased:
                why = f"shares input {shared!r}'s address" if shared else \
                    f"is aliased to {aliased!r}, bound elsewhere"
                return self.refuse("shared buffer", f"output {output!r} {why}")
        feeds = {n: at_address(self.addresses[n], self.shapes[n], torch_dtype(t.dtype))
                 for n, t in engine.inputs.items()}
        with torch.no_grad():
            results = {n: v.clone() for n, v in engine.evaluator.evaluate(feeds).items()}
        for name, value in results.items():
            reported = list(self.get_tensor_shape(name))
            assert list(value.shape) == reported, f"the stand-in reported {name!r} {reported}, the network " \
                                                  f"computed {list(value.shape)}"
            at_address(self.addresses[name], reported, value.dtype).copy_(value)
        self.calls.append((self.active_optimization_profile,
                           {n: self.addresses[n] for n in engine.outputs}))
        return True


_PARSED: dict[tuple[str, int], ParsedNetwork] = {}


def parsed(graph: Path, trt: Any) -> ParsedNetwork:
    """The parsed network of `graph`, parsed once per file as it is (a test's engines share it)."""
    key = (str(graph.resolve()), graph.stat().st_mtime_ns)
    if key not in _PARSED:
        _PARSED[key] = parse_network(graph, trt)
    return _PARSED[key]


class CpuMemoryEngineRunner(EngineRunner):
    """The engine runner with its buffers in host memory (where the stand-in reads and writes); every
    other line is EngineRunner's. With `install`, what it loads is a NetworkEngine."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = torch.device("cpu")


def install(monkeypatch: pytest.MonkeyPatch, gpus: int = 1,
            copies: Collection[str] = ()) -> list[NetworkEngine]:
    """The stand-in under the engine path: every EngineRunner made is a CpuMemoryEngineRunner, each
    engine it loads the NetworkEngine of the export's network and the engine's recorded profiles;
    torch.cuda's device and streams are the CPU stand-ins, `gpus` GPUs counted, and this machine's
    refusal of engines (no GPU) lifted; the runner's device memory is one DeviceMemory, every address
    a tensor's data_ptr() gives recorded there. Returns the engines loaded, in order."""
    import k3export.engine.build
    import k3export.engine.runner

    loaded: list[NetworkEngine] = []
    memory = DeviceMemory()
    data_ptr = torch.Tensor.data_ptr

    def load_engine(trt: Any, logger: Any, path: Path, weights: Path) -> NetworkEngine:
        loaded.append(NetworkEngine(parsed(weights, trt), engine_record(path)["profiles"], copies, memory))
        return loaded[-1]

    def recorded_data_ptr(tensor: torch.Tensor) -> int:
        address = data_ptr(tensor)
        memory.tensors[address] = weakref.ref(tensor)
        return address

    Device.current = 0
    monkeypatch.setattr(k3export.engine.build, "load_engine", load_engine)
    monkeypatch.setattr(k3export.engine.runner, "EngineRunner", CpuMemoryEngineRunner)
    monkeypatch.setattr(k3export.engine.runner, "device_allocation", memory.allocate)
    monkeypatch.setattr(torch.Tensor, "data_ptr", recorded_data_ptr)
    monkeypatch.setattr(k3export.engine.runner, "require_engine_runtime", lambda what, instead="": None)
    monkeypatch.setattr(torch.cuda, "device", Device.context)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    return loaded


def engines_recorded(build: Path, out: Path, limits: Any) -> Path:
    """A copy at `out` of a `k3export build RECIPE --backend onnx` folder whose manifest records an
    engine for every stage (every rank), with the profiles of `limits` (k3export.engine.build.Limits)
    and backend tensorrt-rtx, as a TensorRT build records them; the engine files hold no engine (the
    stand-in reads none), so only the stand-in can load them."""
    import json
    import shutil

    from k3export.artifacts import BUILD_MANIFEST
    from k3export.engine.build import profile_shapes
    from k3export.onnx.export import MANIFEST_FILE

    shutil.copytree(build, out)
    manifest = json.loads((out / BUILD_MANIFEST).read_text())
    for entry in [e for s in manifest["stages"] for e in s.get("ranks", [s])]:
        export = json.loads((out / entry["folder"] / MANIFEST_FILE).read_text())
        entry["engine"] = f"{entry['folder']}/standin.engine"
        entry["profiles"] = profile_shapes(export, limits)
        (out / entry["engine"]).write_text("not an engine: tests/engine_standin.py stands in for it\n")
    manifest["backend"] = "tensorrt-rtx"
    (out / BUILD_MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out
