"""The engine runner (k3export.engine.runner) without a GPU: its binding plan against the network
TensorRT-RTX parses from the same export, the profile each call takes, the build records it reads,
and its binding and cache logic through check's driver with the parsed network evaluated on CPU in
the engine's place. No engine runs here: none deserializes without a GPU (docs/kernels.md lists the
runner's GPU-only lines)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from k3export.check.driver import run_check
from k3export.config import K3Config
from k3export.engine.build import Limits, profile_shapes
from k3export.engine.network import NetworkEvaluator, parse_network, torch_dtype
from k3export.engine.runner import EngineRunner, binding_plan, engine_record
from k3export.errors import UserError
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE, add_checking_outputs

LIMITS = Limits(prefill_batch=2, prefill_seq=80, decode_batch=4)


def manifest_of(export: Path) -> dict[str, Any]:
    return json.loads((export / MANIFEST_FILE).read_text())


@pytest.fixture(scope="module")
def routed_export(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k3-tiny with its expert choices as outputs (export --routing-outputs), as a checking engine's."""
    import shutil

    folder = tmp_path_factory.mktemp("routed") / "tiny"
    shutil.copytree(tiny_export, folder)
    manifest = manifest_of(folder)
    config = K3Config.from_json(folder / "config.json")
    manifest.update(add_checking_outputs(folder / GRAPH_FILE, config, range(*manifest["layers"])))
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    return folder


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


@pytest.mark.parametrize("routed", [False, True], ids=["plain", "routing-outputs"])
def test_plan_binds_every_tensor_of_the_parsed_network(tiny_export: Path, routed_export: Path,
                                                       routed: bool) -> None:
    export = routed_export if routed else tiny_export
    manifest = manifest_of(export)
    extra = [s["name"] for s in manifest.get("routing_outputs", [])]
    plan = binding_plan(export, profile_shapes(manifest, LIMITS), extra)
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


class NetworkExecutedRunner(EngineRunner):
    """EngineRunner with its GPU-only pieces replaced, and nothing else: activation parses the network
    (TensorRT-RTX on CPU) and `execute` evaluates it on the bound tensors, writing each output into
    the buffer bound to it, as an engine writes to the addresses it is given. Not an engine: its
    numbers are the network evaluator's."""

    def activate_impl(self) -> None:
        self.device = torch.device("cpu")
        self.evaluator = NetworkEvaluator(parse_network(self.export_dir / GRAPH_FILE))
        self.calls: list[tuple[int, dict[str, int]]] = []  # (profile, output name -> data pointer)

    def deactivate_impl(self) -> None:
        del self.evaluator

    def execute(self, bound: dict[str, torch.Tensor], profile: int, shapes: dict[str, list[int]]) -> None:
        inputs = {name: bound[name] for name in self.evaluator.inputs}
        with torch.no_grad():
            results = self.evaluator.evaluate(inputs)
        for name, value in results.items():
            bound[name].copy_(value)
        self.calls.append((profile, {name: bound[name].data_ptr() for name in self.plan.outputs}))


def test_engine_runner_carries_its_caches_through_the_check(tiny_export: Path, tmp_path: Path) -> None:
    """check's driver with the runner: the caches held between calls, the in-place ones in the same
    buffers every call, the swapped ones alternating between two, prefill then decode profiles."""
    record = tmp_path / "network-standing-in.engine"
    profiles = profile_shapes(manifest_of(tiny_export), LIMITS)
    record.with_name(f"{record.name}.json").write_text(json.dumps({"export": str(tiny_export),
                                                                   "backend": "tensorrt-rtx",
                                                                   "profiles": profiles}))
    made = []

    def runner(signature: Any, extra: list[str]) -> NetworkExecutedRunner:
        made.append(NetworkExecutedRunner(record, tiny_export, signature=signature, extra_outputs=extra))
        return made[-1]

    report = run_check(tiny_export, steps=2, prompt_len=10, log=lambda _: None, graph_runner=runner)
    assert report["passed"] and report["greedy_streams_identical"]
    assert all(c["rel"] < 1e-4 for s in report["steps"] for c in s["outputs"])
    plan = made[0].plan
    assert [profile for profile, _ in made[0].calls] == [0, 1, 1]  # prefill, then two decode steps
    pointers = [written for _, written in made[0].calls]
    for present in plan.in_place:
        assert len({p[present] for p in pointers}) == 1, f"{present} moved between calls"
    for present in plan.swapped:  # two buffers in turn: each call writes the one the last did not
        first, second, third = (p[present] for p in pointers)
        assert first != second and third == first, f"{present} is not written into a spare in turn"
