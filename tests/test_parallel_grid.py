"""A recipe with `[parallel] ranks = 2` and 2 stages: `build` writes stage-{i}/rank-{r}/, and
`torchrun --nproc-per-node 4 -m k3export.runtime DIR` (each rank's graph in ONNX Runtime pieces,
gloo sums within a stage, AttnRes boundaries from rank r to rank r of the next stage, micro-batches
in flight) generates the unsplit eager model's greedy tokens; a rank that dies stops the others;
`check --build DIR` (one worker process a rank) passes against the unsplit eager model and names the
stage and rank of a wrong expert weight."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from launch import succeeded, torchrun, torchrun_command
from reference import assert_eager_ran
from test_parallel import four_head_config
from test_shards import corrupt_stage, fault_a_worker

from k3export.check.runners import grid
from k3export.check.runners.chain import chain_manifest
from k3export.check.runners.grid import GridRunner, grid_stages
from k3export.cli import main
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.model import K3ForCausalLM
from k3export.onnx.export import PARTIAL_PREFIX, ROUTING_PREFIX, add_checking_outputs
from k3export.onnx.runner import Signature
from k3export.runtime import random_prompts, stage_ranks
from k3export.runtime.faults import process_name
from k3export.shards.recipe import load_recipe
from k3export.shards.stages import build_recipe

GRID_RECIPE = Path(__file__).resolve().parents[1] / "engines/k3-tiny-2x2.toml"


def grid_recipe(ranks: int) -> str:
    """The shipped k3-tiny 2 x 2 recipe, each stage split over `ranks` instead."""
    return GRID_RECIPE.read_text().replace("\nranks = 2", f"\nranks = {ranks}")


@pytest.fixture(scope="module")
def grid_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("grid")
    shutil.copy(GRID_RECIPE, folder / "grid.toml")
    build_recipe(load_recipe(folder / "grid.toml"), folder / "build", log=lambda _: None)
    return folder / "build"


@torch.no_grad()
def eager_greedy(model: K3ForCausalLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The unsplit eager model's greedy tokens for the prompts as one batch (right-padded)."""
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(prompt)
    cache, tokens = model.empty_cache(len(prompts), 64), []
    for _ in range(new_tokens):
        logits, cache = model(ids, cache, lengths)
        tokens.append(logits[torch.arange(len(prompts)), lengths - 1].argmax(-1))
        ids, lengths = tokens[-1][:, None], torch.ones(len(prompts), dtype=torch.int64)
    return torch.stack(tokens, 1).tolist()


def test_build_writes_each_rank_of_each_stage(grid_build: Path) -> None:
    manifest = json.loads((grid_build / "manifest.json").read_text())
    for i, stage in enumerate(manifest["stages"]):
        # Places, not GPU numbers: the runtime puts each process on its host's LOCAL_RANK GPU.
        assert [(r["stage"], r["rank"], r["folder"]) for r in stage["ranks"]] == [
            (i, r, f"stage-{i}/rank-{r}") for r in range(2)]
        assert not any("gpu" in r for r in stage["ranks"])
        for rank in stage["ranks"]:
            export = json.loads((grid_build / rank["folder"] / "export.json").read_text())
            assert (export["parallel"]["rank"], export["parallel"]["ranks"]) == (rank["rank"], 2)
            assert f"{rank['folder']}/model.onnx.data" in manifest["files"]


def test_grid_generates_the_unsplit_models_tokens(grid_build: Path, tiny_model) -> None:
    """The 4 processes walk one schedule with 2 micro-batches in flight: the unsplit eager model's
    greedy tokens (those of one micro-batch too: test_shards holds M = 1 and M = 2 to the same tokens
    on the pipeline whose code the grid runs); each process's timing is reported, its sums apart."""
    proc = torchrun(4, "-m", "k3export.runtime", str(grid_build), "--batch", "2", "--prompt-len", "8",
                    "--max-new-tokens", "6", "--seed", "3", "--json", "--threads", "1",
                    "--micro-batches", "2")
    succeeded(proc)
    grid = json.loads(proc.stdout.strip().splitlines()[-1])
    assert grid["tokens"] == eager_greedy(tiny_model, random_prompts(2, 8, 256, 3), 6)
    assert grid["micro_batches"] == 2 and len(grid["stage_seconds"]) == len(grid["stages"]) == 4
    for times in grid["stages"]:
        assert 0 < times["sums_seconds"] < times["busy_seconds"] <= times["window_seconds"]


def test_wrong_process_count_and_single_process_run_are_refused(grid_build: Path, capsys) -> None:
    proc = torchrun(2, "-m", "k3export.runtime", str(grid_build))
    assert proc.returncode != 0
    refusal = "2 stages x 2 ranks, started with 2 processes; expected torchrun --nproc-per-node 4"
    assert refusal in proc.stderr
    # torchrun's report of the failed process, which follows and would bury that line, names it too.
    report = r"exitcode\s*: 2 .*\n.*\n\s*traceback : k3export.runtime: error: .*"
    assert re.search(report + re.escape(refusal), proc.stderr), proc.stderr[-3000:]
    assert main(["run", str(grid_build)]) == 2
    assert "torchrun --nproc-per-node 4 -m k3export.runtime DIR" in capsys.readouterr().err


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_failed_rank_stops_the_others(grid_build: Path, fault: str) -> None:
    """Stage 1's rank 1 (process 3) killed (SIGKILL) or stopped (SIGSTOP, a hang) while the grid
    decodes: each other process says what it met (a link or a sum with a process that is gone, a
    --timeout of 3 s, or torchrun's SIGTERM, whichever came first) and then names process 3 as the
    process the run stopped for, and exits non-zero within the stated time (tests/test_shards.py's
    fault_a_worker). A hung one is first named by a missed deadline: its partner in the sums or stage
    0's rank 1, which waits for its tokens."""
    command = torchrun_command(4, "-m", "k3export.runtime", str(grid_build), "--batch", "2", "--prompt-len",
                               "8", "--max-new-tokens", "50", "--threads", "1", "--timeout", "3")
    named = (r"stage 1 rank 1 \(process 3\) (did not join a sum|took nothing or sent nothing) for 3 s "
             r"\(--timeout\): it died or hangs")
    err = fault_a_worker(command, "k3export.runtime: 2 stages x 2 ranks", 3, fault,
                         [process_name(p, 2) for p in range(4)], named if fault == "hung" else "")
    if fault == "killed":
        assert re.search(r"rank\s*: 3 \(local_rank: 3\)\s*exitcode\s*: -9", err), err[-3000:]


@pytest.mark.parametrize("artifact", ["--onnx", "--network"])
def test_one_rank_alone_is_refused_by_check(grid_build: Path, artifact: str, capsys) -> None:
    """A rank's graph computes only its share of the sums: checking it alone names the grid check."""
    assert main(["check", artifact, str(grid_build / "stage-0" / "rank-1")]) == 2
    assert "rank 1 of 2 of a split model" in capsys.readouterr().err


def four_head_short_config() -> K3Config:
    """tests/test_parallel.py's 4-head k3-tiny (one KDA and one MLA head a rank of 4, 2 of its 8
    experts a rank) cut to 2 layers: a KDA MoE layer and an MLA MoE layer, with an AttnRes block
    boundary between them (4 rank exports of 9 layers would cost CI a minute; a dense layer's FFN over
    4 ranks is test_parallel.py's, and over 2 the 2 x 2 grid's)."""
    data = four_head_config().to_dict()
    data["num_hidden_layers"] = 2
    data["first_k_dense_replace"] = 0
    data["linear_attn_config"].update(kda_layers=[1], full_attn_layers=[2])
    data["attn_res_block_size"] = 1
    return K3Config.from_dict(data)


@pytest.mark.usefixtures("bounded_check")
def test_four_ranks_of_a_four_head_model(tmp_path: Path, capsys) -> None:
    """One stage over 4 ranks (one KDA and one MLA head, 2 experts a rank): check --build (4 workers)
    passes against the unsplit eager model. (The runtime's sums over a stage's ranks, the same code
    for 2 or 4, give the unsplit model's tokens on the 2 x 2 grid: a torchrun of these 4 ranks cost
    about 7 s more, measured 2026-12-04.)"""
    config = four_head_short_config()
    config.to_json(tmp_path / "config.json")
    recipe = grid_recipe(4).replace('preset = "k3-tiny"', 'config = "config.json"')
    (tmp_path / "four.toml").write_text(recipe.replace("count = 2", "count = 1"))
    build_recipe(load_recipe(tmp_path / "four.toml"), tmp_path / "build", log=lambda _: None)
    assert main(["check", "--build", str(tmp_path / "build"), "--steps", "1", "--prompt-len", "8"]) == 0
    assert "first divergent stage and rank: none" in capsys.readouterr().out


@pytest.mark.parametrize(("ranks", "expected"), [
    (3, r"key 'parallel.ranks' = 3: expected a rank count that divides the model \(ranks = 3 does not "
        r"divide"),
    (0, r"key 'parallel.ranks' = 0: expected an integer >= 1"),
    (-2, r"key 'parallel.ranks' = -2: expected an integer >= 1")], ids=["3", "0", "-2"])
def test_recipe_ranks_that_do_not_divide_or_are_not_positive_are_refused(tmp_path: Path, ranks: int,
                                                                       expected: str, capsys) -> None:
    (tmp_path / "bad.toml").write_text(grid_recipe(ranks))
    with pytest.raises(UserError, match=r"bad.toml: " + expected):
        load_recipe(tmp_path / "bad.toml")
    assert main(["build", str(tmp_path / "bad.toml"), "--out", str(tmp_path / "out")]) == 2
    assert re.search(expected, capsys.readouterr().err)


def test_rank_folders_are_checked_by_place(grid_build: Path, tmp_path: Path, capsys) -> None:
    """`verify DIR` and the runtime (stage_ranks) refuse, naming the stage and rank, a rank folder that
    is missing, one that is another rank's, and one whose files are not the build's (another build's
    weights: here the same bytes reversed)."""
    build = shutil.copytree(grid_build, tmp_path / "build")
    assert main(["verify", str(build)]) == 0
    assert "every sha256 matches" in capsys.readouterr().out

    def refused(expected: str) -> None:
        assert main(["verify", str(build)]) == 2
        assert expected in capsys.readouterr().err
        with pytest.raises(UserError) as error:
            stage_ranks(build)
        assert expected in str(error.value)

    shutil.rmtree(build / "stage-1" / "rank-1")
    refused(f"stage 1 rank 1: its folder {build / 'stage-1' / 'rank-1'} is missing")
    shutil.copytree(grid_build / "stage-0" / "rank-1", build / "stage-1" / "rank-1")
    refused("stage 1 rank 1: " + str(build / "stage-1" / "rank-1" / "export.json") + " is rank 1 of 2 over "
            "layers [0, 5], expected rank 1 of 2 over layers [5, 9]: ranks of different builds are mixed")
    shutil.rmtree(build / "stage-1" / "rank-1")
    shutil.copytree(grid_build / "stage-1" / "rank-1", build / "stage-1" / "rank-1")
    shutil.rmtree(build / "stage-0" / "rank-0")
    shutil.copytree(grid_build / "stage-0" / "rank-1", build / "stage-0" / "rank-0")
    refused("stage 0 rank 0: " + str(build / "stage-0" / "rank-0" / "export.json") + " is rank 1 of 2")
    shutil.rmtree(build / "stage-0" / "rank-0")
    shutil.copytree(grid_build / "stage-0" / "rank-0", build / "stage-0" / "rank-0")
    data = build / "stage-1" / "rank-0" / "model.onnx.data"
    data.write_bytes(data.read_bytes()[::-1])
    refused(f"stage 1 rank 0: {data}: sha256 differs from {build / 'manifest.json'}")


def test_a_grid_build_refuses_another_rank_count_and_a_stage_outside_it(grid_build: Path, tmp_path: Path,
                                                                       capsys) -> None:
    """Resuming into a folder built with other ranks is refused (the two builds' ranks would mix), and
    so is a --stage that is not one of the grid's stages."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(grid_build / "manifest.json", out)  # what the refusal reads: the build's recipe
    (tmp_path / "one.toml").write_text(grid_recipe(1))
    assert main(["build", str(tmp_path / "one.toml"), "--out", str(out)]) == 2
    assert (f"--out {out}: built with [parallel] ranks = 2 ({out / 'manifest.json'}), but "
            f"{tmp_path / 'one.toml'} now says ranks = 1") in capsys.readouterr().err
    assert main(["build", str(grid_build.parent / "grid.toml"), "--stage", "2", "--out", str(out)]) == 2
    assert ("--stage 2: expected a stage of " + str(grid_build.parent / "grid.toml") + ", 0..1 (each split "
            "over 2 ranks; --stage I builds all of stage I's ranks, --stage I --rank R one)"
            ) in capsys.readouterr().err


@pytest.fixture
def bounded_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each answer of a check's rank workers within 120 s, or the test fails: no hang in CI."""
    monkeypatch.setattr(grid, "WORKER_TIMEOUT_S", 120.0)


@pytest.mark.usefixtures("bounded_check")
def test_check_build_of_the_grid_passes_against_the_unsplit_model(grid_build: Path, capsys) -> None:
    """One command: the 4 ranks' workers started by check itself; the unsplit eager model's outputs,
    each KDA cache as the unsplit model holds it (both ranks' heads), and every rank's partial sums
    within the bound. The unsplit eager side streamed one layer at a time gives the same numbers, bit
    for bit; stage 1 alone (its 2 workers, its boundary from the eager layers before it) passes too."""
    check = ["check", "--build", str(grid_build), "--steps", "1", "--prompt-len", "8", "--json"]
    assert main([*check, "--eager", "in-memory"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["ranks"] == 2 and report["first_divergent_rank"] is None
    compared = {c["name"] for c in report["steps"][0]["outputs"]}
    assert {"logits", "present.0.kda_state", "present.0.q_conv", "present.7.mla_latent"} <= compared
    for step in report["steps"]:
        assert [(e["stage"], e["rank"]) for e in step["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(e["passed"] and not e["differs_from_rank_0"] for e in step["ranks"])
    assert main([*check, "--eager", "streamed"]) == 0
    streamed = json.loads(capsys.readouterr().out)
    assert streamed["eager"]["mode"] == "streamed" and streamed["steps"] == report["steps"]
    assert_eager_ran(streamed, report, report["stages"])
    assert main([*check, "--eager", "streamed", "--stage", "1"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["passed"] and alone["stage_numbers"] == [1]
    assert [(e["stage"], e["rank"]) for e in alone["steps"][0]["ranks"]] == [(1, 0), (1, 1)]
    # Speculative decoding over the grid: verify calls and rolled-back calls of every rank against the
    # unsplit eager model, the speculative tokens the grid's plain greedy ones.
    assert main(["check", "--build", str(grid_build), "--steps", "8", "--prompt-len", "8", "--json",
                 "--speculate", "4"]) == 0
    spec = json.loads(capsys.readouterr().out)["speculation"]
    assert spec["streams_identical"] and 0 < spec["accepted"] < spec["drafted"]


@pytest.mark.usefixtures("bounded_check")
def test_check_build_names_the_rank_of_a_wrong_expert(grid_build: Path, tmp_path: Path, capsys) -> None:
    """Rank 1 of stage 1 with layer 6's routed experts' down projection scaled by 1.5 (the build's files
    re-recorded: wrong, not corrupt): the all-reduce spreads the error to both ranks' outputs, yet the
    check names rank 1 and layer 6's FFN, from the ranks' partial sums. (Rank 0 named in the float16
    grid's test below: blaming the last rank, or the first, cannot pass both.)"""
    rank = 1
    bad = tmp_path / "bad"
    shutil.copytree(grid_build, bad)
    corrupt_stage(bad, 1, "layers.6.block_sparse_moe.experts.w2", rank=rank)
    assert main(["check", "--build", str(bad), "--steps", "1", "--prompt-len", "8"]) == 1
    printed = capsys.readouterr().out
    assert "first divergent stage: stage 1 (layers 5..8) at prefill" in printed
    named = f"first divergent stage and rank: stage 1 rank {rank} (layer 6 ffn) at prefill: partial sum rel"
    assert named in printed
    assert main(["check", "--build", str(bad), "--steps", "8", "--prompt-len", "8", "--speculate", "4"]) == 1
    assert named in capsys.readouterr().out


@pytest.mark.usefixtures("bounded_check")
def test_a_dead_rank_stops_the_check_naming_it(grid_build: Path) -> None:
    """A worker killed between calls: the next call raises a UserError naming its stage and rank
    (its partner, stuck in a sum, is terminated) instead of hanging."""
    folders = stage_ranks(grid_build)
    manifest, _, stage_manifests = chain_manifest(grid_build, grid_stages(folders))
    runner = GridRunner(folders, stage_manifests, Signature(manifest))
    feed = {"input_ids": np.ones((1, 4), np.int64), "cache_lengths": np.zeros(1, np.int64),
            "input_lengths": np.array([4])}
    with runner:
        runner.reset(1)
        runner.workers[1][0].process.kill()
        with pytest.raises(UserError, match="check --build: stage 1 rank 0: its process died"):
            runner.infer(feed, check_inputs=False)
        workers = [w.process for ranks in runner.workers for w in ranks]
        stopped = time.monotonic()
    assert not any(p.is_alive() for p in workers) and time.monotonic() - stopped < 10


# -- check's outputs (build --routing-outputs): a float16 grid held to its ranks' own routing --------

PARTIAL_WORKER = Path(__file__).with_name("partial_outputs_worker.py")


def short_config() -> K3Config:
    """k3-tiny cut to 3 layers that keep every kind (a dense KDA layer, a KDA MoE layer, an MLA MoE
    layer, an AttnRes block boundary between them): the float16 builds and exports below cost a
    third of k3-tiny's."""
    data = K3Config.from_preset("k3-tiny").to_dict()
    data["num_hidden_layers"] = 3
    data["linear_attn_config"].update(kda_layers=[1, 2], full_attn_layers=[3])
    data["attn_res_block_size"] = 2
    return K3Config.from_dict(data)


def short_recipe(folder: Path, dtype: str, stages: int, ranks: int) -> Path:
    """The shipped 2 x 2 recipe on short_config in `dtype`, `stages` stages of `ranks` ranks."""
    short_config().to_json(folder / "config.json")
    text = GRID_RECIPE.read_text().replace('preset = "k3-tiny"', 'config = "config.json"')
    text = text.replace("count = 2", f"count = {stages}").replace("\nranks = 2", f"\nranks = {ranks}")
    (folder / "short.toml").write_text(text.replace('dtype = "float32"', f'dtype = "{dtype}"'))
    return folder / "short.toml"


@pytest.fixture(scope="module")
def float16_grid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """short_config in float16, one stage over 2 ranks, built with check's outputs."""
    folder = tmp_path_factory.mktemp("grid16")
    recipe = short_recipe(folder, "float16", 1, 2)
    assert main(["build", str(recipe), "--out", str(folder / "build"), "--routing-outputs", "--quiet"]) == 0
    return folder / "build"


def scale_weight(build: Path, stage: int, rank: int | None, suffix: str, factor: float) -> None:
    """Scales the initializer named ...`suffix` (any float dtype numpy has) of a stage or rank in its
    external data, the new hashes recorded: a wrong weight, not a damaged file."""
    from test_shards import rerecord, stage_folder

    folder = build / stage_folder(stage, rank)
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    target = next(t for t in model.graph.initializer if t.name.endswith(suffix))
    dtype = onnx.helper.tensor_dtype_to_np_dtype(target.data_type)
    where = {e.key: e.value for e in target.external_data}
    offset, length = int(where["offset"]), int(where["length"])
    data = bytearray((folder / "model.onnx.data").read_bytes())
    values = np.frombuffer(data, dtype, count=length // dtype.itemsize, offset=offset)
    data[offset:offset + length] = (values * factor).astype(dtype).tobytes()
    (folder / "model.onnx.data").write_bytes(bytes(data))
    rerecord(build, stage, ["model.onnx.data"], rank)


@pytest.mark.usefixtures("bounded_check")
def test_float16_grid_with_checking_outputs_passes_held_to_its_ranks_routing(float16_grid: Path,
                                                                              capsys) -> None:
    """build --routing-outputs: every rank's graph outputs its routing and partial sums (one a
    collective, as export.json's "parallel" lists them); check --build reads both there, holds the
    eager models to the graph's choices, and the float16 grid passes, every rank's partials within
    their bound (in the dtype's fixed bound here: 3 layers, one step)."""
    manifest = json.loads((float16_grid / "manifest.json").read_text())
    assert manifest["settings"]["routing_outputs"] is True
    for rank in range(2):
        export = json.loads((float16_grid / f"stage-0/rank-{rank}/export.json").read_text())
        assert [s["name"] for s in export["routing_outputs"]] == ["routing.1", "routing.2"]
        assert [s["name"] for s in export["partial_outputs"]] == [
            f"partial.{n}" for n in range(len(export["parallel"]["collectives"]))] == [
            f"partial.{n}" for n in range(6)]
        # A MoE layer's FFN sums [u | shared] in float32; the others the model dtype.
        assert [s["dtype"] for s in export["partial_outputs"]] == [
            "float32" if c["dtype"] == "float32" else "float16" for c in export["parallel"]["collectives"]]
    assert main(["check", "--build", str(float16_grid), "--steps", "1", "--prompt-len", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["dtype"] == "float16" and report["first_divergent_rank"] is None
    assert report["held_routing"] and report["routing_read_from"] == "graph outputs"
    assert report["partials_read_from"] == "graph outputs" and not report["ranks_differ"]
    for step in report["steps"]:
        assert [(e["stage"], e["rank"]) for e in step["ranks"]] == [(0, 0), (0, 1)]
        assert all(e["passed"] and e["worst"]["rel"] <= 0.5 * e["worst"]["bound"] for e in step["ranks"])


@pytest.mark.usefixtures("bounded_check")
def test_float16_grid_names_the_rank_of_a_wrong_expert(float16_grid: Path, tmp_path: Path, capsys) -> None:
    """Rank 0's layer 2 routed experts' down projection scaled by 1.5 in float16: check --build fails
    and names stage 0 rank 0 and layer 2's FFN (rank 1's partials, read from its outputs, pass)."""
    bad = shutil.copytree(float16_grid, tmp_path / "bad")
    scale_weight(bad, 0, 0, "layers.2.block_sparse_moe.experts.w2", 1.5)
    assert main(["check", "--build", str(bad), "--steps", "1", "--prompt-len", "8"]) == 1
    printed = capsys.readouterr().out
    assert "first divergent stage and rank: stage 0 rank 0 (layer 2 ffn) at prefill: partial sum rel" \
        in printed


def test_float16_grid_without_checking_outputs_is_refused(float16_grid: Path, tmp_path: Path,
                                                          capsys) -> None:
    """A half-precision grid whose ranks do not output their routing (as served): refused, naming the
    build option (a rank's graph runs in pieces, which give no intermediates)."""
    from test_shards import rerecord

    served = shutil.copytree(float16_grid, tmp_path / "served")
    for rank in range(2):
        path = served / f"stage-0/rank-{rank}/export.json"
        export = json.loads(path.read_text())
        del export["routing_outputs"], export["partial_outputs"]
        path.write_text(json.dumps(export))
        rerecord(served, 0, ["export.json"], rank)
    assert main(["check", "--build", str(served), "--steps", "1"]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert f"{served}: a build split over 2 ranks whose ranks' export.json list none of check's" in err
    assert "the ranks' float16 graphs give only their outputs" in err and "--routing-outputs" in err


def strip_checking_outputs(folder: Path, out: Path) -> Path:
    """A copy of a rank export with check's outputs taken out (the Identity nodes and graph outputs
    routing.* and partial.* that add_checking_outputs appends): the graph as served."""
    shutil.copytree(folder, out)
    model = onnx.load(out / "model.onnx", load_external_data=False)
    extra = {o.name for o in model.graph.output if o.name.startswith((ROUTING_PREFIX, PARTIAL_PREFIX))}
    nodes = [n for n in model.graph.node if not set(n.output) & extra]
    outputs = [o for o in model.graph.output if o.name not in extra]
    del model.graph.node[:], model.graph.output[:]
    model.graph.node.extend(nodes)
    model.graph.output.extend(outputs)
    (out / "model.onnx").write_bytes(model.SerializeToString())
    return out


def with_checking_outputs(folder: Path, out: Path) -> Path:
    """A copy of a rank export with check's outputs added as `export --routing-outputs` adds them."""
    shutil.copytree(folder, out)
    manifest = json.loads((out / "export.json").read_text())
    config = K3Config.from_json(out / "config.json")
    manifest.update(add_checking_outputs(out / "model.onnx", config, range(*manifest["layers"])))
    (out / "export.json").write_text(json.dumps(manifest))
    return out


def test_checking_outputs_change_nothing_and_are_the_sums_inputs(grid_build: Path, float16_grid: Path,
                                                                  tmp_path: Path) -> None:
    """Both ranks' graphs with and without check's outputs, run together under torchrun (gloo sums),
    a ragged prefill in one process per rank: in ONNX Runtime's pieces (float32: stage 0 of the
    2 x 2 build; float16: the grid built with --routing-outputs) and in the TensorRT-RTX network
    evaluator (float16; bfloat16, exported with --routing-outputs) every served output is bit for
    bit the same; each partial.{n} is bit for bit what the pieces hand their n-th sum, and in the
    network within the dtype's bound of the split eager model's partial sum (held to the network's
    routing). The graphs without them are those with them stripped, and adding them back as export
    does gives the exported bytes again."""
    cases = {"float32": (grid_build / "stage-0", None), "float16": (None, float16_grid / "stage-0")}
    short_config().to_json(tmp_path / "config.json")
    for rank in range(2):
        assert main(["export", "--config", str(tmp_path / "config.json"), "--dtype", "bfloat16",
                     "--ranks", "2", "--rank", str(rank), "--routing-outputs", "--quiet",
                     "--out", str(tmp_path / f"bfloat16-exported/rank-{rank}")]) == 0
    cases["bfloat16"] = (None, tmp_path / "bfloat16-exported")
    spec = []
    for dtype, (served, checking) in cases.items():
        for rank in range(2):
            rank_folder = f"rank-{rank}"
            if served:
                with_checking_outputs(served / rank_folder, tmp_path / f"{dtype}-checking" / rank_folder)
            else:
                stripped = strip_checking_outputs(checking / rank_folder, tmp_path / dtype / rank_folder)
                again = with_checking_outputs(stripped, tmp_path / f"{dtype}-again" / rank_folder)
                exported = (checking / rank_folder / "model.onnx").read_bytes()
                assert (again / "model.onnx").read_bytes() == exported
        spec.append({"name": dtype, "served": str(served or tmp_path / dtype),
                     "checking": str(checking or tmp_path / f"{dtype}-checking"),
                     "ort": dtype != "bfloat16", "network": dtype != "float32"})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = torchrun(2, str(PARTIAL_WORKER), str(tmp_path / "spec.json"), str(tmp_path))
    succeeded(proc)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert results["float32"]["partials"] == 10 and results["float16"]["partials"] == 6
        for dtype in ("float32", "float16"):
            assert results[dtype]["ort_outputs_equal"], (dtype, rank)
            assert results[dtype]["ort_partials_equal"] == [True] * results[dtype]["partials"], (dtype, rank)
        for dtype in ("float16", "bfloat16"):
            mine = results[dtype]
            assert mine["network_outputs_equal"], (dtype, rank)
            assert len(mine["network_partials_rel"]) == 6, (dtype, rank)
            assert max(mine["network_partials_rel"]) <= mine["network_partials_bound"], (dtype, rank, mine)


def test_a_grid_rank_runs_on_its_engine(float16_grid: Path, tmp_path: Path) -> None:
    """check --build's grid worker on each rank's engine (grid.rank_engine, GPU only), over the CPU
    stand-in of an engine (not an engine; tests/rank_engine_worker.py) under torchrun: every engine
    tensor bound, the routing and partial sums read from the engine's outputs, each rank's partial sums
    within their bound of its split eager model's, each rank's context on its own GPU with the stage's
    communicator."""
    from engine_standin import engines_recorded
    from test_engine_runner import LIMITS

    build = engines_recorded(float16_grid, tmp_path / "build", LIMITS)
    proc = torchrun(2, str(Path(__file__).with_name("rank_engine_worker.py")), str(build), str(tmp_path))
    succeeded(proc)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert seen["refusals"] == [] and seen["bound"] == seen["engine_tensors"]
        assert seen["gpu"] == rank and seen["communicator"] == "the stage's communicator"
        assert seen["read_from"] == "graph outputs" and seen["routing"] == ["routing.1", "routing.2"]
        assert seen["partials"] and all(p["passed"] for p in seen["partials"]), seen["partials"]
