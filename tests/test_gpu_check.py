"""tools/gpu_check --engines (tools/gpu_engines.py) on this machine, which has no GPU: its dry run plans
commands that k3export's own parsers take, within 8 minutes, and says why each GPU step is skipped here; a
run exits 2 naming the missing GPU; the step runner stops a step past its budget with every process it
started and skips what depends on a failed step; the recipes it writes load as k3export recipes. (Its
key-number readers are tested on what the commands it runs print and write here, where those are made:
test_half_precision's float16 chain.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed.run
from test_docs import lay_out_folder

from k3export.cli import build_parser
from k3export.runtime.__main__ import build_parser as runtime_parser
from k3export.shards.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
WRAPPER = ROOT / "tools" / "gpu_check"
# A GPU present, not an nvidia-smi on the PATH: images without a GPU can ship one.
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def tool(name: str) -> ModuleType:
    """A script of tools/ (not a package) as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_engines = tool("gpu_engines")


def wrapper(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}  # the wrapper runs ${PYTHON:-python3}
    return subprocess.run([str(WRAPPER), *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    work = tmp_path_factory.mktemp("work")
    done = wrapper("--engines", "--dry-run", "--work", str(work))
    assert done.returncode == 0, done.stderr
    return done.stdout, work


def planned_rows(stdout: str) -> list[dict[str, str]]:
    """The planned table's rows by column (a markdown table: `| a | b |`)."""
    header, _, *rows = [line[2:-2].split(" | ") for line in stdout.splitlines() if line.startswith("| ")]
    assert header == ["step", "command", "result", "s", "key numbers"]
    return [dict(zip(header, row, strict=True)) for row in rows]


def lay_out(argv: list[str], work: Path) -> None:
    """The paths a command names under the work folder, made (the parsers refuse missing inputs): a
    name with a suffix (an engine, a recipe) as a file, any other as a folder holding the manifest of
    the kind of output it is read as (test_docs.lay_out_folder; torchrun's DIR is run's)."""
    program = argv[1] if argv[0] == "k3export" else "run" if argv[0] == "torchrun" else ""
    for before, token in zip(["", *argv[:-1]], argv, strict=True):
        if token.startswith(str(work)):
            path = Path(token)
            if path.suffix:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            else:
                lay_out_folder(path, before, program)


def parse_planned(command: str, work: Path) -> None:
    """Parses a planned command with the parser of the program it runs; SystemExit if it does not."""
    argv = [t.replace("$WORK", str(work)) for t in command.split()]
    lay_out(argv, work)
    if argv[0] == "k3export":
        build_parser().parse_args(argv[1:])
    elif argv[0] == "torchrun":
        launch = torch.distributed.run.parse_args(argv[1:])
        assert launch.module and launch.training_script == "k3export.runtime", command
        assert int(launch.nproc_per_node) >= 1
        runtime_parser().parse_args(launch.training_script_args)
    elif argv[:2] == ["python", "tools/gpu_check.py"]:
        tool("gpu_check").parse_args(argv[2:])
    elif argv[:2] == ["python", "tools/gpu_engines.py"]:
        gpu_engines.parse_args(argv[2:])
    else:
        pytest.fail(f"a planned command of no known program: {command}")


def test_every_planned_command_parses(dry_run: tuple[str, Path], capsys: pytest.CaptureFixture) -> None:
    stdout, work = dry_run
    rows = planned_rows(stdout)
    steps = [row["step"] for row in rows]
    for kind in ("export", "build", "check"):
        assert {f"{kind} {d}" for d in ("float32", "float16", "bfloat16")} <= set(steps)
    assert {"device caches", "communicator", "build stages", "run stages", "check stages", "build grid",
            "run grid", "check grid", "plugins"} <= set(steps)
    for row in rows:
        try:
            parse_planned(row["command"], work)
        except SystemExit:
            pytest.fail(f"{row['step']}: `{row['command']}` does not parse: {capsys.readouterr().err}")


def test_the_budgets_fit_in_8_minutes(dry_run: tuple[str, Path]) -> None:
    stdout, _ = dry_run
    budgets = [int(row["s"]) for row in planned_rows(stdout)]
    assert all(b > 0 for b in budgets)
    assert sum(budgets) <= 8 * 60
    assert f"step budgets add up to {sum(budgets)} s" in stdout


@NO_GPU
def test_without_a_gpu_every_step_says_it_is_skipped_for_that(dry_run: tuple[str, Path]) -> None:
    stdout, _ = dry_run
    assert "machine: no GPU" in stdout
    for row in planned_rows(stdout):
        assert row["result"].startswith("skipped: no GPU (nvidia-smi finds none)"), row


@NO_GPU
def test_a_run_without_a_gpu_exits_2_naming_it() -> None:
    done = wrapper("--engines")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no GPU (nvidia-smi finds none)" in done.stderr


def test_without_engines_the_wrapper_runs_the_kernel_check() -> None:
    done = wrapper("--help")
    assert done.returncode == 0, done.stderr
    assert "GPU check of the k3plugins Triton kernels" in done.stdout and "--engines" not in done.stdout


def step(name: str, code: str, budget_s: int = 10, needs: tuple[str, ...] = ()) -> gpu_engines.Step:
    return gpu_engines.Step(name, ["python", "-c", code], budget_s, "", lambda stdout: {}, needs=needs)


def test_a_step_past_its_budget_is_stopped_with_its_children(tmp_path: Path) -> None:
    # The child holds the step's output pipe open: were it left running, the step would wait 60 s for it.
    sleeper = step("sleeper", "import subprocess, sys, time; "
                   "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)",
                   budget_s=2)
    started = time.monotonic()
    gpu_engines.run_step(sleeper, tmp_path / "sleeper.log", tmp_path)
    assert time.monotonic() - started < 15
    assert sleeper.result == "failed: past its budget of 2 s (stopped)"
    assert "(timed out)" in (tmp_path / "sleeper.log").read_text()


def test_steps_after_a_failure_or_past_the_total_budget_are_skipped(tmp_path: Path) -> None:
    error = "import sys; print('k3export: error: no such thing', file=sys.stderr); sys.exit(2)"
    steps = [step("fails", error),
             step("reads it", "pass", needs=("fails",)), step("passes", "pass"),
             step("too long", "pass", budget_s=100)]
    gpu_engines.run_steps(steps, budget=30, logs=tmp_path, work=tmp_path)
    assert [s.result for s in steps] == [
        "failed: exit 2: k3export: error: no such thing", "skipped: needs fails, which failed", "passed",
        "skipped: time budget (30 s of --budget 30 left, it needs 100 s)"]
    table = gpu_engines.table(gpu_engines.result_rows(steps, tmp_path))
    assert table[0] == "| step | command | result | s | key numbers |" and len(table) == 2 + len(steps)


RECIPES = [(gpu_engines.STAGE_RECIPE, None), (gpu_engines.GRID_SOURCE, 1)]


@pytest.mark.parametrize(("source", "stages"), RECIPES)
def test_the_recipes_written_for_the_machine_load(source: str, stages: int | None, tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    gpu_engines.write_recipe(source, path, "tensorrt", "sm90", stages)
    recipe, original = load_recipe(path), load_recipe(ROOT / source)
    assert (recipe.backend, recipe.target) == ("tensorrt", "sm90")
    assert recipe.stage_count == (stages or original.stage_count) and recipe.ranks == original.ranks
    assert {k: v for k, v in recipe.data.items() if k not in ("stages", "build")} == \
        {k: v for k, v in original.data.items() if k not in ("stages", "build")}


def test_the_preflight_runs_to_its_end_over_the_standin(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU script's first step, here with TensorRT-RTX for sm89 and the CPU stand-in of an engine in
    the loaded engine's place (tests/engine_standin.py; not an engine): the plugins registered twice, the
    dtype tables, a 2-layer k3-tiny with packed MXFP4 experts and routing outputs exported and built
    (a real TensorRT-RTX build), then loaded and called with every tensor bound and the engine's own
    in-place pairs followed; then the layer pair at the published widths, exported, built (TensorRT-RTX's
    plugins, whose launches on a GPU are the JIT kernels') and called so, its plugin layers given the
    published shapes. Full TensorRT's shared-memory check needs it installed (GPU host only)."""
    from engine_standin import install

    engines = install(monkeypatch)
    numbers = gpu_engines.probe_preflight("tensorrt-rtx", "sm89", tmp_path / "preflight")
    assert numbers["registrations"] == 2 and "int32" in numbers["dtypes"].split(",")
    assert numbers["aliases"] == "kda_state,mla_latent" and numbers["swapped"] == "k_conv,q_conv,v_conv"
    tiny, published = engines
    for engine, key in ((tiny, "tensors bound"), (published, "published tensors bound")):
        (context,) = engine.contexts
        assert context.refusals == [] and len(context.calls) == 2
        assert numbers[key] == engine.num_io_tensors == len(context.addresses)
    assert {n for n in tiny.contexts[0].addresses if n.startswith("routing.")} == {"routing.2", "routing.3"}
    assert numbers["published aliases"] == "kda_state,mla_latent"
    # The plugin layers at the published widths: KDA's state 96 heads of 128 x 128, MLA's latent 576 wide.
    shapes = {name.rsplit(".", 1)[-1]: tuple(published.inputs[name].shape) for name in published.inputs}
    assert shapes["kda_state"] == (-1, 96, 128, 128) and shapes["mla_latent"][1:] == (1, 4096, 576)
    assert published.outputs["logits"].dtype.name == "BF16"


gpu_check = tool("gpu_check")
kernel_estimate = tool("kernel_estimate")


@pytest.mark.parametrize("rows", [kernel_estimate.kda_rows, kernel_estimate.mla_rows],
                         ids=lambda f: f.__name__)
def test_the_estimates_rows_are_timed_on_the_shapes_they_count(rows) -> None:
    """gpu_check --estimate times each of kernel_estimate's rows as a Case of the same shape: the bytes
    gpu_check counts for that Case (its own count, from its inputs) are the row's; MLA's FLOPs too."""
    for row in rows():
        fields = dict(row.case)
        case = gpu_check.Case(fields.pop("kernel"), "bfloat16", **fields)
        nbytes, flops = gpu_check.cost(case)
        assert nbytes == pytest.approx(row.bytes), row.shape
        if row.op == "mla":
            assert flops == pytest.approx(row.flops), row.shape
        assert int(row.shape.split(" H")[1].split()[0]) == case.H, row.shape


def test_the_estimate_is_printed_beside_the_measurement() -> None:
    row = kernel_estimate.Row("kda", "AOT", "decode T1 H96", [], bytes=3.35e6, flops=0.0)
    est = kernel_estimate.Estimate(row, [], issue_s=4e-6, memory_s=1e-6)  # estimated 4 us, bound 1 us
    case = gpu_check.Case("aot:kda", "bfloat16", 1, 1, heads=96)
    measured = gpu_check.Result(case, status="ok", ms=0.008)
    header, _, line = gpu_check.estimate_lines([(case, est)], {case: measured})
    cells = line.split()
    assert header.split()[:5] == ["op", "form", "shape", "est", "us"]
    assert cells[-6:] == ["4.0", "8.0", "2.00", "25", "12.5", "ok"]  # meas/est 2, % bound 25 then 12.5
    assert gpu_check.estimate_lines([(case, est)], {})[2].split()[-4:] == ["-", "25", "-", "-"]
    assert [gpu_check.estimate_machine(n) for n in ("NVIDIA H200", "NVIDIA B200", "NVIDIA H100 80GB HBM3")] \
        == ["h200", "b200", "h100"]
