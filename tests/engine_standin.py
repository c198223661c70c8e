"""A CPU stand-in for a TensorRT engine and its execution context, under the engine runner in tests.

Not an engine: it is the network TensorRT-RTX parses from the engine's export, evaluated on CPU
(k3export.engine.network.NetworkEvaluator), and its numbers are the evaluator's. What it holds is the
contract of the ICudaEngine / IExecutionContext calls the runner makes (read in TensorRT's
include/NvInferRuntime.h), so that a runner that breaks it fails here as it would on a GPU:

- it reads its inputs from, and writes its outputs to, the memory at the addresses it is given
  (setTensorAddress), nothing else: an output the runner does not bind is never seen;
- enqueueV3 fails (returns False, the reason logged in `refusals`) unless every input and output has an
  address ("each input must have a non-null address and each output must have a non-null address")
  and every input a shape set since the profile was;
- an output the engine aliases to an input (getAliasedInputTensor: KV_CACHE_UPDATE, and a plugin's
  aliased output unless TensorRT inserted a copy) must share that input's address; an input and an
  output that the engine does not alias must not share one (TensorRT-Model-Connect refuses both before
  a run: src/runtime/backend/trt_module_impl.cpp, its alias groups);
- a context starts on profile 0 and keeps the profile it is given until it is given another
  (setOptimizationProfileAsync: "used in subsequent calls"); shapes are set after it and refused
  outside its ranges or where they disagree with a static dimension (setInputShape returns false);
- names that are not the engine's are refused (setTensorAddress and setInputShape return false);
- a context belongs to the GPU current when it was made, and is enqueued with that GPU current.

`install(monkeypatch)` puts it under the engine runner: `k3export.engine.build.load_engine` gives a
NetworkEngine, and torch.cuda's device, stream and device count are CPU stand-ins that keep the
current GPU (starting at 0, as CUDA does). `CpuMemoryEngineRunner` is the real EngineRunner with its
buffers in host memory, which the stand-in's addresses point at.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Collection, Iterator
from math import prod
from pathlib import Path
from typing import Any

import pytest
import torch

from k3export.engine.network import NetworkEvaluator, ParsedNetwork, parse_network, torch_dtype
from k3export.engine.runner import EngineRunner, engine_record


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
    aliased output: NvInferRuntime.h, kALIASED_PLUGIN_IO) and reports no alias."""

    def __init__(self, net: ParsedNetwork, profiles: list[dict[str, list[list[int]]]],
                 copies: Collection[str] = ()) -> None:
        self.net, self.trt, self.profiles = net, net.trt, profiles
        network = net.network
        self.inputs = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
        self.outputs = {network.get_output(i).name: network.get_output(i) for i in range(network.num_outputs)}
        self.aliases = {o: i for o, i in traced_aliases(network, net.trt).items() if o not in copies}
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
    """The IExecutionContext calls the runner makes, refusing what TensorRT refuses (the module's
    docstring lists what), evaluating the network on the memory at the bound addresses."""

    def __init__(self, engine: NetworkEngine, gpu: int) -> None:
        self.engine, self.gpu = engine, gpu
        self.active_optimization_profile = 0  # "The newly created execution context will be assigned
        self.shapes: dict[str, list[int]] = {}  # optimization profile 0"
        self.addresses: dict[str, int] = {}
        self.communicator: Any = None
        self.refusals: list[str] = []
        self.calls: list[tuple[int, dict[str, int]]] = []  # (profile, output name -> address)

    def refuse(self, why: str) -> bool:
        self.refusals.append(why)
        return False

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        if not 0 <= index < self.engine.num_optimization_profiles:
            return self.refuse(f"profile {index}: the engine has {self.engine.num_optimization_profiles}")
        self.active_optimization_profile = index
        self.shapes = {}  # "must be called before calling setInputShape() for all dynamic input tensors"
        return True

    def set_input_shape(self, name: str, shape: list[int]) -> bool:
        if name not in self.engine.inputs:
            return self.refuse(f"set_input_shape: {name!r} is not an input")
        declared = list(self.engine.inputs[name].shape)
        low, _, high = self.engine.profiles[self.active_optimization_profile].get(name, (declared,) * 3)
        agrees = len(shape) == len(declared) and all(d in (-1, n)
                                                     for d, n in zip(declared, shape, strict=False))
        if not agrees or any(not lo <= n <= hi for n, lo, hi in zip(shape, low, high, strict=True)):
            return self.refuse(f"set_input_shape: {name!r} {list(shape)} outside profile "
                               f"{self.active_optimization_profile}'s {low} .. {high} (network {declared})")
        self.shapes[name] = list(shape)
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        if name not in self.engine.inputs and name not in self.engine.outputs:
            return self.refuse(f"set_tensor_address: {name!r} is not an engine tensor")
        self.addresses[name] = address
        return True

    def set_communicator(self, communicator: Any) -> bool:
        self.communicator = communicator
        return True

    def execute_async_v3(self, stream: int) -> bool:
        engine = self.engine
        if Device.current != self.gpu:
            return self.refuse(f"enqueued with GPU {Device.current} current; the context is GPU {self.gpu}'s")
        unshaped = [n for n in engine.inputs if n not in self.shapes]
        unbound = [n for n in [*engine.inputs, *engine.outputs] if n not in self.addresses]
        if unshaped or unbound:
            return self.refuse(f"no shape for input {unshaped[0]!r}" if unshaped else
                               f"no address for {unbound[0]!r}")
        owners = {self.addresses[n]: n for n in engine.inputs}
        for output in engine.outputs:
            shared, aliased = owners.get(self.addresses[output]), engine.aliases.get(output)
            if shared != aliased:
                return self.refuse(f"output {output!r} shares input {shared!r}'s address" if shared else
                                   f"output {output!r} is aliased to {aliased!r} but bound elsewhere")
        feeds = {n: at_address(self.addresses[n], self.shapes[n], torch_dtype(t.dtype))
                 for n, t in engine.inputs.items()}
        with torch.no_grad():
            results = {n: v.clone() for n, v in engine.evaluator.evaluate(feeds).items()}
        for name, value in results.items():
            at_address(self.addresses[name], list(value.shape), value.dtype).copy_(value)
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
    refusal of engines (no GPU) lifted. Returns the engines loaded, in order."""
    import k3export.engine.build
    import k3export.engine.runner

    loaded: list[NetworkEngine] = []

    def load_engine(trt: Any, logger: Any, path: Path, weights: Path) -> NetworkEngine:
        loaded.append(NetworkEngine(parsed(weights, trt), engine_record(path)["profiles"], copies))
        return loaded[-1]

    Device.current = 0
    monkeypatch.setattr(k3export.engine.build, "load_engine", load_engine)
    monkeypatch.setattr(k3export.engine.runner, "EngineRunner", CpuMemoryEngineRunner)
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
