"""Half-precision checks: the same verdict on every CPU, and engines checked held to their own routing.

Verdicts across instruction sets: the checks run under each setting of the two knobs that choose
torch's CPU kernels, one process a leg (each knob is read once per process;
tests/cpu_verdict_worker.py). A bfloat16 check once failed on an AVX-512 machine (11 ties of 109
against a 10% rule) and passed under an AVX2 cap on the same machine. Each leg asserts that its knob
really moved the bits the check compares (else it skips, naming the CPU: its best level may already
be the capped one, which its flags show before the leg starts, or the knob's kernels may not be on the
check's path: ONNX Runtime is not torch),
that the correct export passes with room, and that the 1.5x weight perturbation fails on its numbers:
a cache and the logits among the failed outputs. tools/cpu_bits.py measures which ops each knob moves.

Routing outputs (`export --routing-outputs`): each MoE layer's expert choices as graph outputs
routing.{layer}, so that a half-precision engine, whose outputs are fixed when it is built, can be
checked held to its own choices. Check reads them in place of the intermediates it otherwise exposes
at load; they change nothing else the graph computes (the same numbers as the export without them,
in the same process), and a perturbed export still fails.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from cpu_verdict_worker import run_checks
from reference import PERTURBED, assert_eager_ran, rerecord_file, scaled_copy

from k3export.check.driver import run_check
from k3export.check.machine import KNOBS, cpu_and_flags
from k3export.cli import main
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.onnx.export import ROUTING_PREFIX, add_checking_outputs

HERE = Path(__file__).parent
# leg -> (environment, the (dtype, check) pairs it runs): bfloat16 matmuls go through oneDNN, so
# its cap moves bfloat16; ATen's level moves softmax, norms and elementwise kernels.
LEGS = {
    "default": ({}, [("bfloat16", "network"), ("float16", "onnx"), ("float16", "network")]),
    "ONEDNN_MAX_CPU_ISA=AVX2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, [("bfloat16", "network")]),
    "ATEN_CPU_CAPABILITY=avx2": ({"ATEN_CPU_CAPABILITY": "avx2"},
                                 [("float16", "onnx"), ("float16", "network")]),
}
CASES = [(leg, dtype, kind) for leg, (_, pairs) in LEGS.items() for dtype, kind in pairs]
# The CPU flags of the levels above each cap (oneDNN's ISAs above AVX2: AVX2_VNNI, AVX2_VNNI_2,
# AVX-512, AMX; ATen's: AVX512). A CPU with none of them already runs at the capped level, so its
# capped leg would only compute the default leg's bits again: it is skipped before its process starts.
ABOVE_THE_CAP = {
    "ONEDNN_MAX_CPU_ISA=AVX2": {"avx_vnni", "avx_vnni_int8", "avx_ne_convert", "avx512f", "amx_tile"},
    "ATEN_CPU_CAPABILITY=avx2": {"avx512f"}}
# The variants of an export each check runs on: as exported, with routing outputs, each perturbed.
VARIANTS = [(False, False), (True, False), (False, True)]  # (routed, perturbed)
# Routed and perturbed too, in the published dtype only: with the routed export's numbers equal to the
# plain one's bit for bit (test_routing_outputs_are_read_and_change_nothing_else), the other pairs'
# routed-and-perturbed checks proved nothing the plain perturbed ones do not.
ROUTED_PERTURBED = ("bfloat16", "network")


def with_routing_outputs(export: Path, folder: Path) -> Path:
    """A copy of the export with routing outputs added as `export --routing-outputs` adds them."""
    shutil.copytree(export, folder)
    manifest = json.loads((folder / "export.json").read_text())
    config = K3Config.from_json(folder / "config.json")
    layers = range(*manifest["layers"])
    manifest.update(add_checking_outputs(folder / "model.onnx", config, layers))
    (folder / "export.json").write_text(json.dumps(manifest))
    rerecord_file(folder, "model.onnx")
    return folder


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool, bool], Path]:
    """(dtype, routed, perturbed) -> k3-tiny export folder, float16 and bfloat16: as exported or with
    routing outputs, each also with PERTURBED scaled 1.5x."""
    root = tmp_path_factory.mktemp("half")
    folders = {}
    for dtype in ("bfloat16", "float16"):
        plain = root / dtype
        options = ["--preset", "k3-tiny", "--seed", "0", "--dtype", dtype, "--out", str(plain)]
        assert main(["export", *options]) == 0
        folders[dtype, False, False] = plain
        folders[dtype, True, False] = with_routing_outputs(plain, root / f"{dtype}-routed")
        for routed in (False, True):
            folders[dtype, routed, True] = scaled_copy(folders[dtype, routed, False],
                                                       root / f"{dtype}-{routed}-scaled", PERTURBED, 1.5)
    return folders


@pytest.fixture(scope="module")
def legs(exports: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each leg's reports: {(dtype, kind, routed, perturbed): report}. The default leg checks every
    variant; the capped legs the exports as they are and perturbed."""
    root = tmp_path_factory.mktemp("legs")
    results = {}
    cpu, flags = cpu_and_flags()
    for leg, (env, pairs) in LEGS.items():
        if env and flags and not ABOVE_THE_CAP[leg] & flags:  # no flags (no /proc/cpuinfo): run the leg
            results[leg] = (f"{leg} is at or above this CPU's best level "
                            f"({cpu}: none of {sorted(ABOVE_THE_CAP[leg])})")
            continue
        variants = VARIANTS if not env else [(False, False), (False, True)]
        checks = [(dtype, kind, routed, perturbed) for dtype, kind in pairs for routed, perturbed in variants]
        checks += [] if env else [(*ROUTED_PERTURBED, True, True)]
        # The default leg also runs each export as it is with the eager side streamed.
        streamed = [] if env else [(dtype, kind) for dtype, kind in pairs]
        spec = ([{"kind": kind, "folder": str(exports[dtype, routed, perturbed]),
                  "steps": 0 if perturbed else 2, "eager": "in-memory"}
                 for dtype, kind, routed, perturbed in checks]
                + [{"kind": kind, "folder": str(exports[dtype, False, False]), "steps": 2,
                    "eager": "streamed"} for dtype, kind in streamed])
        if env or os.environ.keys() & set(KNOBS):
            path = root / f"{leg}.json"
            path.write_text(json.dumps(spec))
            clean = {k: v for k, v in os.environ.items() if k not in KNOBS}
            done = subprocess.run([sys.executable, str(HERE / "cpu_verdict_worker.py"), str(path)],
                                  env={**clean, **env}, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            reports = json.loads(done.stdout.splitlines()[-1])
        else:  # no knob here: this process is the default leg's (a process of its own cost 5-10 s)
            reports = run_checks(spec)
        results[leg] = dict(zip(checks, reports[:len(checks)], strict=True))
        if streamed:
            results["streamed"] = dict(zip(streamed, reports[len(checks):], strict=True))
    return results


def numbers(report: dict) -> list[float]:
    """Every relative error and max abs error the check measured, in order."""
    return [x for s in report["steps"] for c in s["outputs"] for x in (c["rel"], c["max_abs"])]


@pytest.mark.parametrize(("leg", "dtype", "kind"), CASES, ids=["-".join(case) for case in CASES])
def test_half_precision_verdict_holds_under_the_knob(legs: dict, leg: str, dtype: str, kind: str) -> None:
    env, _ = LEGS[leg]
    if isinstance(legs[leg], str):
        pytest.skip(legs[leg])
    correct, perturbed = legs[leg][dtype, kind, False, False], legs[leg][dtype, kind, False, True]
    if env and numbers(correct) == numbers(legs["default"][dtype, kind, False, False]):
        where = correct["machine"]
        pytest.skip(f"{leg} moves no bit that the {dtype} --{kind} check compares on {where['cpu']} (flags "
                    f"{where['cpu_flags']})")
    assert correct["machine"]["knobs"] == env
    assert correct["passed"], (correct["failed_outputs"], correct["headroom"])
    assert correct["routing_read_from"] == "intermediates" and correct["token_mismatches"] == 0
    # Met with room, not by a hair: the worst output at most 0.8 of its bound.
    assert correct["headroom"]["relative_error"]["ratio"] <= 0.8, correct["headroom"]
    if dtype == "float16":
        # Held to the graph's expert choices (some of which the eager routers would have made
        # otherwise), the comparison measures rounding alone: within float16's fixed bound. (Unheld,
        # a float16 check once compared chaos at relative error 0.8.)
        assert correct["routing_flips"] > 0
        assert all(c["rel"] <= 2e-2 for s in correct["steps"] for c in s["outputs"])
    if dtype == "bfloat16" and kind == "network":
        # Layer 0 runs the same bfloat16 ops in the same order on both sides.
        first = {c["name"]: c for c in correct["steps"][0]["outputs"]}
        assert first["present.0.kda_state"]["rel"] < 1e-2
    failed = perturbed["failed_outputs"]
    assert not perturbed["passed"] and "present.0.kda_state" in failed and "logits" in failed


@pytest.mark.parametrize(("dtype", "kind"), LEGS["default"][1], ids=lambda value: value)
def test_routing_outputs_are_read_and_change_nothing_else(legs: dict, dtype: str, kind: str) -> None:
    """float16 (--onnx, --network) and bfloat16 (--network) with routing outputs: the check reads the
    graph's own outputs, passes, measures exactly what it measures on the export without them (bit
    for bit, in one process), and (bfloat16) the perturbed export fails."""
    plain, routed = legs["default"][dtype, kind, False, False], legs["default"][dtype, kind, True, False]
    assert routed["routing_read_from"] == "graph outputs"
    assert routed["passed"], routed["failed_outputs"]
    assert numbers(routed) == numbers(plain)
    if (dtype, kind) == ROUTED_PERTURBED:
        failed = legs["default"][dtype, kind, True, True]
        assert not failed["passed"] and "logits" in failed["failed_outputs"]


@pytest.mark.parametrize(("dtype", "kind"), LEGS["default"][1], ids=lambda value: value)
def test_streamed_eager_side_gives_the_in_memory_numbers(legs: dict, dtype: str, kind: str) -> None:
    """float16 (--onnx, --network) and bfloat16 (--network): the eager side streamed one layer at a time
    (each layer's weights built when its turn comes, the AttnRes state passed on per step) reports
    what the eager model held whole reports, every number bit for bit (the same ops on the same
    inputs), held to the same expert choices."""
    streamed, in_memory = legs["streamed"][dtype, kind], legs["default"][dtype, kind, False, False]
    assert streamed["eager"]["mode"] == "streamed" and in_memory["eager"]["mode"] == "in-memory"
    assert_eager_ran(streamed, in_memory, [[0, K3Config.from_preset("k3-tiny").num_hidden_layers]])
    assert streamed["steps"] == in_memory["steps"] and streamed["passed"]
    assert streamed["routing_flips"] == in_memory["routing_flips"]


def test_export_option_adds_each_moe_layers_choices(tmp_path: Path) -> None:
    """`export --routing-outputs` on a 3-layer range (layer 0 dense): routing.1 and routing.2, int64
    [tokens, k], graph outputs after the others, listed apart from the compared outputs."""
    config = K3Config.from_preset("k3-tiny")
    assert main(["export", "--preset", "k3-tiny", "--layers", "0:3", "--dtype", "float16",
                 "--routing-outputs", "--out", str(tmp_path / "r")]) == 0
    manifest = json.loads((tmp_path / "r" / "export.json").read_text())
    moe = [i for i in range(3) if not config.is_dense(i)]
    assert moe == [1, 2]
    assert [s["name"] for s in manifest["routing_outputs"]] == ["routing.1", "routing.2"]
    assert all(s["dtype"] == "int64" and s["shape"][-1] == config.num_experts_per_token
               for s in manifest["routing_outputs"])
    graph = onnx.load(tmp_path / "r" / "model.onnx", load_external_data=False)
    assert [o.name for o in graph.graph.output][-2:] == ["routing.1", "routing.2"]
    assert not any(s["name"].startswith(ROUTING_PREFIX) for s in manifest["outputs"])


def test_engine_runner_returns_the_routing_outputs(exports: dict, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """check --engine's path for a bfloat16 engine built from such an export: the engine runner binds
    the routing outputs and hands them to the driver, which holds the eager model to them (over the
    CPU stand-in of an engine, as in test_engine_runner: not an engine)."""
    from engine_standin import CpuMemoryEngineRunner, install
    from test_engine_runner import standin_record

    engines = install(monkeypatch)
    export, made = exports["bfloat16", True, False], []

    def runner(signature, routing):
        made.append(CpuMemoryEngineRunner(standin_record(export, tmp_path), export, signature=signature,
                                          extra_outputs=routing))
        return made[-1]

    report = run_check(export, steps=1, prompt_len=20, log=lambda line: None, graph_runner=runner)
    routing = [f"routing.{i}" for i in range(1, 9)]
    assert [s.name for s in made[0].plan.returned][:len(routing)] == routing
    assert report["passed"] and report["routing_read_from"] == "graph outputs", report["failed_outputs"]
    assert engines[0].contexts[0].refusals == []


def test_bfloat16_is_valid_onnx_that_onnxruntime_cpu_cannot_run(exports: dict) -> None:
    """ONNX Runtime's CPU provider has no bfloat16 MatMul: the bf16 graph is checked structurally
    (census, full checker) and as TensorRT parses it (--network, above); check --onnx refuses it."""
    import onnxruntime as ort
    from test_export import census

    export = exports["bfloat16", False, False]
    census(export / "model.onnx")
    with pytest.raises(Exception, match="MatMul"):
        ort.InferenceSession(str(export / "model.onnx"), providers=["CPUExecutionProvider"])
    with pytest.raises(UserError, match="k3export check --network"):
        run_check(export, log=lambda line: None)


@pytest.fixture(scope="module")
def float16_chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_parallel_grid's 3-layer k3-tiny in float16, 2 stages, built with `routing_outputs = true`
    under the recipe's [build] (the grid's build takes the command-line option)."""
    from test_parallel_grid import short_recipe

    folder = tmp_path_factory.mktemp("chain16")
    recipe = short_recipe(folder, "float16", 2, 1)
    recipe.write_text(recipe.read_text().replace("[build]", "[build]\nrouting_outputs = true"))
    assert main(["build", str(recipe), "--out", str(folder / "build"), "--quiet"]) == 0
    return folder / "build"


def test_float16_chain_is_checked_held_to_its_stages_routing_outputs(float16_chain: Path, tmp_path: Path,
                                                                    capsys) -> None:
    """check --build of a float16 stage chain built with routing outputs: each stage's expert choices
    read from its graph outputs (one routing.{layer} a MoE layer of the stage), the check passes (its
    eager side in memory, or streamed with the same numbers); with
    stage 1's routed experts' up projection (after their norm) scaled by 1.5 it fails, naming stage 1."""
    from test_parallel_grid import scale_weight

    manifest = json.loads((float16_chain / "manifest.json").read_text())
    assert manifest["settings"]["routing_outputs"] is True
    stages = [json.loads((float16_chain / f"stage-{i}/export.json").read_text()) for i in range(2)]
    config = K3Config.from_json(float16_chain / "stage-0/config.json")
    assert [[s["name"] for s in m["routing_outputs"]] for m in stages] == [
        [f"routing.{i}" for i in range(*m["layers"]) if not config.is_dense(i)] for m in stages]
    check = ["check", "--build", str(float16_chain), "--steps", "1", "--prompt-len", "8", "--json"]
    assert main([*check, "--eager", "in-memory"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["held_routing"] and report["routing_read_from"] == "graph outputs"
    # The eager side streamed one layer at a time: the same numbers, held to the same choices.
    assert main([*check, "--eager", "streamed"]) == 0
    streamed = json.loads(capsys.readouterr().out)
    assert streamed["eager"]["mode"] == "streamed" and streamed["steps"] == report["steps"]
    assert_eager_ran(streamed, report, [m["layers"] for m in stages])
    bad = shutil.copytree(float16_chain, tmp_path / "bad")
    layer = stages[1]["layers"][0]
    scale_weight(bad, 1, None, f"layers.{layer}.block_sparse_moe.routed_expert_up_proj.weight", 1.5)
    assert main(["check", "--build", str(bad), "--steps", "1", "--prompt-len", "8", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["passed"] and report["first_divergent_stage"] == 1
    assert report["routing_read_from"] == "graph outputs"


def test_a_routed_chain_runs_on_its_engines(float16_chain: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`k3export run` on a build made with routing outputs, on its engines (the CPU stand-in of an
    engine: the parsed network on the memory the runner binds, not an engine): the runtime reads no
    routing, and each engine still has every output bound (TensorRT runs none with an output unbound);
    the tokens are ONNX Runtime's."""
    from engine_standin import engines_recorded, install
    from test_engine_runner import LIMITS

    build = engines_recorded(float16_chain, tmp_path / "build", LIMITS)
    engines = install(monkeypatch, gpus=2)
    tokens = {}
    for runner in ("onnx", "engine"):
        assert main(["run", str(build), "--runner", runner, "--batch", "2", "--prompt-len", "6",
                     "--max-new-tokens", "2", "--json"]) == 0
        tokens[runner] = json.loads(capsys.readouterr().out)["tokens"]
    assert tokens["engine"] == tokens["onnx"]
    contexts = [c for e in engines for c in e.contexts]
    assert len(contexts) == 2 and not any(c.refusals for c in contexts)
    for context in contexts:
        assert {n for n in context.addresses if n.startswith("routing.")} == \
            {n for n in context.engine.outputs if n.startswith("routing.")} != set()


def printed(*argv: str) -> tuple[int, str]:
    """`k3export ARGV` in this process: its exit code and stdout, as the GPU script's step reads it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(list(argv))
    return code, out.getvalue()


def test_the_gpu_scripts_readers_read_what_its_commands_print(float16_chain: Path, tmp_path: Path) -> None:
    """tools/gpu_engines.py's key-number readers (which run only on a GPU there) on what the commands it
    runs print and write here, for the float16 chain built with check's outputs (as the script builds
    its recipes): `check --onnx --json` of stage 0 and `check --build --json` of the chain (passed,
    the worst output's headroom under 1, the eager routers' flips), of a copy with a wrong weight in
    stage 1 (failed outputs, first divergent stage), `run --json` (decode rate, prefill time), and the
    export and build folders (MB as on disk, k3 nodes as in the graph, a routing output a MoE layer)."""
    from test_gpu_check import gpu_engines
    from test_parallel_grid import scale_weight

    for argv in (["--onnx", str(float16_chain / "stage-0")], ["--build", str(float16_chain)]):
        code, stdout = printed("check", *argv, "--steps", "1", "--prompt-len", "8", "--json")
        numbers = gpu_engines.check_numbers(stdout)
        assert code == 0 and numbers["passed"] is True and 0 < numbers["headroom"] <= 1, numbers
        assert numbers["worst"] in {c["name"] for c in json.loads(stdout)["steps"][0]["outputs"]}
        assert isinstance(numbers["routing flips"], int) and "failed outputs" not in numbers
    bad = shutil.copytree(float16_chain, tmp_path / "bad")
    layer = json.loads((bad / "stage-1/export.json").read_text())["layers"][0]
    scale_weight(bad, 1, None, f"layers.{layer}.block_sparse_moe.routed_expert_up_proj.weight", 1.5)
    code, stdout = printed("check", "--build", str(bad), "--steps", "1", "--prompt-len", "8", "--json")
    numbers = gpu_engines.check_numbers(stdout)
    assert code == 1 and numbers["passed"] is False and numbers["headroom"] > 1, numbers
    assert "logits" in numbers["failed outputs"].split(",") and numbers["first divergent stage"] == 1
    code, stdout = printed("run", str(float16_chain), "--prompt-len", "4", "--max-new-tokens", "3", "--json")
    numbers = gpu_engines.runtime_numbers(stdout)
    assert code == 0 and numbers["decode tokens/s"] > 0 and numbers["prefill s"] > 0, numbers
    # Read after other lines too, as the runtime under torchrun prints them.
    assert gpu_engines.runtime_numbers("stage 0: loaded\n{not json\n" + stdout) == numbers
    stage = float16_chain / "stage-0"
    manifest = json.loads((stage / "export.json").read_text())
    graph = onnx.load(stage / "model.onnx", load_external_data=False).graph
    config = K3Config.from_json(stage / "config.json")
    assert gpu_engines.export_numbers(stage, "") == {
        "MB": sum((stage / name).stat().st_size for name in manifest["files"]) / 1e6,
        "k3 nodes": sum(n.domain == "k3" for n in graph.node),
        "routing outputs": sum(not config.is_dense(i) for i in range(*manifest["layers"]))}
    built = json.loads((float16_chain / "manifest.json").read_text())
    assert gpu_engines.recipe_numbers(float16_chain, "") == {
        "stages": 2, "MB": sum((float16_chain / name).stat().st_size for name in built["files"]) / 1e6}
