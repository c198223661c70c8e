"""Taps and localisation: `export --taps` adds per-layer outputs (k3export.onnx.taps), the eager model
gives the same tensors through hooks, and `check --taps` names the layer whose weights were changed
in the exported files as the first divergent one."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import pytest
import torch
from reference import assert_eager_ran, without_headroom

from k3export.artifacts import file_record
from k3export.check import driver
from k3export.check.compare import TOLERANCES
from k3export.check.driver import run_check
from k3export.check.taps import compare_taps, first_divergent
from k3export.cli import main
from k3export.errors import UserError
from k3export.onnx.export import ExportGraph, example_inputs, graph_signature
from k3export.onnx.taps import SUBLAYERS, tap_names


def test_taps_are_existing_values_and_the_graph_is_otherwise_unchanged(taps_export, tiny_export):
    """The taps are values the graph computes anyway: the same weights byte for byte, the same
    nodes; only the outputs differ, and only by the taps, which come last."""
    tapped = onnx.load(taps_export / "model.onnx", load_external_data=False)
    plain = onnx.load(tiny_export / "model.onnx", load_external_data=False)
    assert (taps_export / "model.onnx.data").read_bytes() == (tiny_export / "model.onnx.data").read_bytes()
    assert sorted(n.op_type for n in tapped.graph.node) == sorted(n.op_type for n in plain.graph.node)
    plain_outputs = [o.name for o in plain.graph.output]
    assert not any(name.startswith("taps.") for name in plain_outputs)
    assert [o.name for o in tapped.graph.output] == plain_outputs + tap_names(range(9))
    manifest = json.loads((taps_export / "export.json").read_text())
    assert manifest["taps"]["sublayers"] == list(SUBLAYERS)
    assert "taps" not in json.loads((tiny_export / "export.json").read_text())
    spec = next(s for s in manifest["outputs"] if s["name"] == "taps.4.ffn")
    assert spec["shape"] == ["batch", "seq", 64] and spec["dtype"] == "float32"


def test_eager_taps_compose_into_the_attn_res_state(tiny_config, tiny_model):
    """Independent of how they are recorded, the taps must obey the model's residual algebra: a
    layer starting an AttnRes block has partial = mixer + ffn, any other partial = previous partial
    + mixer + ffn; and the logits are the head applied to the bank built from the partials. The hooks
    are gone after the call."""
    layers = range(tiny_config.num_hidden_layers)
    graph = ExportGraph(tiny_model, layers, taps=True)
    inputs = list(example_inputs(tiny_config, layers, torch.float32, batch=2, seq=5, capacity=16))
    inputs[0] = torch.randint(0, tiny_config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    inputs[2] = torch.tensor([5, 3])  # input_lengths
    with torch.no_grad():
        outputs = graph(*inputs)
    names = [s.name for s in graph_signature(tiny_config, layers, torch.float32, taps=True)[1]]
    assert len(outputs) == len(names)
    out = dict(zip(names, outputs, strict=True))
    block = tiny_config.attn_res_block_size
    embed = tiny_model.model.embed_tokens(inputs[0])
    bank = []
    for i in layers:
        step = out[f"taps.{i}.mixer"] + out[f"taps.{i}.ffn"]
        if i % block == 0:
            bank.append(embed if i == 0 else out[f"taps.{i - 1}.partial"])
            expected = step
        else:
            expected = out[f"taps.{i - 1}.partial"] + step
        torch.testing.assert_close(out[f"taps.{i}.partial"], expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        logits = tiny_model.head(bank, out[f"taps.{layers[-1]}.partial"])
    torch.testing.assert_close(out["logits"], logits, rtol=1e-5, atol=1e-5)
    assert all(not m._forward_hooks for m in tiny_model.modules())


def test_check_taps_refuses_an_export_without_taps(tiny_export):
    with pytest.raises(UserError, match="export --taps"):
        run_check(tiny_export, steps=1, taps=True, log=lambda _: None)


def test_check_taps_prints_the_table_and_passes_on_the_export(taps_export, capsys):
    assert main(["check", "--onnx", str(taps_export), "--taps", "--steps", "1", "--prompt-len", "12"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(9))
    assert "first divergent: none" in out


def corrupt(export: Path, folder: Path, suffix: str, factor: float = 1.5) -> Path:
    """A copy of `export` with the float32 or float16 initializer named ...`suffix` scaled by
    `factor` where it is stored (the external data, or inline in model.onnx for small tensors), the
    changed file's sha256 re-recorded in export.json so that the folder still verifies."""
    shutil.copytree(export, folder)
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    target = next(t for t in model.graph.initializer if t.name.endswith(suffix))
    dtype = onnx.helper.tensor_dtype_to_np_dtype(target.data_type)
    where = {e.key: e.value for e in target.external_data}
    if "offset" in where:
        changed = "model.onnx.data"
        data = bytearray((folder / changed).read_bytes())
        offset, length = int(where["offset"]), int(where["length"])
        values = np.frombuffer(data, dtype, count=length // dtype.itemsize, offset=offset).astype(np.float32)
        data[offset:offset + length] = (values * factor).astype(dtype).tobytes()
        (folder / changed).write_bytes(bytes(data))
    else:
        changed = "model.onnx"
        values = onnx.numpy_helper.to_array(target).astype(np.float32) * factor
        target.CopyFrom(onnx.numpy_helper.from_array(values.astype(dtype), target.name))
        onnx.save(model, folder / changed)
    manifest = json.loads((folder / "export.json").read_text())
    manifest["files"][changed] = file_record(folder / changed)
    (folder / "export.json").write_text(json.dumps(manifest))
    return folder


# (weight, layer, sublayer): a KDA layer's mixer, an MLA layer's mixer, a MoE layer's FFN, the last
# layer (MLA + MoE) through its FFN.
CORRUPTIONS = [
    ("layers.2.self_attn.q_conv1d.weight", 2, "mixer"),
    ("layers.3.self_attn.q_a_layernorm.weight", 3, "mixer"),
    ("layers.5.block_sparse_moe.routed_expert_up_proj.weight", 5, "ffn"),
    ("layers.8.block_sparse_moe.routed_expert_down_proj.weight", 8, "ffn"),
]


NETWORK = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                             reason="check --network needs TensorRT-RTX (the engine extra)")


@pytest.mark.parametrize("artifact", ["--onnx", pytest.param("--network", marks=NETWORK)])
@pytest.mark.parametrize(("weight", "layer", "sublayer"), CORRUPTIONS)
def test_check_taps_names_the_corrupted_layer(taps_export, tmp_path, capsys, artifact, weight, layer,
                                              sublayer):
    broken = corrupt(taps_export, tmp_path / "broken", weight)
    args = ["--taps", "--steps", "2", "--prompt-len", "12", "--json"]
    assert main(["check", artifact, str(broken), *args]) == 1
    report = json.loads(capsys.readouterr().out)
    first = report["taps"]["first_divergent"]
    assert (first["layer"], first["sublayer"]) == (layer, sublayer)
    # Every tap before it is within the tolerance at every step, and the named one leaves it.
    for step in report["taps"]["steps"]:
        before = [t for t in step["taps"] if (t["layer"], SUBLAYERS.index(t["sublayer"]))
                  < (layer, SUBLAYERS.index(sublayer))]
        assert before and all(t["rel"] <= 1e-4 for t in before)
    assert first["rel"] > 1e-4


def test_the_documented_failing_check(taps_export, tmp_path, capsys):
    """docs/check.md's run (layer 5's routed up-projection scaled by 1.5): its first divergent tap and
    verdict lines (since 2026-12 every side takes the artifact's greedy tokens: 19 mismatches, 17 before)."""
    broken = corrupt(taps_export, tmp_path / "broken", CORRUPTIONS[2][0])
    assert main(["check", "--onnx", str(broken), "--taps", "--steps", "4", "--prompt-len", "24"]) == 1
    out = capsys.readouterr().out.splitlines()
    documented = (Path(__file__).parents[1] / "docs" / "check.md").read_text().splitlines()
    for line in ["first divergent: layer 5 ffn (taps.5.ffn) at prefill: rel 4.35e-01 > bound 1.0e-04, "
                 "cos 0.985791",
                 "FAILED: logits, present.6.k_conv, present.6.kda_state, present.6.q_conv, present.6.v_conv, "
                 "present.7.mla_latent, present.8.mla_latent; 19 greedy tokens differ past the tie margin "
                 "(float32, relative error <= 0.0001; greedy streams identical: False; token mismatches 19, "
                 "ties 0 of 44 positions)"]:
        assert line in map(without_headroom, out) and f"    {line}" in map(without_headroom, documented)



def test_first_divergent_takes_the_earliest_tap_of_any_step():
    def tap(layer, sublayer, passed):
        return {"name": f"taps.{layer}.{sublayer}", "layer": layer, "sublayer": sublayer, "rel": 0.0,
                "cosine": 1.0, "bound": 1e-4, "passed": passed}

    steps = [{"step": "prefill", "taps": [tap(0, "mixer", True), tap(0, "ffn", True), tap(1, "ffn", False)]},
             {"step": "decode 1", "taps": [tap(0, "mixer", True), tap(0, "ffn", False)]}]
    first = first_divergent(steps)
    assert (first["layer"], first["sublayer"], first["step"]) == (0, "ffn", "decode 1")
    assert first_divergent(steps[:0]) is None


@pytest.fixture(scope="module")
def float16_taps_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("taps16") / "tiny"
    assert main(["export", "--preset", "k3-tiny", "--seed", "0", "--dtype", "float16", "--taps",
                 "--out", str(folder)]) == 0
    return folder


def test_half_precision_envelope_passes_the_export_and_names_a_corrupted_layer(float16_taps_export, tmp_path,
                                                                               monkeypatch):
    """float16: the clean export has no divergent tap (each within half_precision_tolerance of the
    eager float16-vs-float32 spread so far), and a MoE layer's corrupted weight is named. The eager
    side streamed one layer at a time gives the in-memory side's numbers, taps and held expert
    choices included, bit for bit (with every recorded array on disk, as large ones are), and names
    the corrupted layer too."""
    clean = run_check(float16_taps_export, steps=2, prompt_len=12, taps=True, log=lambda _: None,
                      eager="in-memory")
    assert clean["taps"]["first_divergent"] is None
    bounds = [t["bound"] for t in clean["taps"]["steps"][0]["taps"]]
    assert all(0.02 <= b <= 0.1 for b in bounds)  # float16's fixed bound .. HALF_REL_CAP
    monkeypatch.setattr(driver, "SPILL_BYTES", 0)
    streamed = run_check(float16_taps_export, steps=2, prompt_len=12, taps=True, log=lambda _: None,
                         eager="streamed")
    assert streamed["recorded_bytes_on_disk"] > 0 == clean["recorded_bytes_on_disk"]
    assert streamed["eager"]["mode"] == "streamed" and clean["eager"]["mode"] == "in-memory"
    layers = json.loads((float16_taps_export / "export.json").read_text())["layers"]
    assert_eager_ran(streamed, clean, [layers])
    assert streamed["held_routing"] and streamed["routing_flips"] == clean["routing_flips"]
    assert streamed["steps"] == clean["steps"] and streamed["taps"] == clean["taps"]
    broken = corrupt(float16_taps_export, tmp_path / "broken", CORRUPTIONS[2][0])
    report = run_check(broken, steps=2, prompt_len=12, taps=True, log=lambda _: None, eager="streamed")
    first = report["taps"]["first_divergent"]
    assert not report["passed"] and (first["layer"], first["sublayer"]) == CORRUPTIONS[2][1:]


def test_half_precision_envelope_passes_the_clean_decode_steps(float16_taps_export):
    """The clean float16 export once named taps.8.ffn at decode 1 (rel 3.3e-2 > 2.3e-2, twice that
    step's eager spread): a decode step compares one token per row, and one token's rounding is
    heavy-tailed; the envelope now adds the worst eager spread of a sample of that size so far (the
    prefill's token pairs), and is never tighter than twice the step's own spread."""
    report = run_check(float16_taps_export, steps=3, prompt_len=24, taps=True, log=lambda _: None)
    assert report["passed"] and report["taps"]["first_divergent"] is None
    for step in report["taps"]["steps"]:
        for tap in step["taps"]:
            assert "samples" not in tap  # settled
            assert tap["sample_spread"] >= tap["spread"] * (1 - 1e-9) or step["step"] == "prefill"
            assert tap["bound"] >= min(max(0.02, 2 * tap["spread"]), 0.1) * (1 - 1e-9)
            assert tap["rel"] <= tap["bound"] <= 0.1


def test_half_precision_envelope_holds_a_decode_step_to_the_prefill_samples_of_its_size():
    """Synthetic taps, hidden 16: a prefill of 8 tokens whose eager spread is 0.01 except one token
    pair at 0.05, then a 2-token decode step whose spread is 0.01. A decode error of 0.04 is 4 times
    the step's spread but within it plus the worst 2-token prefill sample (0.06); 0.07 is not."""
    tolerance, pair = TOLERANCES["float16"], 32  # entries of two tokens
    gen = np.random.default_rng(0)

    def perturbed(x, rels):  # x with a relative error of rels[i] on token pair i
        noise, out = gen.standard_normal(x.shape), x.copy()
        for i, rel in enumerate(rels):
            at = slice(pair * i, pair * (i + 1))
            out[at] += noise[at] * rel * np.linalg.norm(x[at]) / np.linalg.norm(noise[at])
        return out

    def step(label, ref, spreads, error):
        name = "taps.0.mixer"
        actual, float32 = perturbed(ref, [error] * len(spreads)), perturbed(ref, spreads)
        return {"step": label, "taps": compare_taps({name: ref}, {name: actual}, {name: float32}, tolerance)}

    prefill, decode = gen.standard_normal(4 * pair), gen.standard_normal(pair)
    for error, named in ((0.04, False), (0.07, True)):
        steps = [step("prefill", prefill, [0.01, 0.05, 0.01, 0.01], 0.005),
                 step("decode 1", decode, [0.01], error)]
        assert steps[1]["taps"][0]["bound"] == pytest.approx(0.02)  # the step alone: the dtype's bound
        first = first_divergent(steps)
        assert steps[1]["taps"][0]["bound"] == pytest.approx(0.01 + 0.05, rel=0.02)
        assert steps[0]["taps"][0]["passed"] and "samples" not in steps[0]["taps"][0]
        assert (first is not None) == named and (not named or first["step"] == "decode 1")
