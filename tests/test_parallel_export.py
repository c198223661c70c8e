"""Rank exports (`k3export export --ranks N --rank R`): one graph per rank with a DistCollective node
(domain trt, every attribute set) per sum the split needs, recorded in export.json; byte-identical
when exported twice; the ranks' experts disjoint and together the unsplit model's. Layers 0:3 of
k3-tiny (a dense layer, then two MoE layers) keep the three exports cheap."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from k3export.cli import main
from k3export.config import K3Config

LAYERS = "0:3"


@pytest.fixture(scope="module")
def rank_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Rank 0 of 2 (twice, into two folders) and rank 1 of 2."""
    folder = tmp_path_factory.mktemp("rank_exports")
    exports = {}
    for name, rank in (("rank0", 0), ("rank0_again", 0), ("rank1", 1)):
        exports[name] = folder / name
        assert main(["export", "--preset", "k3-tiny", "--seed", "0", "--layers", LAYERS, "--ranks", "2",
                     "--rank", str(rank), "--out", str(exports[name]), "--quiet"]) == 0
    return exports


def collective_nodes(folder: Path) -> list[onnx.NodeProto]:
    graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
    return [n for n in graph.node if n.op_type == "DistCollective"]


def test_one_dist_collective_per_sum_with_every_attribute(rank_exports) -> None:
    for name in ("rank0", "rank1"):
        nodes = collective_nodes(rank_exports[name])
        assert len(nodes) == 6  # attention and FFN of each of the 3 layers
        for node in nodes:
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert node.domain == "trt"
            assert attributes == {"collective_operation": b"all_reduce", "reduce_op": b"sum", "root": -1,
                                  "nb_rank": 2}


def test_manifest_records_the_rank_and_each_collective(rank_exports, tiny_config) -> None:
    manifest = json.loads((rank_exports["rank1"] / "export.json").read_text())
    parallel = manifest["parallel"]
    assert (parallel["rank"], parallel["ranks"]) == (1, 2)
    nodes = collective_nodes(rank_exports["rank1"])
    assert [c["node"] for c in parallel["collectives"]] == [n.name for n in nodes]
    D, L = tiny_config.hidden_size, tiny_config.routed_expert_hidden_size
    # float32 model: attention D values, a dense FFN D, a MoE layer [u | shared] L + D (float32).
    assert [(c["layer"], c["after"], c["bytes_per_token"]) for c in parallel["collectives"]] == [
        (0, "attention", 4 * D), (0, "ffn", 4 * D), (1, "attention", 4 * D), (1, "ffn", 4 * (L + D)),
        (2, "attention", 4 * D), (2, "ffn", 4 * (L + D))]
    # The rank's caches hold its heads; config.json is the unsplit model's.
    state = next(s for s in manifest["inputs"] if s["name"] == "past.1.kda_state")
    assert state["shape"] == ["batch", 1, 32, 32]
    assert K3Config.from_json(rank_exports["rank1"] / "config.json") == tiny_config


def test_two_exports_of_a_rank_are_byte_identical(rank_exports) -> None:
    first, again = rank_exports["rank0"], rank_exports["rank0_again"]
    for file in ("model.onnx", "model.onnx.data", "export.json", "config.json"):
        assert (first / file).read_bytes() == (again / file).read_bytes()


def test_ranks_hold_disjoint_experts_that_together_are_the_model(rank_exports, tiny_model) -> None:
    """Per MoE layer and projection, rank 0's experts then rank 1's are the unsplit model's, and no
    expert's bytes are held by both ranks. Rank 1's nodes carry expert_offset 4, rank 0's none (0)."""
    held = {}
    for name in ("rank0", "rank1"):
        model = onnx.load(rank_exports[name] / "model.onnx")
        held[name] = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
                      if ".experts." in t.name}
        offsets = [next((a.i for a in n.attribute if a.name == "expert_offset"), 0) for n in model.graph.node
                   if n.op_type == "RoutedExperts"]
        assert offsets == [4 * (name == "rank1")] * 2
    unsplit = {name: p.detach().numpy() for name, p in tiny_model.named_parameters() if ".experts." in name}
    assert len(held["rank0"]) == 6 and held["rank0"].keys() == held["rank1"].keys()
    for name in held["rank0"]:
        together = np.concatenate([held["rank0"][name], held["rank1"][name]])
        np.testing.assert_array_equal(together, unsplit[name.removeprefix("model.")])
        hashes = [{hashlib.sha256(e.tobytes()).hexdigest() for e in held[rank][name]}
                  for rank in ("rank0", "rank1")]
        assert len(hashes[0]) == len(hashes[1]) == 4 and not hashes[0] & hashes[1]


def test_unsplit_export_has_no_collectives(tiny_export) -> None:
    assert not collective_nodes(tiny_export)
    assert "parallel" not in json.loads((tiny_export / "export.json").read_text())


@pytest.mark.parametrize(("options", "message"), [
    (["--ranks", "3"], "ranks = 3 does not divide linear_attn_config.num_heads = 2"),
    (["--ranks", "4"], "ranks = 4 does not divide linear_attn_config.num_heads = 2, num_attention_heads = 2"),
    (["--ranks", "2", "--rank", "2"], "rank = 2: expected 0 <= rank < ranks = 2"),
    (["--ranks", "0"], "ranks = 0: expected a positive integer"),
])
def test_rank_options_that_do_not_fit_are_refused(options, message, tmp_path, capsys) -> None:
    assert main(["export", "--preset", "k3-tiny", "--out", str(tmp_path / "x"), *options]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
