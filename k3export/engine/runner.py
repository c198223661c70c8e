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
batch of single tokens within its batch, else prefill). The engine runs on the runner's own CUDA
stream; nothing goes to the host but the outputs the caller names (`host_outputs`).

Only `EngineRunner.activate_impl`, `execute` and `_engine_dtypes` need a GPU (an engine cannot be
deserialized without one); the plan is tested against the INetworkDefinition TensorRT-RTX parses
(tests/test_engine_runner.py), and the runner's binding and cache logic runs there with the parsed
network evaluated on CPU in the engine's place (`NetworkExecution`, which is not an engine).
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
                       "constraints.txt -e '.[tensorrt]' on a GPU host)")
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
                            "--decode-batch")
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


def binding_plan(export_dir: Path, profiles: list[dict[str, list[list[int]]]],
                 extra_outputs: Collection[str] = ()) -> BindingPlan:
    """The plan of an engine built from `export_dir` with `profiles` (its build record's), returning
    `extra_outputs` too (the routing or partial sums export.json lists apart from its outputs)."""
    manifest = read_manifest(export_dir, MANIFEST_FILE)
    signature = Signature(manifest)
    in_place = aliased_outputs(export_dir / GRAPH_FILE, manifest)
    listed = {s["name"]: TensorSpec(**s) for key in ("routing_outputs", "partial_outputs")
              for s in manifest.get(key, [])}
    unknown = [name for name in extra_outputs if name not in listed]
    if unknown:
        raise UserError(f"{export_dir / MANIFEST_FILE}: no output {unknown[0]!r} (the engine's extra outputs "
                        f"are {sorted(listed) or 'none'}; export with --routing-outputs)")
    presents = [s.name for s in signature.outputs if s.name.startswith(PRESENT)]
    return BindingPlan(
        feeds=signature.feeds, caches=signature.caches,
        in_place={p: in_place[p] for p in presents if p in in_place},
        swapped={p: present_to_past(p) for p in presents if p not in in_place},
        returned=[*(listed[n] for n in extra_outputs),
                  *(s for s in signature.outputs if not s.name.startswith(PRESENT))],
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


def device_tensor(value: np.ndarray | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A feed as a contiguous tensor of the engine's dtype on `device` (copied only if it is not one)."""
    tensor = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
    return tensor.to(device=device, dtype=dtype).contiguous()


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
    return {s.name: torch.zeros(resolve_shape(s, sizes), dtype=torch_dtype(s), device=device) for s in caches}


class EngineRunner(StatefulRunner):
    """An engine built from `export_dir` (its caches, profiles and extra outputs as `binding_plan`
    says) on GPU `device`. `call` returns every output, as numpy for those in `host_outputs` (None:
    all) and as device tensors otherwise (the present caches are the runner's buffers, valid until the
    next call). `communicator`: an NCCL communicator capsule for a rank's engine, whose DIST_COLLECTIVE
    layers sum over it. `signature`: check's (which may carry bfloat16 tensors as float32); default the
    export's."""

    def __init__(self, engine: Path, export_dir: Path, name: str = "engine",
                 extra_outputs: list[str] | None = None, device: int = 0,
                 host_outputs: Collection[str] | None = None, communicator: Any = None,
                 signature: Signature | None = None) -> None:
        super().__init__(signature or Signature(read_manifest(export_dir, MANIFEST_FILE)), name)
        self.engine_path, self.export_dir = Path(engine), Path(export_dir)
        record = engine_record(self.engine_path)
        self.backend = record["backend"]  # the flavour that built it, which alone can run it
        self.plan = binding_plan(self.export_dir, record["profiles"], extra_outputs or [])
        self.device = torch.device("cuda", device)
        self.host_outputs = None if host_outputs is None else set(host_outputs)
        self.communicator = communicator
        self.spares: dict[str, torch.Tensor] = {}
        self.collective_time = 0.0  # the engine's own all-reduces are inside its time

    def activate_impl(self) -> None:  # GPU only
        from k3export.engine.build import load_engine
        from k3export.engine.flavours import load_tensorrt, register_plugins
        from k3export.engine.trt_log import tensorrt_logger

        trt = load_tensorrt(self.backend)
        register_plugins(trt)  # the k3 plugins the engine was built with, as its flavour registers them
        torch.cuda.set_device(self.device)
        self.engine = load_engine(trt, tensorrt_logger(trt), self.engine_path, self.export_dir / GRAPH_FILE)
        self.context = self.engine.create_execution_context()
        wrong = [f"{name}: the engine's {held}, the plan's {want}"
                 for name, held, want in self._engine_dtypes(trt) if held != want]
        if wrong:
            raise UserError(f"{self.engine_path}: its tensors disagree with "
                            f"{self.export_dir / MANIFEST_FILE} ({'; '.join(wrong)}); it was built from "
                            "another export")
        if self.communicator is not None and not self.context.set_communicator(self.communicator):
            raise UserError(f"{self.name}: TensorRT refused the NCCL communicator (set_communicator returned "
                            f"False) for {self.engine_path}: was it built with DistCollective layers?")
        self.stream = torch.cuda.Stream(self.device)
        self.active_profile: int | None = None

    def _engine_dtypes(self, trt: Any) -> list[tuple[str, str, str]]:  # GPU only
        """(tensor, the engine's dtype, the plan's) for every binding."""
        names = {trt.DataType.FLOAT: "float32", trt.DataType.HALF: "float16", trt.DataType.BF16: "bfloat16",
                 trt.DataType.INT64: "int64", trt.DataType.INT32: "int32"}
        specs = [*self.plan.feeds, *self.plan.caches, *self.plan.returned]
        dtypes = {s.name: s.dtype for s in specs}
        dtypes.update({p: dtypes[past] for p, past in {**self.plan.in_place, **self.plan.swapped}.items()})
        return [(n, names.get(self.engine.get_tensor_dtype(n), "other"), d) for n, d in dtypes.items()]

    def deactivate_impl(self) -> None:
        del self.context, self.engine

    def empty_caches(self, batch: int) -> dict[str, torch.Tensor]:
        return device_caches(self.plan.caches, batch, self.signature.capacity, self.device)

    def reset(self, batch: int, rows: list[int] | None = None) -> None:
        super().reset(batch, rows)
        if rows is None:
            self.spares = {p: torch.empty_like(self.caches[past]) for p, past in self.plan.swapped.items()}

    def call(self, feeds: dict[str, Any]) -> OrderedDict[str, Any]:
        sizes = self.signature.sizes(feeds)
        shapes = self.plan.shapes(sizes)
        bound = {s.name: device_tensor(feeds[s.name], torch_dtype(s), self.device) for s in self.plan.feeds}
        bound.update(self.caches)
        bound.update({p: self.caches[past] for p, past in self.plan.in_place.items()})
        bound.update({p: self.spares[p] for p in self.plan.swapped})
        bound.update({s.name: torch.empty(shapes[s.name], dtype=torch_dtype(s), device=self.device)
                      for s in self.plan.returned})
        self.execute(bound, self.plan.profile(sizes), shapes)
        for present, past in self.plan.swapped.items():
            self.caches[past], self.spares[present] = self.spares[present], self.caches[past]
            bound[present] = self.caches[past]
        return OrderedDict((name, host_array(bound[name]) if self.host_outputs is None
                            or name in self.host_outputs else bound[name]) for name in self.plan.outputs)

    def execute(self, bound: dict[str, torch.Tensor], profile: int, shapes: dict[str, list[int]]) -> None:
        """Runs the engine on `bound` (every input and output by name) with `profile`. GPU only."""
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)  # the feeds were written on the caller's stream
        if profile != self.active_profile:
            self.context.set_optimization_profile_async(profile, self.stream.cuda_stream)
            self.active_profile = profile
        for spec in [*self.plan.feeds, *self.plan.caches]:
            self.context.set_input_shape(spec.name, shapes[spec.name])
        for name, tensor in bound.items():
            self.context.set_tensor_address(name, tensor.data_ptr())
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise UserError(f"{self.name}: TensorRT could not run {self.engine_path} (see the log above)")
        caller.wait_stream(self.stream)  # what the caller reads next is written
