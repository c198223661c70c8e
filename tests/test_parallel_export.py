"""Rank exports (`k3export export --ranks N --rank R`, and the ranks of a `build RECIPE` split over
them): one graph per rank with a DistCollective node (domain trt, every attribute set) per sum the
split needs, recorded in export.json; byte-identical when exported twice; the ranks' experts disjoint
and together the unsplit model's; TensorRT-RTX's census and build of each rank; the ranks' parsed
networks evaluated together under torchrun against the unsplit eager model: greedy tokens and logits;
and `check --build` pairing each of a 6-layer k3-tiny rank's 12 partial sums with its collective by
index. (The ranks' ONNX graphs under torchrun: tests/test_parallel_grid.py, through the runtime and
check --build.)"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from launch import succeeded, torchrun
from onnx import numpy_helper
from reference import rel_error

from k3export.cli import main
from k3export.config import K3Config
from k3export.model import K3ForCausalLM
from k3export.weights.checkpoint import build_model

GRID_WORKER = Path(__file__).with_name("parallel_grid_worker.py")


def six_layer_config() -> K3Config:
    """k3-tiny's first 6 layers (every kind, two AttnRes boundaries): a rank of it sums 12 times, more
    than 10, which is what the partial sums' pairing by index needs, at two thirds of k3-tiny's cost."""
    return K3Config.from_preset("k3-tiny").first_layers(6)


@pytest.fixture(scope="module")
def six_layer_model() -> K3ForCausalLM:
    return build_model(six_layer_config(), torch.float32, {"seed": 0})


@pytest.fixture(scope="module")
def rank_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Ranks 0 and 1 of 2 of six_layer_config (seed 0, float32): the shipped 2 x 2 recipe on it, built in
    one stage with check's outputs (`build RECIPE --routing-outputs`, "build": stage-0/rank-{r}, what
    `export --ranks 2 --rank R --routing-outputs --capacity 256` writes); and layer 0 of k3-tiny's rank
    1 exported twice (attention and a dense MLP, each followed by its sum: enough for byte identity,
    and cheap), the second in a process of its own with another PYTHONHASHSEED."""
    from test_parallel_grid import grid_recipe

    folder = tmp_path_factory.mktemp("rank_exports")
    six_layer_config().to_json(folder / "config.json")
    recipe = grid_recipe(2).replace("count = 2", "count = 1")
    (folder / "grid.toml").write_text(recipe.replace('preset = "k3-tiny"', 'config = "config.json"'))
    exports = {"build": folder / "build"}
    assert main(["build", str(folder / "grid.toml"), "--routing-outputs", "--out", str(exports["build"]),
                 "--quiet"]) == 0
    exports.update({f"rank{r}": exports["build"] / f"stage-0/rank-{r}" for r in range(2)})
    for name in ("first", "again"):
        exports[name] = folder / name
        command = ["export", "--preset", "k3-tiny", "--seed", "0", "--layers", "0:1", "--ranks", "2",
                   "--rank", "1", "--out", str(exports[name]), "--quiet"]
        if name == "again":  # a process of its own, with another PYTHONHASHSEED than this one's
            seed = str(int(os.environ.get("PYTHONHASHSEED", "0") or 0) + 1)
            subprocess.run([sys.executable, "-m", "k3export.cli", *command], check=True, capture_output=True,
                           timeout=600, env={**os.environ, "PYTHONHASHSEED": seed})
        else:
            assert main(command) == 0
    return exports


def collective_nodes(folder: Path) -> list[onnx.NodeProto]:
    graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
    return [n for n in graph.node if n.op_type == "DistCollective"]


def test_one_dist_collective_per_sum_with_every_attribute(rank_exports) -> None:
    for name in ("rank0", "rank1"):
        nodes = collective_nodes(rank_exports[name])
        assert len(nodes) == 12  # attention and FFN of each of the 6 layers
        for node in nodes:
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert node.domain == "trt"
            assert attributes == {"collective_operation": b"all_reduce", "reduce_op": b"sum", "root": -1,
                                  "nb_rank": 2}


def test_manifest_records_the_rank_and_each_collective(rank_exports) -> None:
    manifest = json.loads((rank_exports["rank1"] / "export.json").read_text())
    parallel = manifest["parallel"]
    assert (parallel["rank"], parallel["ranks"]) == (1, 2)
    nodes = collective_nodes(rank_exports["rank1"])
    assert [c["node"] for c in parallel["collectives"]] == [n.name for n in nodes]
    config = six_layer_config()
    D, L = config.hidden_size, config.routed_expert_hidden_size
    # float32 model: attention D values, a dense FFN D, a MoE layer [u | shared] L + D (float32).
    moe_layer = [("attention", 4 * D), ("ffn", 4 * (L + D))]
    assert [(c["layer"], c["after"], c["bytes_per_token"]) for c in parallel["collectives"]] == [
        (0, "attention", 4 * D), (0, "ffn", 4 * D), *((i, *c) for i in range(1, 6) for c in moe_layer)]
    # The rank's caches hold its heads; config.json is the unsplit model's.
    state = next(s for s in manifest["inputs"] if s["name"] == "past.1.kda_state")
    assert state["shape"] == ["batch", 1, 32, 32]
    assert K3Config.from_json(rank_exports["rank1"] / "config.json") == config


def test_two_exports_of_a_rank_are_byte_identical(rank_exports) -> None:
    first, again = rank_exports["first"], rank_exports["again"]
    for file in ("model.onnx", "model.onnx.data", "export.json", "config.json"):
        assert (first / file).read_bytes() == (again / file).read_bytes()


def test_ranks_hold_disjoint_experts_that_together_are_the_model(rank_exports, six_layer_model) -> None:
    """Per MoE layer and projection, rank 0's experts then rank 1's are the unsplit model's, and no
    expert's bytes are held by both ranks. Rank 1's nodes carry expert_offset 4, rank 0's 0."""
    held = {}
    for name in ("rank0", "rank1"):
        model = onnx.load(rank_exports[name] / "model.onnx")
        held[name] = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
                      if ".experts." in t.name}
        offsets = [next((a.i for a in n.attribute if a.name == "expert_offset"), 0) for n in model.graph.node
                   if n.op_type == "RoutedExpertsGroup"]
        assert offsets == [4 * (name == "rank1")] * 5
    unsplit = {name: p.detach().numpy() for name, p in six_layer_model.named_parameters()
               if ".experts." in name}
    assert len(held["rank0"]) == 3 * 5 and held["rank0"].keys() == held["rank1"].keys()
    for name in held["rank0"]:
        together = np.concatenate([held["rank0"][name], held["rank1"][name]])
        np.testing.assert_array_equal(together, unsplit[name.removeprefix("model.")])
        hashes = [{hashlib.sha256(e.tobytes()).hexdigest() for e in held[rank][name]}
                  for rank in ("rank0", "rank1")]
        assert len(hashes[0]) == len(hashes[1]) == 4 and not hashes[0] & hashes[1]


def test_unsplit_export_has_no_collectives(tiny_export) -> None:
    """An unsplit graph has no DistCollective: the segment runtime runs it as one piece, as ONNX
    Runtime runs the file."""
    import onnxruntime as ort

    from k3export.onnx.runner import Signature
    from k3export.runtime.segments import SegmentedGraph

    assert not collective_nodes(tiny_export)
    manifest = json.loads((tiny_export / "export.json").read_text())
    assert "parallel" not in manifest
    graph = SegmentedGraph(tiny_export / "model.onnx")
    assert len(graph.pieces) == 1
    feed = {"input_ids": np.arange(6).reshape(2, 3), "cache_lengths": np.zeros(2, np.int64),
            "input_lengths": np.array([3, 2]), **Signature(manifest).empty_caches(2)}
    session = ort.InferenceSession(tiny_export / "model.onnx", providers=["CPUExecutionProvider"])
    expected = dict(zip(graph.output_names, session.run(graph.output_names, feed), strict=True))
    for name, value in graph(feed).items():
        np.testing.assert_array_equal(value, expected[name])


def test_a_rank_graph_outside_torchrun_is_refused(rank_exports) -> None:
    from k3export.errors import UserError
    from k3export.runtime.segments import SegmentedGraph

    with pytest.raises(UserError, match=r"sums over nb_rank = 2 ranks, but this process group has 1"):
        SegmentedGraph(rank_exports["rank1"] / "model.onnx")


@pytest.mark.parametrize(("options", "message"), [
    (["--ranks", "3"], "ranks = 3 does not divide linear_attn_config.num_heads = 2"),
    (["--ranks", "4"], "ranks = 4 does not divide linear_attn_config.num_heads = 2, num_attention_heads = 2"),
    (["--ranks", "2", "--rank", "2"], "rank = 2: expected 0 <= rank < ranks = 2"),
    (["--ranks", "0"], "argument --ranks: expected an integer >= 1, got 0"),
])
def test_rank_options_that_do_not_fit_are_refused(options, message, tmp_path, capsys) -> None:
    assert main(["export", "--preset", "k3-tiny", "--out", str(tmp_path / "x"), *options]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def run_network_grid(rank_exports, new_tokens: int, out: Path) -> list:
    succeeded(torchrun(2, str(GRID_WORKER), str(rank_exports["rank0"].parent), str(out), str(new_tokens),
                       timeout=400))
    return [np.load(out / f"rank-{r}.npz") for r in range(2)]


def check_against_eager(ranks: list, model: K3ForCausalLM) -> None:
    """The same tokens on both ranks; the unsplit eager model's greedy tokens (where no near-tie) and its
    logits when fed the grid's tokens (float32, relative 1e-5)."""
    sys.path.insert(0, str(GRID_WORKER.parent))
    from parallel_grid_worker import PROMPT_LENGTHS, prompts

    np.testing.assert_array_equal(ranks[0]["tokens"], ranks[1]["tokens"])
    grid_tokens, grid_logits = ranks[0]["tokens"], ranks[0]["logits"]

    # The eager model, fed the same prompt and then the grid's tokens; its own greedy choice each step.
    ids, lengths = torch.from_numpy(prompts(256)), torch.tensor(PROMPT_LENGTHS)
    cache = model.empty_cache(2, 16)
    for step in range(grid_tokens.shape[1]):
        logits, cache = model(ids, cache, lengths, last_logits=True)
        expected = logits.numpy()
        assert rel_error(torch.from_numpy(grid_logits[step]), logits) <= 1e-5
        top2 = np.sort(expected, -1)[:, -2:]
        decided = top2[:, 1] - top2[:, 0] > 1e-4  # rows without a near-tie
        assert decided.any()
        np.testing.assert_array_equal(grid_tokens[decided, step], expected.argmax(-1)[decided])
        ids, lengths = torch.from_numpy(grid_tokens[:, step:step + 1]), torch.ones(2, dtype=torch.int64)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt_rtx is not installed")
@torch.no_grad()
def test_parsed_networks_of_the_ranks_evaluated_together(rank_exports, six_layer_model, tmp_path) -> None:
    """The TensorRT-RTX networks of both ranks, evaluated on CPU in two processes whose DIST_COLLECTIVE
    layers sum over gloo: the unsplit eager model's tokens and logits (prefill and one decode step)."""
    check_against_eager(run_network_grid(rank_exports, 2, tmp_path), six_layer_model)


CENSUS_SCRIPT = """
import json, sys
from pathlib import Path
import k3plugins.trt
from k3export.engine import build, flavours
trt = flavours.load_tensorrt()
k3plugins.trt.register(trt)
export_dir = Path(sys.argv[1])
_builder, network, _parser = build.parse(export_dir / "model.onnx", trt, trt.Logger(trt.Logger.ERROR))
collectives = []
for i in range(network.num_layers):
    layer = network.get_layer(i)
    if layer.type == trt.LayerType.DIST_COLLECTIVE:
        layer.__class__ = trt.IDistCollectiveLayer  # the network hands out plain ILayer objects
        collectives.append(layer.num_ranks)
limits = build.Limits(prefill_batch=2, prefill_seq=16, decode_batch=2)
result = build.build_engine(export_dir, sys.argv[2], trt, target="sm89", limits=limits)
print(json.dumps({"num_ranks": collectives, "engine_bytes": result.bytes}))
"""


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt_rtx is not installed")
@pytest.mark.parametrize("rank", ["rank1"])
def test_rtx_builds_each_rank_with_its_dist_collective_layers(rank_exports, rank, tmp_path) -> None:
    """TensorRT-RTX parses a rank's graph into one DIST_COLLECTIVE layer per DistCollective node, each
    over num_ranks = 2, and builds its engine for SM89 (no GPU: run time stays unproven). Rank 1 (its
    experts offset, its heads the second half); rank 0's graph has the same nodes (and its network is
    evaluated with rank 1's: test_parsed_networks_of_the_ranks_evaluated_together)."""
    proc = subprocess.run([sys.executable, "-c", CENSUS_SCRIPT, str(rank_exports[rank]), str(tmp_path / "e")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    census = json.loads(proc.stdout.strip().splitlines()[-1])
    assert census["num_ranks"] == [2] * len(collective_nodes(rank_exports[rank])) == [2] * 12
    assert census["engine_bytes"] == (tmp_path / "e").stat().st_size > 0


def test_check_build_pairs_each_partial_sum_with_its_collective_past_the_tenth(rank_exports, tmp_path,
                                                                             capsys) -> None:
    """A rank of six_layer_config has 12 all-reduces, so its partial sums partial.0 .. partial.11 sort by
    name in another order than the graph's (partial.10 and partial.11 before partial.2). Rank 1's layer
    5 routed experts' down projection scaled by 1.5 (its collective 11, the last, past the tenth):
    check --build, reading the partial sums from the ranks' outputs, names rank 1 and layer 5's FFN,
    collective 11 the first of rank 1's out of bound and none of rank 0's before it (paired by name,
    partial.11 would be the fourth sum: layer 1's FFN)."""
    from test_shards import corrupt_stage

    bad = shutil.copytree(rank_exports["build"], tmp_path / "bad")
    corrupt_stage(bad, 0, "layers.5.block_sparse_moe.experts.w2", rank=1)
    collectives = json.loads((bad / "stage-0/rank-1/export.json").read_text())["parallel"]["collectives"]
    assert len(collectives) == 12 and (collectives[11]["layer"], collectives[11]["after"]) == (5, "ffn")
    assert main(["check", "--build", str(bad), "--steps", "0", "--prompt-len", "4", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["partials_read_from"] == "graph outputs"
    first = report["first_divergent_rank"]
    assert (first["stage"], first["rank"], first["layer"], first["after"]) == (0, 1, 5, "ffn"), first
    ranks = {entry["rank"]: entry for entry in report["steps"][0]["ranks"]}
    assert ranks[1]["first_failed"]["collective"] == 11
    assert ranks[0]["first_failed"] is None, ranks[0]
