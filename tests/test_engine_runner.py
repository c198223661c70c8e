"""The engine runner (k3export.engine.runner) without a GPU: its binding plan against the network
TensorRT-RTX parses from the same export, the profile each call takes, the build records it reads,
and every line of the runner but the engine's loading, through check's driver, over a CPU stand-in of
an engine and its execution context (tests/engine_standin.py: the parsed network evaluated on the
memory at the addresses bound, refusing what TensorRT refuses). No engine runs here: none
deserializes without a GPU (docs/kernels.md lists the runner's GPU-only lines)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_standin import CpuMemoryEngineRunner, NetworkContext, NetworkEngine, install, traced_aliases

from k3export.check.driver import run_check
from k3export.engine.build import Limits, profile_shapes
from k3export.engine.network import NetworkEvaluator, parse_network, torch_dtype
from k3export.engine.runner import (
    ALIGNMENT,
    EngineRunner,
    binding_address,
    binding_plan,
    device_buffer,
    device_tensor,
    engine_bindings,
    engine_record,
    enqueue,
)
from k3export.errors import UserError
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE
from k3export.runtime.nccl import pointer_capsule

LIMITS = Limits(prefill_batch=2, prefill_seq=80, decode_batch=4)


def manifest_of(export: Path) -> dict[str, Any]:
    return json.loads((export / MANIFEST_FILE).read_text())


@pytest.fixture(scope="module")
def routed_export(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k3-tiny with its expert choices as outputs (export --routing-outputs), as a checking engine's."""
    from test_half_precision import with_routing_outputs

    return with_routing_outputs(tiny_export, tmp_path_factory.mktemp("routed") / "tiny")


@pytest.mark.parametrize("routed", [False, True], ids=["plain", "routing-outputs"])
def test_plan_binds_every_tensor_of_the_parsed_network(tiny_export: Path, routed_export: Path,
                                                       routed: bool) -> None:
    export = routed_export if routed else tiny_export
    manifest = manifest_of(export)
    extra = [s["name"] for s in manifest.get("routing_outputs", [])]
    plan = binding_plan(export, profile_shapes(manifest, LIMITS))
    net = parse_network(export / GRAPH_FILE)
    network = net.network
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    outputs = [network.get_output(i) for i in range(network.num_outputs)]

    # Every input once: fed or a held cache, in the network's dtype, dynamic exactly at named dims.
    bound = {s.name: s for s in [*plan.feeds, *plan.caches]}
    assert sorted(bound) == sorted(t.name for t in inputs)
    for tensor in inputs:
        spec = bound[tensor.name]
        assert torch_dtype(tensor.dtype) == getattr(torch, spec.dtype), tensor.name
        assert [-1 if d in ("batch", "seq") else manifest["capacity"] if d == "capacity" else d
                for d in spec.shape] == list(tensor.shape), tensor.name

    # Every output once; the in-place ones exactly those the network writes into an input's buffer.
    assert sorted(plan.outputs) == sorted(t.name for t in outputs)
    assert plan.in_place == traced_aliases(network, net.trt)
    assert {n.split(".")[-1] for n in plan.in_place} == {"mla_latent", "kda_state"}
    assert {n.split(".")[-1] for n in plan.swapped} == {"q_conv", "k_conv", "v_conv"}
    assert [s.name for s in plan.returned] == [*extra, "logits"]
    dtypes = {t.name: torch_dtype(t.dtype) for t in [*inputs, *outputs]}
    shapes = plan.shapes({"batch": 2, "seq": 5, "capacity": manifest["capacity"]})
    for spec in plan.returned:
        assert dtypes[spec.name] == getattr(torch, spec.dtype)
    for present, past in {**plan.in_place, **plan.swapped}.items():
        assert dtypes[present] == dtypes[past] and shapes[present] == shapes[past]
    # The shapes a call binds are the ones the network computes for it (evaluated on CPU).
    evaluator = NetworkEvaluator(net)
    feeds = {s.name: torch.zeros(shapes[s.name], dtype=getattr(torch, s.dtype)) for s in bound.values()}
    feeds["input_lengths"] = torch.full((2,), 5)
    computed = evaluator.evaluate(feeds)
    assert {name: list(value.shape) for name, value in computed.items()} == {n: shapes[n]
                                                                             for n in plan.outputs}


def test_each_call_takes_the_tightest_profile(tiny_export: Path) -> None:
    manifest = manifest_of(tiny_export)
    plan = binding_plan(tiny_export, profile_shapes(manifest, LIMITS))
    capacity = manifest["capacity"]

    def profile(batch: int, seq: int) -> int:
        return plan.profile({"batch": batch, "seq": seq, "capacity": capacity})

    assert profile(2, 80) == profile(1, 2) == profile(2, 1) - 1 == 0  # prefill, and decode within 4 rows
    assert profile(4, 1) == profile(1, 1) == 1
    for batch, seq in ((3, 2), (5, 1), (1, 81)):
        with pytest.raises(UserError, match=f"batch {batch} x seq {seq} fits none of the engine's profiles"):
            profile(batch, seq)


def test_profiles_are_read_from_either_build_record(tiny_export: Path, tmp_path: Path) -> None:
    """An engine's profiles and the flavour that built it (which alone can run it)."""
    profiles = profile_shapes(manifest_of(tiny_export), LIMITS)
    single = tmp_path / "t.engine"  # `build --onnx`: the record FILE.json beside the engine
    record = {"export": str(tiny_export), "backend": "tensorrt", "profiles": profiles}
    single.with_name("t.engine.json").write_text(json.dumps(record))
    assert engine_record(single) == {"profiles": profiles, "backend": "tensorrt"}
    # `build RECIPE`: a rank's entry in the build folder's manifest.
    build = tmp_path / "build"
    rank = build / "stage-1" / "rank-1"
    rank.mkdir(parents=True)
    entries = [{"index": 0, "engine": "stage-0/stage-0.sm90.engine", "profiles": []},
               {"index": 1, "ranks": [{"rank": r, "engine": f"stage-1/rank-{r}/x.engine",
                                       "profiles": [{"r": r}]} for r in range(2)]}]
    (build / "manifest.json").write_text(json.dumps({"backend": "tensorrt-rtx", "stages": entries}))
    assert engine_record(rank / "x.engine") == {"profiles": [{"r": 1}], "backend": "tensorrt-rtx"}
    with pytest.raises(UserError, match="no build record names it"):
        engine_record(build / "stage-0" / "stage-0.sm90.engine")  # its entry records no profiles


def standin_record(export: Path, folder: Path) -> Path:
    """An engine path whose build record (FILE.json beside it) names `export` and its profiles at
    LIMITS: all the stand-in loads (it reads no engine file)."""
    engine = folder / "network-standing-in.engine"
    profiles = profile_shapes(manifest_of(export), LIMITS)
    record = {"export": str(export), "backend": "tensorrt-rtx", "profiles": profiles}
    engine.with_name(f"{engine.name}.json").write_text(json.dumps(record))
    return engine


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> list[NetworkEngine]:
    """The CPU stand-in under the engine runner (tests/engine_standin.py), two GPUs counted."""
    return install(monkeypatch, gpus=2)


def prefill_feeds(batch: int = 2, seq: int = 5) -> dict[str, np.ndarray]:
    """A prefill of `batch` rows of `seq` tokens from empty caches."""
    return {"input_ids": np.zeros((batch, seq), np.int64), "cache_lengths": np.zeros(batch, np.int64),
            "input_lengths": np.full(batch, seq, np.int64)}


@pytest.mark.parametrize("routed", [False, True], ids=["plain", "routing-outputs"])
def test_engine_runner_carries_its_caches_through_the_check(tiny_export: Path, routed_export: Path,
                                                            routed: bool, standin: list,
                                                            tmp_path: Path) -> None:
    """check's driver with the runner over the stand-in: the caches held between calls, the in-place
    ones in the same buffers every call, the swapped ones alternating between two, the prefill then the
    decode profile held by the execution context. A float32 check of an export with checking outputs
    names none of them, and the runner binds them all the same (an unbound output fails the call)."""
    export = routed_export if routed else tiny_export
    made = []

    def runner(signature: Any, extra: list[str]) -> EngineRunner:
        made.append(CpuMemoryEngineRunner(standin_record(export, tmp_path), export, signature=signature,
                                          extra_outputs=extra))
        return made[-1]

    report = run_check(export, steps=2, prompt_len=10, log=lambda _: None, graph_runner=runner)
    assert report["passed"] and report["greedy_streams_identical"]
    assert all(c["rel"] < 1e-4 for s in report["steps"] for c in s["outputs"])
    (context,) = standin[0].contexts
    assert context.refusals == [] and context.gpu == 0
    assert [profile for profile, _ in context.calls] == [0, 1, 1]  # prefill, then two decode steps
    plan = made[0].plan
    pointers = [written for _, written in context.calls]
    for present in plan.in_place:
        assert len({p[present] for p in pointers}) == 1, f"{present} moved between calls"
    for present in plan.swapped:  # two buffers in turn: each call writes the one the last did not
        first, second, third = (p[present] for p in pointers)
        assert first != second and third == first, f"{present} is not written into a spare in turn"


def test_engine_runner_returns_what_it_promises(routed_export: Path, standin: list, tmp_path: Path) -> None:
    """What a call returns: every output, the checking ones first; those named in host_outputs as numpy
    arrays, the others as tensors in the runner's memory, the present caches its own buffers (the next
    call's past), the routing and logits fresh each call."""
    runner = CpuMemoryEngineRunner(standin_record(routed_export, tmp_path), routed_export,
                                   host_outputs={"logits"})
    runner.activate()
    runner.reset(2)
    first = runner.infer(prefill_feeds(), check_inputs=False)
    routing = [s["name"] for s in manifest_of(routed_export)["routing_outputs"]]
    assert list(first)[:len(routing) + 1] == [*routing, "logits"]
    assert isinstance(first["logits"], np.ndarray)
    assert all(isinstance(first[n], torch.Tensor) and first[n].device == runner.device
               for n in first if n != "logits")
    for present, past in {**runner.plan.in_place, **runner.plan.swapped}.items():
        assert first[present] is runner.caches[past], present
    second = runner.infer({"input_ids": np.zeros((2, 1), np.int64), "cache_lengths": np.full(2, 5),
                           "input_lengths": np.ones(2, np.int64)}, check_inputs=False)
    assert second[routing[0]].data_ptr() != first[routing[0]].data_ptr()
    assert standin[0].contexts[0].refusals == []


def test_engine_runner_makes_its_gpu_current(tiny_export: Path, standin: list, tmp_path: Path) -> None:
    """Two engines of a chain on GPUs 0 and 1 in one process, called in turn: each context is made,
    and enqueued, with its own GPU current (the stand-in refuses another)."""
    runners = [CpuMemoryEngineRunner(standin_record(tiny_export, tmp_path), tiny_export, device=d)
               for d in (1, 0)]
    for runner in runners:
        runner.activate()
        runner.reset(2)
    for _ in range(2):
        for runner in runners:
            runner.infer(prefill_feeds(), check_inputs=False)
    assert [e.contexts[0].gpu for e in standin] == [1, 0]
    assert all(e.contexts[0].refusals == [] and len(e.contexts[0].calls) == 2 for e in standin)


def test_engine_runner_follows_the_engines_aliases(tiny_export: Path, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    """Where TensorRT inserts a copy for the KDA plugin's aliased state (the engine reports no alias),
    the runner writes that state into a spare, as a conv tail; the check still passes."""
    states = [s["name"] for s in manifest_of(tiny_export)["outputs"] if s["name"].endswith("kda_state")]
    engines = install(monkeypatch, copies=states)
    made = []

    def runner(signature: Any, extra: list[str]) -> EngineRunner:
        made.append(CpuMemoryEngineRunner(standin_record(tiny_export, tmp_path), tiny_export,
                                          signature=signature))
        return made[-1]

    report = run_check(tiny_export, steps=1, prompt_len=6, log=lambda _: None, graph_runner=runner)
    assert report["passed"] and engines[0].contexts[0].refusals == []
    assert set(states) <= set(made[0].plan.swapped) and not set(states) & set(made[0].plan.in_place)
    assert {n.split(".")[-1] for n in made[0].plan.in_place} == {"mla_latent"}


def test_engine_tensors_the_plan_does_not_know_are_refused(tiny_export: Path, routed_export: Path) -> None:
    """An engine with outputs its export does not list (built from the export with checking outputs,
    loaded with the plain one's) is named when it is loaded, before anything runs."""
    from engine_standin import NetworkEngine

    net = parse_network(routed_export / GRAPH_FILE)
    engine = NetworkEngine(net, profile_shapes(manifest_of(routed_export), LIMITS))
    plan = binding_plan(tiny_export, engine.profiles)
    with pytest.raises(UserError, match="its tensor 'routing.1' is not in the binding plan"):
        engine_bindings(engine, net.trt, plan, Path("x.engine"))
    assert engine_bindings(engine, net.trt, binding_plan(routed_export, engine.profiles), Path("x.engine"))


class Bindings:
    """A call of batch 2 x seq 5 of k3-tiny's engine over the stand-in, bound as the runner binds it (its
    feeds, caches, spares and output buffers in the stand-in's device memory), for trying one binding
    rule at a time on a fresh execution context of the engine (the runner's own checks bypassed)."""

    def __init__(self, export: Path, loaded: list[NetworkEngine], folder: Path) -> None:
        self.runner = CpuMemoryEngineRunner(standin_record(export, folder), export)
        self.runner.activate()
        self.runner.reset(2)
        self.engine, self.plan = loaded[-1], self.runner.plan
        self.shapes = self.plan.shapes({"batch": 2, "seq": 5, "capacity": self.runner.signature.capacity})
        self.latent = next(iter(self.plan.in_place))
        self.conv = next(iter(self.plan.swapped))

    def valid(self, **changed: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Every tensor bound as the runner binds it, less those `changed` gives None, `changed` over it."""
        runner, plan, cpu = self.runner, self.plan, self.runner.device
        feeds = {s.name: device_tensor(prefill_feeds()[s.name], torch.int64, cpu) for s in plan.feeds}
        outputs = {s.name: device_buffer(self.shapes[s.name], getattr(torch, s.dtype), cpu)
                   for s in plan.returned}
        tensors = {**feeds, **runner.caches, **{p: runner.caches[q] for p, q in plan.in_place.items()},
                   **runner.spares, **outputs, **changed}
        return {n: t for n, t in tensors.items() if t is not None}

    def context(self, profile: int = 0) -> NetworkContext:
        """A fresh execution context on `profile` with every input's shape for this call set."""
        context = self.engine.create_execution_context()
        assert context.set_optimization_profile_async(profile, 0)
        for spec in [*self.plan.feeds, *self.plan.caches]:
            assert context.set_input_shape(spec.name, self.shapes[spec.name])
        return context

    def refusal(self, tensors: dict[str, torch.Tensor], addresses: dict[str, int] | None = None) -> str:
        """What a fresh context refuses when run on `tensors` (or the `addresses` given for some); ""
        when it runs."""
        context = self.context()
        for name, tensor in tensors.items():
            assert context.set_tensor_address(name, binding_address(tensor))
        for name, address in (addresses or {}).items():
            assert context.set_tensor_address(name, address)
        return "" if context.execute_async_v3(0) else context.refusals[-1]


@pytest.fixture
def bindings(tiny_export: Path, standin: list[NetworkEngine], tmp_path: Path) -> Iterator[Bindings]:
    made = Bindings(tiny_export, standin, tmp_path)
    yield made
    made.runner.deactivate()


def host_buffer(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Host memory at TensorRT's alignment (so that only its being host memory is wrong)."""
    raw = torch.zeros(prod(shape) * dtype.itemsize + ALIGNMENT, dtype=torch.uint8)
    offset = -raw.data_ptr() % ALIGNMENT
    return raw[offset:offset + prod(shape) * dtype.itemsize].view(dtype).view(shape)


def test_the_standin_runs_what_the_runner_binds(bindings: Bindings) -> None:
    assert bindings.refusal(bindings.valid()) == ""


def test_the_standin_refuses_a_null_address(bindings: Bindings) -> None:
    """Never set, or set to null (as torch's data_ptr() of a zero-element tensor is)."""
    assert bindings.refusal(bindings.valid(logits=None)) == "null address: 'logits' (never set)"
    assert bindings.refusal(bindings.valid(), {"logits": 0}) == "null address: 'logits'"


def test_the_standin_refuses_a_misaligned_address(bindings: Bindings) -> None:
    context = bindings.context()
    buffer = device_buffer([4096], torch.float32, bindings.runner.device)
    assert not context.set_tensor_address("logits", buffer.data_ptr() + 64)
    assert context.refusals == [f"misaligned: 'logits' at {buffer.data_ptr() + 64:#x}"]
    assert context.set_tensor_address("logits", buffer.data_ptr() + ALIGNMENT)


def test_the_standin_refuses_host_memory(bindings: Bindings) -> None:
    host = host_buffer(bindings.shapes["input_ids"], torch.int64)
    assert bindings.refusal(bindings.valid(input_ids=host)).startswith("host memory: 'input_ids' at ")


def test_the_standin_refuses_an_output_buffer_smaller_than_its_shape(bindings: Bindings) -> None:
    """At enqueue, against the shape the context gives the output (getTensorShape), which is the shape
    TensorRT would give."""
    context = bindings.context()
    assert list(context.get_tensor_shape("logits")) == bindings.shapes["logits"] == [2, 5, 256]
    assert list(context.get_tensor_shape("input_ids")) == [2, 5]
    short = device_buffer([2, 4, 256], torch.float32, bindings.runner.device)
    assert bindings.refusal(bindings.valid(logits=short)) == \
        "buffer too small: 'logits' [2, 5, 256] torch.float32 needs 10240 B; its block ends 8192 B past " \
        f"{short.data_ptr():#x}"


def test_the_standin_refuses_a_buffer_of_another_dtype(bindings: Bindings) -> None:
    wide = device_buffer([2, 5, 256], torch.float64, bindings.runner.device)  # large enough: only its dtype
    assert bindings.refusal(bindings.valid(logits=wide)) == \
        "wrong dtype: 'logits': a torch.float64 buffer, the engine's torch.float32"


def test_the_standin_refuses_a_strided_buffer(bindings: Bindings) -> None:
    transposed = device_buffer([2, 256, 5], torch.float32, bindings.runner.device).transpose(1, 2)
    assert list(transposed.shape) == [2, 5, 256]  # the right shape, size and address; not its layout
    assert bindings.refusal(bindings.valid(logits=transposed)) == \
        "not contiguous: 'logits': strides (1280, 1, 5) of shape [2, 5, 256]"


def test_the_standin_refuses_buffers_shared_where_the_engine_does_not_alias(bindings: Bindings) -> None:
    plan, caches = bindings.plan, bindings.runner.caches
    conv, latent = bindings.conv, bindings.latent
    assert bindings.refusal(bindings.valid(**{conv: caches[plan.swapped[conv]]})) == \
        f"shared buffer: output {conv!r} shares input {plan.swapped[conv]!r}'s address"
    cpu = bindings.runner.device
    elsewhere = device_buffer(list(caches[plan.in_place[latent]].shape), torch.float32, cpu)
    assert bindings.refusal(bindings.valid(**{latent: elsewhere})) == \
        f"shared buffer: output {latent!r} is aliased to {plan.in_place[latent]!r}, bound elsewhere"


def test_the_standin_refuses_a_shape_below_the_profiles_minimum(bindings: Bindings) -> None:
    """Only the minimum broken: input_ids' dims are dynamic, [0, 1] is within decode's maximum [4, 1]."""
    context = bindings.engine.create_execution_context()
    assert context.set_optimization_profile_async(1, 0)
    assert not context.set_input_shape("input_ids", [0, 1])
    assert context.refusals == ["outside the profile: 'input_ids' [0, 1] below profile 1's min [1, 1]"]
    assert not context.set_input_shape("input_ids", [2, 5])  # decode's profile takes one token a row
    assert "above profile 1's max [4, 1]" in context.refusals[-1]
    assert context.set_input_shape("input_ids", [1, 1])


def test_the_standin_refuses_a_shape_against_a_static_dimension(bindings: Bindings) -> None:
    """Only the static dimension broken: an engine whose profile's range would take another capacity
    (TensorRT builds none: the profile's own range pins a static dimension), so that the network's
    dimension alone refuses it."""
    latent = bindings.plan.in_place[bindings.latent]
    profiles = json.loads(json.dumps(bindings.engine.profiles))
    for profile in profiles:
        profile[latent][2][2] += 1  # the maximum's capacity
    wider = NetworkEngine(bindings.engine.net, profiles, memory=bindings.engine.memory)
    context = wider.create_execution_context()
    shape = list(bindings.shapes[latent])
    shape[2] += 1
    assert not context.set_input_shape(latent, shape)
    declared = list(wider.inputs[latent].shape)
    assert context.refusals == [f"static dimension: {latent!r} {shape}, the network's {declared}"]
    assert not context.set_input_shape(latent, shape[:3])  # another rank
    assert context.set_input_shape(latent, bindings.shapes[latent])


def test_the_standin_forgets_the_shapes_when_the_profile_is_switched(bindings: Bindings) -> None:
    """A context that had every shape and address and ran, then given the decode profile: it runs again
    only once the shapes are set for it (a stand-in that keeps them runs the prefill's shapes on it)."""
    context, tensors = bindings.context(), bindings.valid()  # held: TensorRT reads them at enqueue
    for name, tensor in tensors.items():
        assert context.set_tensor_address(name, binding_address(tensor))
    assert context.execute_async_v3(0)
    assert context.set_optimization_profile_async(1, 0) and context.active_optimization_profile == 1
    assert not context.execute_async_v3(0)
    assert context.refusals == ["no shape since the profile: input 'input_ids'"]
    assert not context.set_optimization_profile_async(2, 0)
    assert context.refusals[-1] == "profile out of range: 2 of 2"


def test_the_standin_refuses_names_and_gpus_not_its_own(bindings: Bindings) -> None:
    context = bindings.context()
    assert not context.set_tensor_address("no.such.tensor", 0) and not context.set_input_shape("logits", [1])
    assert context.refusals == ["not an engine tensor: set_tensor_address: 'no.such.tensor'",
                                "not an engine tensor: set_input_shape: 'logits' is not an input"]
    tensors = bindings.valid()
    for name, tensor in tensors.items():
        assert context.set_tensor_address(name, binding_address(tensor))
    with torch.cuda.device(1):
        assert not context.execute_async_v3(0)
    assert context.refusals[-1] == "wrong GPU: GPU 1 current; the context is GPU 0's"


def test_the_standin_takes_a_communicator_in_a_capsule_only(bindings: Bindings) -> None:
    """A PyCapsule, as TensorRT's binding (pybind11's void*) takes; None is a null communicator; an
    integer pointer or any other object is a TypeError there."""
    context = bindings.context()
    with pytest.raises(TypeError, match="incompatible function arguments"):
        context.set_communicator(0x7F00_0000_1000)
    assert not context.set_communicator(None)
    capsule = pointer_capsule(0x7F00_0000_1000)
    assert context.set_communicator(capsule) and context.communicator is capsule
    assert context.refusals == ["not a communicator: int", "not a communicator: None, a null communicator"]


def test_zero_element_tensors_are_bound_at_a_non_null_address(bindings: Bindings) -> None:
    """torch gives a zero-element tensor a null data_ptr() and CUDA no memory for zero bytes; TensorRT
    refuses a null address: the runner binds such a tensor at memory of its own."""
    cpu = bindings.runner.device
    assert torch.empty(0).data_ptr() == 0 == bindings.engine.memory.allocate(0, torch.float32).data_ptr()
    for empty in (device_buffer([2, 0, 256], torch.float16, cpu),
                  device_tensor(np.zeros((2, 0)), torch.int64, cpu)):
        address = binding_address(empty)
        assert address and address % ALIGNMENT == 0 and bindings.engine.memory.block(address)


def test_the_runner_checks_each_buffer_against_the_engines_shapes(bindings: Bindings) -> None:
    """Before a call, every buffer against the shape the context gives its tensor (getTensorShape): a
    plan whose output drifted from the engine's is named, not written past; and against the dtype and
    layout TensorRT writes, which it does not check."""
    runner, plan, shapes = bindings.runner, bindings.plan, bindings.shapes

    def enqueued(tensors: dict[str, torch.Tensor], profile: int = 0) -> None:
        enqueue(runner.context, plan, tensors, profile, shapes, 0, "stage 0")

    short = device_buffer([2, 5, 255], torch.float32, runner.device)
    drifted = "stage 0: the buffer of 'logits' is [2, 5, 255], the engine's [2, 5, 256] for this call"
    with pytest.raises(UserError, match=re.escape(drifted)):
        enqueued(bindings.valid(logits=short))
    transposed = device_buffer([2, 256, 5], torch.float32, runner.device).transpose(1, 2)
    with pytest.raises(UserError, match="'logits' is a strided torch.float32 tensor; the engine reads a "
                                        "contiguous float32 one"):
        enqueued(bindings.valid(logits=transposed))
    wide = device_buffer([2, 5, 256], torch.float64, runner.device)
    with pytest.raises(UserError, match="'logits' is a torch.float64 tensor; the engine reads a contiguous "
                                        "float32 one"):
        enqueued(bindings.valid(logits=wide))
    assert runner.context.refusals == [] and not runner.context.calls


def test_the_runner_refuses_what_the_standin_would(bindings: Bindings) -> None:
    """The runner's own checks refuse the same before TensorRT sees it, each naming the tensor."""
    runner, plan, shapes = bindings.runner, bindings.plan, bindings.shapes
    conv, latent = bindings.conv, bindings.latent

    def enqueued(tensors: dict[str, torch.Tensor], profile: int = 0) -> None:
        enqueue(runner.context, plan, tensors, profile, shapes, 0, "stage 0")

    with pytest.raises(UserError, match="no buffer bound to the engine tensor 'logits'"):
        enqueued(bindings.valid(logits=None))
    with pytest.raises(UserError, match=f"'{conv}' is bound to the buffer of the input"):
        enqueued(bindings.valid(**{conv: runner.caches[plan.swapped[conv]]}))
    elsewhere = device_buffer(list(runner.caches[plan.in_place[latent]].shape), torch.float32, runner.device)
    with pytest.raises(UserError, match=f"'{latent}' is bound to its own buffer"):
        enqueued(bindings.valid(**{latent: elsewhere}))
    with pytest.raises(UserError, match="TensorRT refused the shape .* of 'input_ids' in profile 1"):
        enqueued(bindings.valid(), profile=1)
    enqueued(bindings.valid())
    assert runner.context.active_optimization_profile == 0 and len(runner.context.calls) == 1
