"""A TensorRT engine as a stateful runner: its caches on the GPU, every tensor bound by address.

    runner = EngineRunner(Path("t.engine"), Path("out/tiny"))   # the engine and the export it was built from
    runner.activate(); runner.reset(batch=2)
    outputs = runner.infer({"input_ids": ids, "cache_lengths": c, "input_lengths": n})

The one engine runner of `check --engine`, `check --build` and the runtime (`--runner engine`).
What it binds where is a `BindingPlan`, derived on any machine from the export (export.json and its
graph's structure) and the engine's build record (its optimization profiles):

- feeds (token ids or AttnRes tensors, lengths): the caller's tensors, copied to the GPU when they
  come from the host;
- caches: device buffers allocated once per `reset`, the MLA latents and KDA states written in place
  (the present output bound to its past input's buffer: TensorRT's KV_CACHE_UPDATE layer and the
  KDA plugin's aliased state require it), the conv tails, which ordinary layers rewrite whole, written
  into a spare buffer that becomes the next call's past;
- everything else (logits, routing choices, partial sums, taps): a buffer of the call's shape.

The profile is picked by the call (the tightest one that takes every input's shape: decode for a
batch of single tokens within its batch, else prefill) and held by the execution context until another
is needed. The engine runs on the runner's own CUDA stream with its GPU current; nothing goes to the
host but the outputs the caller names (`host_outputs`). Every output is bound, the checking outputs
(routing, partial sums) included, whoever reads them: TensorRT runs nothing with an output unbound.
What TensorRT requires of the bindings is checked in two places, `engine_bindings` (once, against what
the engine says of its tensors) and `enqueue` (each call), each rule with its reason.

Only loading the engine (`load_engine`) and the CUDA device and stream calls need a GPU (an engine
cannot be deserialized without one). The plan is tested against the INetworkDefinition TensorRT-RTX
parses (tests/test_engine_runner.py), and every other line runs there over a CPU stand-in of an engine
and its execution context that refuses what TensorRT refuses (tests/engine_standin.py: the parsed
network evaluated on the memory at the bound addresses; not an engine).
"""

from __future__ import annotations

import importlib.util
import json
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from k3export.artifacts import BUILD_MANIFEST, read_manifest
from k3export.errors import UserError
from k3export.onnx.domain import DOMAIN
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE, TensorSpec, resolve_shape
from k3export.onnx.runner import PRESENT, Signature, StatefulRunner, present_to_past


def require_engine_runtime(what: str, instead: str = "") -> None:
    """Refuses `what` (a command or option) naming what is missing, unless this machine has an NVIDIA
    GPU and TensorRT (either flavour); `instead` says what to do on this machine."""
    missing = []
    if not torch.cuda.is_available():
        missing.append("an NVIDIA GPU (torch.cuda.is_available() is False)")
    if not any(importlib.util.find_spec(m) for m in ("tensorrt", "tensorrt_rtx")):
        missing.append("TensorRT (neither tensorrt nor tensorrt_rtx is installed: pip install -c "
                       "constraints-gpu.txt -e '.[tensorrt]' on a GPU host)")
    if missing:
        raise UserError(f"{what} runs TensorRT engines and needs {' and '.join(missing)}"
                        + (f"; {instead}" if instead else ""))


@dataclass(frozen=True)
class BindingPlan:
    """Which buffer each engine input and output binds to, their dtypes and shapes by named dims,
    and the profiles' limits."""

    feeds: list[TensorSpec]  # the caller's tensors
    caches: list[TensorSpec]  # device buffers held between calls
    in_place: dict[str, str]  # present output -> the past input whose buffer it is written into
    swapped: dict[str, str]  # present output -> past input: written into a spare, swapped in after
    returned: list[TensorSpec]  # outputs in buffers of their own, in the order they are returned
    profiles: list[dict[str, list[list[int]]]]  # per profile: input -> [min, opt, max] shape

    @property
    def outputs(self) -> list[str]:
        """Every engine output, in the order a call returns them."""
        return [*(s.name for s in self.returned), *self.in_place, *self.swapped]

    def dtypes(self) -> dict[str, str]:
        """Every binding's dtype: a present's is its past's."""
        dtypes = {s.name: s.dtype for s in [*self.feeds, *self.caches, *self.returned]}
        dtypes.update({p: dtypes[past] for p, past in {**self.in_place, **self.swapped}.items()})
        return dtypes

    def shapes(self, sizes: dict[str, int]) -> dict[str, list[int]]:
        """Every binding's shape for a call of `sizes` (batch, seq, capacity)."""
        specs = [*self.feeds, *self.caches, *self.returned]
        shapes = {s.name: resolve_shape(s, sizes) for s in specs}
        for present, past in {**self.in_place, **self.swapped}.items():
            shapes[present] = shapes[past]
        return shapes

    def profile(self, sizes: dict[str, int]) -> int:
        """The index of the tightest profile that takes this call's input shapes (the fewest tokens at
        its largest first feed: decode's batch x 1 before prefill's); a UserError naming the limits
        when none does."""
        shapes = self.shapes(sizes)
        fits = [i for i, ranges in enumerate(self.profiles)
                if all(all(lo <= n <= hi for n, lo, hi in zip(shapes[name], low, high, strict=True))
                       for name, (low, _, high) in ranges.items())]
        feed = self.feeds[0].name
        if not fits:
            limits = "; ".join(f"profile {i}: {feed} up to {p[feed][2]}" for i, p in enumerate(self.profiles))
            raise UserError(f"a call of batch {sizes['batch']} x seq {sizes['seq']} fits none of the "
                            f"engine's profiles ({limits}); build it with larger --max-batch / --max-seq / "
                            "--decode-batch / --verify-seq")
        return min(fits, key=lambda i: prod(self.profiles[i][feed][2]))


def aliased_outputs(graph: Path, manifest: dict[str, Any]) -> dict[str, str]:
    """Present output -> past input written in place: export.json's `aliases` (the MLA cache's
    TensorScatter, a KV_CACHE_UPDATE layer in TensorRT) and each k3 plugin output that its definition
    aliases to an input (KDA's final state to its initial state) when both are the graph's own."""
    from k3plugins.definitions import DEFINITIONS

    aliased = {s["name"]: s["aliases"] for s in manifest["outputs"] if s.get("aliases")}
    definitions = {d.name: d for d in DEFINITIONS}
    model = onnx.load(graph, load_external_data=False)
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    for node in model.graph.node:
        definition = definitions.get(node.op_type) if node.domain == DOMAIN else None
        for index, name in enumerate(node.output if definition else []):
            source = definition.aliased_input(index)
            if name in outputs and source >= 0 and node.input[source] in inputs:
                aliased[name] = node.input[source]
    return aliased


def binding_plan(export_dir: Path, profiles: list[dict[str, list[list[int]]]]) -> BindingPlan:
    """The plan of an engine built from `export_dir` with `profiles` (its build record's). Every output
    the engine has is bound, the checking outputs export.json lists apart from its outputs (routing,
    partial sums) included, whoever reads them: TensorRT runs only with every output bound
    (NvInferRuntime.h, setTensorAddress: "each output must have a non-null address or an
    IOutputAllocator" before enqueueV3)."""
    manifest = read_manifest(export_dir, MANIFEST_FILE)
    signature = Signature(manifest)
    in_place = aliased_outputs(export_dir / GRAPH_FILE, manifest)
    checking = [TensorSpec(**s) for key in ("routing_outputs", "partial_outputs")
                for s in manifest.get(key, [])]
    presents = [s.name for s in signature.outputs if s.name.startswith(PRESENT)]
    return BindingPlan(
        feeds=signature.feeds, caches=signature.caches,
        in_place={p: in_place[p] for p in presents if p in in_place},
        swapped={p: present_to_past(p) for p in presents if p not in in_place},
        returned=[*checking, *(s for s in signature.outputs if not s.name.startswith(PRESENT))],
        profiles=profiles)


def engine_record(engine: Path) -> dict[str, Any]:
    """What the build recorded of an engine: its optimization "profiles" and the "backend" (TensorRT
    flavour) that built it, from FILE.json beside an engine `build --onnx` wrote, or from the stage's
    (rank's) entry of a `build RECIPE` folder's manifest and its backend."""
    record = engine.with_name(f"{engine.name}.json")
    if record.is_file():
        try:
            built = json.loads(record.read_text())
            return {"profiles": built["profiles"], "backend": built["backend"]}
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{record}: not a build record with 'profiles' and 'backend' (the record "
                            f"`k3export build --onnx DIR --out {engine.name}` writes); build the engine "
                            "again") from None
    for folder in engine.parents[:3]:
        if (folder / BUILD_MANIFEST).is_file():
            relative = engine.resolve().relative_to(folder.resolve()).as_posix()
            manifest = json.loads((folder / BUILD_MANIFEST).read_text())
            for entry in [e for s in manifest.get("stages", []) for e in [s, *s.get("ranks", [])]]:
                if entry.get("engine") == relative and entry.get("profiles"):
                    return {"profiles": entry["profiles"], "backend": manifest.get("backend")}
    raise UserError(f"{engine}: no build record names it (neither {record.name} beside it nor a "
                    f"`k3export build RECIPE` {BUILD_MANIFEST} above it); build it again")


# setTensorAddress: "The pointer must have at least 256-byte alignment" (NvInferRuntime.h).
ALIGNMENT = 256


def device_allocation(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`count` elements of new device memory: the runner's one allocation, whose blocks CUDA's caching
    allocator starts on 512-byte boundaries (TensorRT's 256 met). The CPU stand-in of the tests puts its
    own device memory here."""
    return torch.empty(count, dtype=dtype, device=device)


def device_buffer(shape: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new buffer of `shape` on `device` that TensorRT can be given: one element at least, because
    CUDA gives no memory (a null pointer) for zero bytes, and TensorRT refuses a null address even for a
    zero-element tensor (`binding_address`)."""
    count = prod(shape)
    return device_allocation(max(count, 1), dtype, device)[:count].view(shape)


def binding_address(tensor: torch.Tensor) -> int:
    """The address TensorRT is given for `tensor`: its data, or for a zero-element tensor (whose
    data_ptr() torch reports as null) where its data would start in its memory (non-null for a
    `device_buffer`)."""
    if tensor.numel():
        return tensor.data_ptr()
    return tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()


def device_tensor(value: np.ndarray | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A feed as the engine reads it: a device tensor of the engine's dtype, contiguous, at a non-null
    aligned address, as it is; anything else (host memory, which TensorRT cannot read, another dtype,
    a strided or misaligned view) copied into a new `device_buffer`."""
    tensor = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
    address = binding_address(tensor)
    if tensor.device.type != "cpu" and tensor.device == device and tensor.dtype == dtype and \
            tensor.is_contiguous() and address and address % ALIGNMENT == 0:
        return tensor
    return device_buffer(list(tensor.shape), dtype, device).copy_(tensor)


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A tensor read to the host; bfloat16 crosses numpy as float32 (which holds it exactly)."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def torch_dtype(spec: TensorSpec) -> torch.dtype:
    return getattr(torch, spec.dtype)


def device_caches(caches: list[TensorSpec], batch: int, capacity: int,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """Zeroed caches for `batch` rows on `device`, each in its own dtype (bfloat16 included)."""
    sizes = {"batch": batch, "capacity": capacity}
    return {s.name: device_buffer(resolve_shape(s, sizes), torch_dtype(s), device).zero_() for s in caches}


# The engine's binding rules, each with its reason, in the two places they are checked: what the engine
# says of its tensors, once when it is loaded (engine_bindings), and every call's bindings, before
# TensorRT runs it (enqueue). TensorRT-Model-Connect checks the same before a run
# (src/runtime/backend/trt_module_impl.cpp: its alias groups); the CPU stand-in of an engine in the
# tests (tests/engine_standin.py) refuses what these rules refuse, so that a runner breaking one fails
# there too.

DTYPE_NAMES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32"}


def engine_bindings(engine: Any, trt: Any, plan: BindingPlan, where: Path) -> BindingPlan:
    """`plan` held to what `engine` says of its tensors, refused (naming the tensor) before anything
    runs where they disagree; returns it with the engine's own in-place pairs:
    - the engine's inputs and outputs are exactly the plan's, in the plan's dtypes (an engine built from
      another export, or from this one without its checking outputs, is named, not run);
    - an output is written into its past input's buffer exactly where the engine says it aliases it
      (ICudaEngine::getAliasedInputTensor). KV_CACHE_UPDATE requires it; for a plugin's aliased
      output "TensorRT may insert copies" (NvInferRuntime.h, PluginCapabilityType / aliased I/O), and
      then the engine reports no alias and the present is written into a spare, as a conv tail is."""
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [s.name for s in [*plan.feeds, *plan.caches]]
    modes = {**dict.fromkeys(inputs, trt.TensorIOMode.INPUT),
             **dict.fromkeys(plan.outputs, trt.TensorIOMode.OUTPUT)}
    unknown = [n for n in names if n not in modes]
    absent = [n for n in modes if n not in names]
    wrong_mode = [n for n in names if n in modes and engine.get_tensor_mode(n) != modes[n]]
    if unknown or absent or wrong_mode:
        what = (f"its tensor {unknown[0]!r} is not in" if unknown else
                f"it has no tensor {absent[0]!r}, which is in" if absent else
                f"its {wrong_mode[0]!r} is an {engine.get_tensor_mode(wrong_mode[0]).name.lower()} in the "
                "engine, not in")
        raise UserError(f"{where}: {what} the binding plan of its export's export.json; it was built from "
                        "another export (or this one with other --routing-outputs); build it again")
    wrong = [f"{n}: the engine's {DTYPE_NAMES.get(engine.get_tensor_dtype(n).name, 'other')}, the plan's {d}"
             for n, d in plan.dtypes().items() if DTYPE_NAMES.get(engine.get_tensor_dtype(n).name) != d]
    if wrong:
        raise UserError(f"{where}: its tensors disagree with its export.json ({'; '.join(wrong)}); it was "
                        "built from another export")
    pasts = {**plan.in_place, **plan.swapped}
    aliased = {n: engine.get_aliased_input_tensor(n) for n in plan.outputs}
    strays = [n for n, source in aliased.items() if source and pasts.get(n) != source]
    if strays:
        raise UserError(f"{where}: the engine writes its output {strays[0]!r} into its input "
                        f"{aliased[strays[0]]!r}, which the export does not pair with it; build it again")
    return BindingPlan(plan.feeds, plan.caches,
                       in_place={p: past for p, past in pasts.items() if aliased[p]},
                       swapped={p: past for p, past in pasts.items() if not aliased[p]},
                       returned=plan.returned, profiles=plan.profiles)


def enqueue(context: Any, plan: BindingPlan, bound: dict[str, torch.Tensor], profile: int,
            shapes: dict[str, list[int]], stream: int, name: str) -> None:
    """One engine call on `stream`: every binding rule checked, then TensorRT's own answers checked,
    each refusal naming the tensor:
    - every input and output bound, and nothing else (enqueueV3 needs every output's address);
    - an output shares an input's buffer only where the engine aliases them (plan.in_place); any other
      shared buffer would be read after it is written;
    - the profile held until set again (an execution context keeps it: "used in subsequent calls",
      setOptimizationProfileAsync), set before the input shapes, which are checked against its ranges
      (setInputShape returns false outside them);
    - every buffer of the shape the context gives its tensor once the input shapes are set
      (getTensorShape), of the engine's dtype and contiguous: TensorRT is given an address alone and
      writes an output's whole shape there in the engine's dtype and strides (getTensorStrides), past
      the end of a smaller buffer, into a strided one's gaps, without a word;
    - every address non-null (`binding_address`)."""
    expected = [s.name for s in [*plan.feeds, *plan.caches]] + plan.outputs
    unbound = [n for n in expected if n not in bound]
    stray = [n for n in bound if n not in expected]
    if unbound:
        raise UserError(f"{name}: no buffer bound to the engine tensor {unbound[0]!r}")
    if stray:
        raise UserError(f"{name}: a buffer bound to {stray[0]!r}, which is not an engine tensor")
    inputs = {binding_address(bound[s.name]): s.name for s in [*plan.feeds, *plan.caches]}
    for output in plan.outputs:
        shared = inputs.get(binding_address(bound[output]))
        if shared != plan.in_place.get(output):
            raise UserError(f"{name}: the output {output!r} is bound to " + (
                f"the buffer of the input {shared!r}, which the engine does not alias to it" if shared else
                f"its own buffer, but the engine writes it in place of {plan.in_place[output]!r}"))
    if context.active_optimization_profile != profile and \
            not context.set_optimization_profile_async(profile, stream):
        raise UserError(f"{name}: TensorRT refused optimization profile {profile} (see the log above)")
    for spec in [*plan.feeds, *plan.caches]:
        if not context.set_input_shape(spec.name, shapes[spec.name]):
            low, _, high = plan.profiles[profile].get(spec.name, (None, None, None))
            raise UserError(f"{name}: TensorRT refused the shape {shapes[spec.name]} of {spec.name!r} in "
                            f"profile {profile} (its range {low} to {high})")
    dtypes = plan.dtypes()
    for tensor, value in bound.items():
        engine_shape = list(context.get_tensor_shape(tensor))
        if list(value.shape) != engine_shape:
            raise UserError(f"{name}: the buffer of {tensor!r} is {list(value.shape)}, the engine's "
                            f"{engine_shape} for this call; the binding plan (export.json) disagrees with "
                            "the engine: build it again from this export")
        if value.dtype != getattr(torch, dtypes[tensor]) or not value.is_contiguous():
            layout = "" if value.is_contiguous() else "strided "
            raise UserError(f"{name}: the buffer of {tensor!r} is a {layout}{value.dtype} tensor; the engine "
                            f"reads a contiguous {dtypes[tensor]} one")
    for tensor, value in bound.items():
        if not context.set_tensor_address(tensor, binding_address(value)):
            raise UserError(f"{name}: TensorRT refused the address of {tensor!r} (see the log above)")
    if not context.execute_async_v3(stream):
        raise UserError(f"{name}: TensorRT could not run the engine (see the log above)")


class EngineRunner(StatefulRunner):
    """An engine built from `export_dir` (its caches, profiles and outputs as `binding_plan` says, its
    in-place pairs as the engine says) on GPU `device`. `call` returns every output, the checking
    outputs included, as numpy for those in `host_outputs` (None: all) and as device tensors otherwise
    (the present caches are the runner's buffers, valid until the next call). `extra_outputs`: the
    checking outputs the caller reads (refused unless the export lists them). `communicator`: an NCCL
    communicator capsule for a rank's engine, whose DIST_COLLECTIVE layers sum over it. `signature`:
    check's (which may carry bfloat16 tensors as float32); default the export's."""

    def __init__(self, engine: Path, export_dir: Path, name: str = "engine",
                 extra_outputs: list[str] | None = None, device: int = 0,
                 host_outputs: Collection[str] | None = None, communicator: Any = None,
                 signature: Signature | None = None) -> None:
        super().__init__(signature or Signature(read_manifest(export_dir, MANIFEST_FILE)), name)
        self.engine_path, self.export_dir = Path(engine), Path(export_dir)
        record = engine_record(self.engine_path)
        self.backend = record["backend"]  # the flavour that built it, which alone can run it
        self.plan = binding_plan(self.export_dir, record["profiles"])
        listed = [s.name for s in self.plan.returned]
        unknown = [n for n in extra_outputs or [] if n not in listed]
        if unknown:
            raise UserError(f"{self.export_dir / MANIFEST_FILE}: no output {unknown[0]!r} (the engine's "
                            f"outputs are {listed}; export with --routing-outputs)")
        self.gpu = device
        self.device = torch.device("cuda", device)  # where its buffers are
        self.host_outputs = None if host_outputs is None else set(host_outputs)
        self.communicator = communicator
        self.spares: dict[str, torch.Tensor] = {}
        self.collective_time = 0.0  # the engine's own all-reduces are inside its time

    def activate_impl(self) -> None:
        from k3export.engine.build import load_engine
        from k3export.engine.flavours import load_tensorrt, register_plugins
        from k3export.engine.trt_log import tensorrt_logger

        trt = load_tensorrt(self.backend)
        register_plugins(trt)  # the k3 plugins the engine was built with, as its flavour registers them
        # An execution context and a stream belong to the device current when they are made.
        with torch.cuda.device(self.gpu):
            self.engine = load_engine(trt, tensorrt_logger(trt), self.engine_path,
                                      self.export_dir / GRAPH_FILE)
            self.context = self.engine.create_execution_context()
            self.stream = torch.cuda.Stream()
        self.plan = engine_bindings(self.engine, trt, self.plan, self.engine_path)
        if self.communicator is not None and not self.context.set_communicator(self.communicator):
            raise UserError(f"{self.name}: TensorRT refused the NCCL communicator (set_communicator returned "
                            f"False) for {self.engine_path}: was it built with DistCollective layers?")

    def deactivate_impl(self) -> None:
        del self.context, self.engine

    def empty_caches(self, batch: int) -> dict[str, torch.Tensor]:
        return device_caches(self.plan.caches, batch, self.signature.capacity, self.device)

    def reset(self, batch: int, rows: list[int] | None = None) -> None:
        super().reset(batch, rows)
        if rows is None:
            pasts = {p: self.caches[past] for p, past in self.plan.swapped.items()}
            self.spares = {p: device_buffer(list(c.shape), c.dtype, self.device) for p, c in pasts.items()}

    def call(self, feeds: dict[str, Any]) -> OrderedDict[str, Any]:
        sizes = self.signature.sizes(feeds)
        shapes = self.plan.shapes(sizes)
        bound = {s.name: device_tensor(feeds[s.name], torch_dtype(s), self.device) for s in self.plan.feeds}
        bound.update(self.caches)
        bound.update({p: self.caches[past] for p, past in self.plan.in_place.items()})
        bound.update({p: self.spares[p] for p in self.plan.swapped})
        bound.update({s.name: device_buffer(shapes[s.name], torch_dtype(s), self.device)
                      for s in self.plan.returned})
        self.execute(bound, self.plan.profile(sizes), shapes)
        for present, past in self.plan.swapped.items():
            self.caches[past], self.spares[present] = self.spares[present], self.caches[past]
            bound[present] = self.caches[past]
        return OrderedDict((name, host_array(bound[name]) if self.host_outputs is None
                            or name in self.host_outputs else bound[name]) for name in self.plan.outputs)

    def execute(self, bound: dict[str, torch.Tensor], profile: int, shapes: dict[str, list[int]]) -> None:
        """Runs the engine on `bound` with `profile` on the runner's stream, with its GPU current (a
        check's chain runs each stage's engine on its own GPU in one process)."""
        with torch.cuda.device(self.gpu):
            caller = torch.cuda.current_stream()
            self.stream.wait_stream(caller)  # the feeds were written on the caller's stream
            enqueue(self.context, self.plan, bound, profile, shapes, self.stream.cuda_stream, self.name)
            caller.wait_stream(self.stream)  # what the caller reads next is written
