"""GPU check of k3export's engines: k3-tiny exported, built, checked and run on this machine's GPUs.

Issue 27's GPU script, for a machine with NVIDIA GPUs and TensorRT (full `tensorrt`, or `tensorrt_rtx`).
It drives k3export through its command line as a user would: every step is one command in its own
process (`k3export` as `python -m k3export.cli`, `torchrun` as `python -m torch.distributed.run`) with
its own time budget, in a work folder; then ONE table. Runs from the source tree, like gpu_check.py:

    tools/gpu_check --engines                 # the wrapper sets PYTHONPATH=.:plugins and runs this file
    tools/gpu_check --engines --dry-run       # the plan on this machine (commands, budgets, skips); no GPU
    tools/gpu_check --engines --work DIR --budget 300
    PYTHONPATH=.:plugins python3 tools/gpu_engines.py ...   # the same without the wrapper

On the device tool: `run` with command `tools/gpu_check --engines` and timeout_s 560. The table, its JSON
and every step's log come back under $OUT.

The machine: the backend is `tensorrt` where `import tensorrt` works, else `tensorrt-rtx` where
`import tensorrt_rtx` does; the target is GPU 0's compute capability (`nvidia-smi --query-gpu=compute_cap`,
k3export.engine.flavours.gpu_targets: sm90 on an H200). TensorRT-RTX has no sm90 or sm100 target, so on
a datacenter GPU only full TensorRT builds. Where no GPU answers, the dry run plans for sm90.

The steps, in order, and what each proves when it passes on a GPU. Each has a budget in seconds, its
timeout (BUDGETS; they add up to 480, 8 minutes on one H200; --dry-run prints each):

 0. preflight: `python tools/gpu_engines.py --probe preflight --backend B --target T $WORK/preflight`, in
    a minute, what TensorRT 11 would refuse on a first run, each fault named (probe_preflight): the plugins
    registered twice in one process; every plugin dtype in the flavour's tables; (full TensorRT) each AOT
    kernel's shared memory at the published widths against this GPU's limit, those over 48 KB listed; a
    2-layer k3-tiny (packed MXFP4 experts, routing outputs) built, loaded by the engine runner (its tensors
    and in-place pairs as the engine reports them) and called with every tensor bound; then a KDA and an MLA
    layer at the published widths (96 KDA heads of 128, latent 576, values 512) in bfloat16 built and called
    so, its logits finite: the plugins' launches the published model makes. Every step that builds an engine
    needs it.
 1. export float32 / float16 / bfloat16: `k3export export --preset k3-tiny --dtype D`, the half ones with
    --routing-outputs (each MoE layer's chosen experts as outputs, so the engine's half-precision check
    holds the eager routers to them). Runs on the CPU; the later steps read these folders.
 2. device caches: `python tools/gpu_engines.py --probe caches EXPORT` on the bfloat16 export: every
    cache its export.json declares allocated on the GPU in its own dtype (bfloat16 included, which numpy
    cannot hold) at batch 2 and the export's capacity, written and read back, allocated by the engine
    runner's own `device_caches` from its binding plan (k3export.engine.runner).
 3. communicator: `python tools/gpu_engines.py --probe communicator`: an NCCL process group of world
    size 1 on GPU 0, k3export.runtime.nccl.communicator_capsule(group) returning a PyCapsule (what
    IExecutionContext.set_communicator takes), and an all-reduce on the group after it.
 4. build float32 / float16 / bfloat16: `k3export build --onnx EXPORT --backend B --target T --out
    D.engine`: the plugins (full TensorRT: their AOT forms) built into an engine for this GPU.
 5. check float32 / float16 / bfloat16: `k3export check --engine D.engine --json`: the engine
    deserialized and run on the GPU against the eager model, prefill and 16 decode steps, the halves
    held to the engine's expert choices.
 6. k3-tiny in stages: `k3export build $WORK/k3-tiny.toml --routing-outputs --out $WORK/stages` (the
    recipe is engines/k3-tiny.toml with [build] backend and target this machine's, written when the
    step starts), then `torchrun
    --standalone --nproc-per-node 2 -m k3export.runtime $WORK/stages --runner engine ...` (one GPU a
    stage, so 2 GPUs) and `k3export check --build $WORK/stages`: a pipeline of engines built, served
    across its stage boundary, and checked stage by stage.
 7. the 1 x 2 grid: engines/k3-tiny-2x2.toml in one stage (written as $WORK/k3-tiny-1x2.toml, backend and
    target as above; no recipe in engines/ is that small), built with engines (the ranks' DIST_COLLECTIVE
    layers; on one GPU too; with --routing-outputs, the partial sums check reads from a rank's engine),
    then run under torchrun and `check --build`, both needing 2 GPUs.
 8. plugins: `python tools/gpu_check.py --only plugin --dtypes bfloat16 --no-fla`: the plugins' enqueue
    bodies (k3plugins.trt.launch_from_pointers) on raw device pointers against the eager ops,
    gpu_check.py's plugin rows in the published dtype (`tools/gpu_check` alone runs every dtype).

A step is skipped, saying why, where this machine cannot run it (no GPU; no TensorRT or no build for the
target; fewer GPUs than processes), where a step it reads did not pass, or where its budget no longer
fits in what is left of --budget. A step that runs past its budget is stopped (its whole process group)
and fails. So on a machine with a GPU but no TensorRT it runs the exports, the device caches, the
communicator and the plugins, and says that it skipped the rest.

The table: step, command ($WORK is the work folder), result (passed, failed: why, skipped: why),
seconds, and the key numbers read from the step's output: check's --json report (passed; headroom, the
worst output's relative error over its bound; routing flips, the eager routers' own choices that
differed from the engine's), the runtime's --json (decode tokens/s), export.json, the engine's record,
the build's manifest.json and gpu_check.json. Failed steps' log tails print before it.

Exit status: 1 if any step failed; 2 if there is no GPU (nothing runs); 0 otherwise (skips included).
With $OUT set (the device tool) or --out DIR, gpu_engines.txt (the table), gpu_engines.json (every
step) and gpu_engines_logs/ (each step's command, stdout and stderr) are written there; otherwise the
logs go to the work folder.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from k3export.config import K3Config
from k3export.engine.flavours import FLAVOURS, gpu_targets, target_problem

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "float16", "bfloat16")
TOTAL_BUDGET_S = 480  # 8 minutes on one H200
# Seconds a step may take (its timeout); they add up to TOTAL_BUDGET_S.
BUDGETS = {"preflight": 60, "export": 20, "caches": 15, "communicator": 15, "build": 30, "check": 15,
           "build recipe": 45, "runtime": 15, "check build": 25, "plugins": 25}
STAGE_RECIPE = "engines/k3-tiny.toml"
GRID_SOURCE = "engines/k3-tiny-2x2.toml"
PLANNED_TARGET = "sm90"  # where no GPU answers: an H200's, so that the plan shows the commands it runs
PROBE_BATCH = 2  # check's default batch
PROBES = ("preflight", "caches", "communicator")


@dataclass(frozen=True)
class Machine:
    gpus: list[str]  # each GPU's compute capability, from nvidia-smi
    backend: str | None  # tensorrt | tensorrt-rtx | None
    missing_modules: frozenset[str]  # of those the steps need (MODULES)

    @property
    def target(self) -> str:
        return self.gpus[0] if self.gpus else PLANNED_TARGET

    def line(self) -> str:
        gpus = f"{len(self.gpus)} GPUs ({', '.join(self.gpus)})" if self.gpus else \
            f"no GPU (nvidia-smi finds none; planned for {PLANNED_TARGET}, an H200's)"
        trt = self.backend or "none"
        modules = ", ".join(sorted(self.missing_modules)) or "none"
        return f"machine: {gpus}; TensorRT backend: {trt}; modules missing: {modules}"


# The Python modules a kind of step needs beyond torch and k3export, and k3export's extra that brings them.
MODULES = {"export": (("onnx", "onnxscript"), "onnx"), "plugins": (("triton",), "kernels")}


def survey() -> Machine:
    needed = [m for modules, _ in MODULES.values() for m in modules]
    return Machine(gpus=gpu_targets(), backend=tensorrt_backend(),
                   missing_modules=frozenset(m for m in needed if not has_module(m)))


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name whose parent is missing
        return False


def tensorrt_backend() -> str | None:
    """Full TensorRT where it imports (it builds for this GPU), else TensorRT-RTX, else None."""
    for backend in ("tensorrt", "tensorrt-rtx"):
        try:
            importlib.import_module(FLAVOURS[backend].module)
        except Exception:  # ImportError, or a placeholder wheel's own error
            continue
        return backend
    return None


@dataclass
class Step:
    name: str
    argv: list[str]  # as a user types it: k3export ..., torchrun ..., python tools/...
    budget_s: int
    reads: str  # the key numbers it gives
    numbers: Callable[[str], dict[str, Any]]  # from its standard output (and the files it wrote)
    needs: tuple[str, ...] = ()  # steps whose outputs it reads
    skip: str = ""  # why this machine cannot run it
    prepare: Callable[[], None] | None = None  # writes an input of its own before it runs
    result: str = "not run"  # passed | failed: why | skipped: why
    seconds: float | None = None
    values: dict[str, Any] = field(default_factory=dict)
    log: str = ""


def reasons(*why: str) -> str:
    return "; ".join(w for w in why if w)


def plan(machine: Machine, work: Path) -> list[Step]:
    no_gpu = "" if machine.gpus else "no GPU (nvidia-smi finds none)"
    backend, target = machine.backend, machine.target
    if backend is None:
        no_engine = "no TensorRT (neither `import tensorrt` nor `import tensorrt_rtx` works)"
    else:
        no_engine = f"{FLAVOURS[backend].title} has no {target} target" \
            if target_problem(FLAVOURS[backend], target) else ""

    def missing(kind: str) -> str:
        modules, extra = MODULES[kind]
        names = [m for m in modules if m in machine.missing_modules]
        return f"{', '.join(names)} not installed (pip install -c constraints.txt -e '.[{extra}]')" \
            if names else ""

    backend_name = backend or "tensorrt"  # where neither flavour imports: what the skipped steps would use
    engine_args = ["--backend", backend_name, "--target", target]
    # First, in a minute, what would stop the first run on this host: every step that builds or loads an
    # engine needs it, so a fault it names ends the run early instead of in each engine step.
    steps = [Step("preflight", ["python", "tools/gpu_engines.py", "--probe", "preflight", *engine_args,
                                str(work / "preflight")],
                  BUDGETS["preflight"], "registrations, smem KB, aliases, tensors bound", last_json_object,
                  skip=reasons(no_gpu, no_engine))]
    for dtype in DTYPES:
        export = work / f"export-{dtype}"
        half = [] if dtype == "float32" else ["--routing-outputs"]
        steps.append(Step(f"export {dtype}", ["k3export", "export", "--preset", "k3-tiny", "--dtype", dtype,
                                              *half, "--out", str(export)],
                          BUDGETS["export"], "MB, k3 nodes, routing outputs", partial(export_numbers, export),
                          skip=reasons(no_gpu, missing("export"))))
    steps.append(Step("device caches", ["python", "tools/gpu_engines.py", "--probe", "caches",
                                        str(work / "export-bfloat16")],
                      BUDGETS["caches"], "caches, MB, dtypes", last_json_object, needs=("export bfloat16",),
                      skip=no_gpu))
    steps.append(Step("communicator", ["python", "tools/gpu_engines.py", "--probe", "communicator"],
                      BUDGETS["communicator"], "capsule, NCCL version", last_json_object,
                      skip=no_gpu))
    for dtype in DTYPES:
        engine = work / f"{dtype}.engine"
        steps.append(Step(f"build {dtype}", ["k3export", "build", "--onnx", str(work / f"export-{dtype}"),
                                             *engine_args, "--out", str(engine)],
                          BUDGETS["build"], "MB, plugin layers, device MB", partial(engine_numbers, engine),
                          needs=("preflight", f"export {dtype}"), skip=reasons(no_gpu, no_engine)))
    for dtype in DTYPES:
        steps.append(Step(f"check {dtype}", ["k3export", "check", "--engine", str(work / f"{dtype}.engine"),
                                             "--json"],
                          BUDGETS["check"], "passed, headroom, routing flips", check_numbers,
                          needs=(f"build {dtype}",), skip=reasons(no_gpu, no_engine)))
    # Each recipe is written into the work folder for this machine (its backend and target, and the
    # grid's one stage) when its build starts (write_recipe), so that the built folder records them.
    # Both with check's outputs: a grid's engines are checked from their partial sums, which an engine
    # gives only as outputs (and a half-precision one from its expert choices).
    recipes = (("stages", STAGE_RECIPE, "k3-tiny.toml", None),
               ("grid", GRID_SOURCE, "k3-tiny-1x2.toml", 1))  # the 2 x 2 in one stage
    for label, source, name, stages in recipes:
        shape = {**read_recipe(ROOT / source), **({"stages": stages} if stages else {})}
        processes = shape["stages"] * shape["ranks"]
        recipe, build = work / name, work / label
        steps.append(Step(f"build {label}", ["k3export", "build", str(recipe), "--routing-outputs", "--out",
                                             str(build)],
                          BUDGETS["build recipe"], "stages, MB", partial(recipe_numbers, build),
                          needs=("preflight",), skip=reasons(no_gpu, no_engine),
                          prepare=partial(write_recipe, source, recipe, backend_name, target, stages)))
        few = f"needs {processes} GPUs (one a process), this machine has {len(machine.gpus)}" \
            if machine.gpus and len(machine.gpus) < processes else ""
        steps.append(Step(f"run {label}", ["torchrun", "--standalone", "--nproc-per-node", str(processes),
                                           "-m", "k3export.runtime", str(build), "--runner", "engine",
                                           "--batch", str(shape["batch"]), "--max-new-tokens", "32",
                                           "--timeout", "10", "--json"],
                          BUDGETS["runtime"], "decode tokens/s", runtime_numbers, needs=(f"build {label}",),
                          skip=reasons(no_gpu, no_engine, few)))
        # A grid's check starts a process a rank; a chain of single-rank stages runs in one.
        steps.append(Step(f"check {label}", ["k3export", "check", "--build", str(build),
                                             "--prompt-len", "48", "--json"],  # within the recipes' 64
                          BUDGETS["check build"], "passed, headroom, routing flips, first divergent",
                          check_numbers, needs=(f"build {label}",),
                          skip=reasons(no_gpu, no_engine, few if shape["ranks"] > 1 else "")))
    plugins = work / "plugins"
    steps.append(Step("plugins", ["python", "tools/gpu_check.py", "--only", "plugin", "--dtypes", "bfloat16",
                                  "--no-fla", "--out", str(plugins)],
                      BUDGETS["plugins"], "rows ok of all, worst err / tol", partial(plugin_numbers, plugins),
                      skip=reasons(no_gpu, missing("plugins"))))
    return steps


def read_recipe(path: Path) -> dict[str, int]:
    recipe = tomllib.loads(path.read_text())
    return {"stages": recipe["stages"]["count"], "ranks": recipe.get("parallel", {}).get("ranks", 1),
            "batch": recipe["cache"]["batch"]}


def write_recipe(source: str, path: Path, backend: str, target: str, stages: int | None) -> None:
    """A recipe of engines/ for this machine: its [build] table's backend and target set, and [stages] count
    where `stages` is given; parsed back and compared with what was meant, so that an edit that missed
    fails the step."""
    text = (ROOT / source).read_text()
    meant = tomllib.loads(text)
    meant["build"] = {**meant.get("build", {}), "backend": backend, "target": target}
    text = re.sub(r"(?ms)^\[build\]\n.*?(?=^\[|\Z)", "", text)  # up to the next table; rewritten below
    if stages is not None:
        meant["stages"]["count"] = stages
        text = re.sub(r"(?m)^(\[stages\]\s*\ncount\s*=\s*)\d+", rf"\g<1>{stages}", text)
    text += "\n[build]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in meant["build"].items())
    if tomllib.loads(text) != meant:
        raise ValueError(f"{source}: its [stages] or [build] table is not laid out as expected: rewriting it "
                         f"for backend {backend}, target {target}" + (f", {stages} stages" if stages else ""))
    path.write_text(f"# {source} for this machine, written by tools/gpu_check --engines\n" + text)


# ---- the key numbers of each step ----

def last_json_object(stdout: str) -> dict[str, Any]:
    """The last JSON object that starts a line: check --json prints one indented, the runtime and the
    probes one line, after other lines."""
    decoder, found = json.JSONDecoder(), {}
    for match in re.finditer(r"(?m)^\{", stdout):
        try:
            value, _ = decoder.raw_decode(stdout, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            found = value
    return found


def export_numbers(folder: Path, stdout: str) -> dict[str, Any]:
    manifest = json.loads((folder / "export.json").read_text())
    return {"MB": sum(f["bytes"] for f in manifest["files"].values()) / 1e6,
            "k3 nodes": sum(manifest["custom_nodes"].values()),
            "routing outputs": len(manifest.get("routing_outputs", []))}  # listed apart from "outputs"


def engine_numbers(engine: Path, stdout: str) -> dict[str, Any]:
    record = json.loads(engine.with_name(engine.name + ".json").read_text())
    return {"MB": sum(f["bytes"] for f in record["files"].values()) / 1e6,
            "plugin layers": len(record["network"]["plugin_layers"]),
            "device MB": max(p["bytes"] for p in record["device_memory"]) / 1e6}


def check_numbers(stdout: str) -> dict[str, Any]:
    report = last_json_object(stdout)
    worst = report.get("headroom", {}).get("relative_error", {})
    numbers = {"passed": report.get("passed"), "headroom": worst.get("ratio"), "worst": worst.get("output"),
               "routing flips": report.get("routing_flips")}
    if report.get("passed") is False:
        numbers["failed outputs"] = ",".join(report.get("failed_outputs", []))
        numbers["token mismatches"] = report.get("token_mismatches")
    for key in ("first_divergent_stage", "first_divergent_rank"):
        if report.get(key) is not None:
            numbers[key.replace("_", " ")] = report[key]
    return numbers


def recipe_numbers(build: Path, stdout: str) -> dict[str, Any]:
    manifest = json.loads((build / "manifest.json").read_text())
    return {"stages": len(manifest["stages"]),
            "MB": sum(f["bytes"] for f in manifest["files"].values()) / 1e6}


def runtime_numbers(stdout: str) -> dict[str, Any]:
    summary = last_json_object(stdout)
    return {"decode tokens/s": summary.get("decode_tokens_per_second"),
            "prefill s": summary.get("prefill_seconds")}


def plugin_numbers(folder: Path, stdout: str) -> dict[str, Any]:
    report = json.loads((folder / "gpu_check.json").read_text())
    statuses = Counter(r["status"] for r in report["rows"])
    ratios = [r["err"] / report["tolerance"][r["case"]["dtype"]] for r in report["rows"]
              if r["err"] is not None]
    return {"rows": len(report["rows"]), **statuses, "worst err / tol": max(ratios, default=None)}


def shown(values: dict[str, Any]) -> str:
    def number(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    return ", ".join(f"{k} {number(v)}" for k, v in values.items() if v is not None and v != "")


# ---- running ----

def executable(argv: Sequence[str]) -> list[str]:
    """The command as this interpreter runs it (no install needed: the wrapper's PYTHONPATH)."""
    head, *rest = argv
    module = {"k3export": ["-m", "k3export.cli"], "torchrun": ["-m", "torch.distributed.run"], "python": []}
    return [sys.executable, *module[head], *rest]


def command_text(argv: Sequence[str], work: Path) -> str:
    """The command as a shell line, the work folder shown as $WORK (left unquoted, so that it expands)."""
    tokens = [t.replace(str(work), "$WORK", 1) if t.startswith(str(work)) else t for t in argv]
    return " ".join(t if t.startswith("$WORK") else shlex.quote(t) for t in tokens)


def stop_group(proc: subprocess.Popen) -> None:
    """Stops the step's process group (torchrun's workers too): SIGTERM, then SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, log: Path, work: Path) -> None:
    if step.prepare is not None:
        try:
            step.prepare()
        except (OSError, ValueError, KeyError) as exc:
            step.result = f"failed: before its command: {type(exc).__name__}: {exc}"
            return
    started = time.monotonic()
    # A session of its own, so that a step past its budget is stopped with every process it started.
    proc = subprocess.Popen(executable(step.argv), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=step.budget_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop_group(proc)
        stdout, stderr = proc.communicate()
    except BaseException:  # Ctrl-C: no step outlives the script
        stop_group(proc)
        raise
    step.seconds = time.monotonic() - started
    log.write_text(f"$ {command_text(step.argv, work)}\n(WORK={work})\n--- exit {proc.returncode}"
                   f"{' (timed out)' if timed_out else ''}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    step.log = str(log)
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    if timed_out:
        step.result = f"failed: past its budget of {step.budget_s} s (stopped)"
    elif proc.returncode != 0:
        step.result = f"failed: exit {proc.returncode}" + (f": {last[:160]}" if last else "")
    else:
        step.result = "passed"
    try:
        step.values = step.numbers(stdout)
    except (OSError, KeyError, ValueError, TypeError) as exc:  # what it should have written is not there
        if step.result == "passed":
            step.result = f"failed: its output unreadable: {type(exc).__name__}: {exc}"


def run_steps(steps: list[Step], budget: float, logs: Path, work: Path) -> None:
    start = time.monotonic()
    by_name = {s.name: s for s in steps}
    for index, step in enumerate(steps):
        left = budget - (time.monotonic() - start)
        unmet = [by_name[n] for n in step.needs if by_name[n].result != "passed"]
        if step.skip:
            step.result = f"skipped: {step.skip}"
        elif unmet:
            happened = "failed" if unmet[0].result.startswith("failed") else "did not run"
            step.result = f"skipped: needs {unmet[0].name}, which {happened}"
        elif step.budget_s > left:
            step.result = f"skipped: time budget ({left:.0f} s of --budget {budget:.0f} left, it needs " \
                          f"{step.budget_s} s)"
        else:
            run_step(step, logs / f"{index:02d}-{step.name.replace(' ', '-')}.log", work)
        ran = f" ({step.seconds:.1f} s) {shown(step.values)}" if step.seconds is not None else ""
        print(f"[{time.monotonic() - start:6.1f}s] {step.name}: {step.result}{ran}", flush=True)


# ---- the table ----

COLUMNS = ("step", "command", "result", "s", "key numbers")


def table(rows: list[tuple[str, ...]]) -> list[str]:
    """A markdown table (a pipe in a cell, from a command's message, escaped)."""
    cells = [COLUMNS, ("---",) * len(COLUMNS), *([c.replace("|", "\\|") for c in row] for row in rows)]
    return [f"| {' | '.join(row)} |" for row in cells]


def planned_rows(steps: list[Step], work: Path) -> list[tuple[str, ...]]:
    """The plan's rows: a step would run unless this machine cannot run it or a step it reads would not."""
    planned: dict[str, str] = {}
    for s in steps:
        blocked = next((n for n in s.needs if planned[n] != "would run"), None)
        planned[s.name] = f"skipped: {s.skip}" if s.skip else \
            f"skipped: needs {blocked}, which would not run" if blocked else "would run"
    return [(s.name, command_text(s.argv, work), planned[s.name], f"{s.budget_s}", s.reads) for s in steps]


def result_rows(steps: list[Step], work: Path) -> list[tuple[str, ...]]:
    return [(s.name, command_text(s.argv, work), s.result,
             f"{s.seconds:.1f}" if s.seconds is not None else "-", shown(s.values) or "-") for s in steps]


def print_plan(machine: Machine, steps: list[Step], work: Path | None, budget: float) -> None:
    print("tools/gpu_check --engines, planned on this machine (--dry-run: nothing runs)")
    print(machine.line())
    if not machine.gpus:
        print("without a GPU a run stops before its first step (exit 2)")
    print(f"work folder ($WORK): {work or 'a new temporary folder (--work DIR)'}; step budgets add up to "
          f"{sum(s.budget_s for s in steps)} s; --budget {budget:.0f} s; the table's s: each step's budget")
    print(f"recipes written when their builds start: $WORK/k3-tiny.toml ({STAGE_RECIPE}) and "
          f"$WORK/k3-tiny-1x2.toml ({GRID_SOURCE} in 1 stage), [build] backend and target this machine's")
    print("\n".join(table(planned_rows(steps, work or Path("$WORK")))))


def write_out(out: Path, text: str, machine: Machine, steps: list[Step], work: Path, elapsed: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_engines.txt").write_text(text + "\n")
    rows = [{"step": s.name, "command": command_text(s.argv, work), "argv": s.argv, "budget_s": s.budget_s,
             "result": s.result, "seconds": s.seconds, "numbers": s.values, "log": s.log} for s in steps]
    (out / "gpu_engines.json").write_text(json.dumps(
        {"machine": machine.line(), "gpus": machine.gpus, "backend": machine.backend, "work": str(work),
         "elapsed_s": elapsed, "steps": rows}, indent=1))


# ---- the probes (steps 2 and 3, each in its own process) ----

def probe_preflight(backend: str, target: str, work: Path) -> dict[str, Any]:
    """Step 1: what TensorRT 11 would refuse on the first run on this host, each fault named (a
    RuntimeError saying which check failed), within a minute:
    1. the plugins registered twice in one process, as its flavour registers them (a build of a recipe's
       stages, or a check of a chain, builds or loads several engines in one process);
    2. every dtype a k3 plugin's inputs and outputs take (the definitions' type groups) is in the flavour's
       dtype table, and (full TensorRT) in its AOT autotune combinations;
    3. (full TensorRT) the dynamic shared memory of each AOT kernel at the published widths in bfloat16,
       against this GPU's per-block opt-in limit; those over the 48 KB a launch gets without raising its
       limit are listed;
    4. a 2-layer k3-tiny (a KDA and an MLA layer, routed experts packed MXFP4 from a written checkpoint,
       float16, routing outputs, AOT plugins) exported, built for this GPU, loaded by the engine runner
       (its tensors, dtypes and in-place pairs as the engine reports them, held to the export's plan),
       then one prefill and one decode call with every tensor bound;
    5. a KDA and an MLA layer at the published widths (`published_pair`: 96 KDA heads of 128, 96 MLA heads,
       latent 576, values 512; the rest small), bfloat16, AOT plugins, exported with seeded weights, built
       and called as in 4., its logits finite: the k3 plugins' launches as the published model makes them
       (the LatentMLA split and combine kernels among them, 37,376 B of shared memory at most)."""
    import importlib

    import numpy as np
    import torch

    from k3export.cli import main as k3export_main
    from k3export.engine.flavours import FLAVOURS, load_tensorrt, register_plugins
    from k3export.model import K3ForCausalLM
    from k3export.weights.published import write_published
    from k3plugins.definitions import DEFINITIONS

    def fault(check: str, why: str) -> RuntimeError:
        return RuntimeError(f"preflight: {check}: {why}")

    def built(export_argv: list[str], export: Path) -> Path:
        """The export of `export_argv` into `export`, and its engine for this GPU beside it."""
        engine = export.with_suffix(".engine")
        for argv in ([*export_argv, "--aot-plugins", "--quiet", "--out", str(export)],
                     ["build", "--onnx", str(export), "--backend", backend, "--target", target, "--out",
                      str(engine)]):
            if k3export_main(argv) != 0:
                raise fault(f"k3export {argv[0]} {export.name}", "failed (its message is above)")
        return engine

    trt = load_tensorrt(backend)
    plugins = importlib.import_module(FLAVOURS[backend].plugins)
    try:
        register_plugins(trt)
        register_plugins(trt)
    except Exception as e:
        raise fault("plugins registered twice in one process", f"{type(e).__name__}: {e}") from e
    table = set(plugins._dtype_names(trt).values())
    dtypes = {d for definition in DEFINITIONS for types in definition.groups.values() for d in types}
    if dtypes - table:
        raise fault("dtype tables", f"{sorted(dtypes - table)} not in {FLAVOURS[backend].plugins}'s table")
    numbers: dict[str, Any] = {"registrations": 2, "dtypes": ",".join(sorted(dtypes))}
    if backend == "tensorrt":
        for definition in DEFINITIONS:
            try:
                plugins.type_combinations(definition, aot=True)
            except KeyError as e:
                raise fault("AOT autotune combinations", f"{definition.name}: no code for {e}") from e
        published = K3Config.from_preset("kimi-k3")
        held = published.num_experts // 8  # one rank of the published 8-way expert split
        shared = {name: n for name, n in plugins.shared_memory(published, held, target).items()
                  if "bf16" in name}
        limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
        over = [name for name, n in shared.items() if n > limit]
        if over:
            raise fault("shared memory", f"{over[0]} asks {shared[over[0]]} B, over this GPU's {limit} B a "
                        "block")
        numbers.update({"smem KB": max(shared.values()) / 1024, "over 48 KB": ",".join(
            name for name, n in shared.items() if n > 48 * 1024) or "none"})

    work.mkdir(parents=True, exist_ok=True)
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny"), torch.float32).eval()
    model.init_weights(0)
    write_published(model, work / "checkpoint", experts="mxfp4")
    export = work / "export"
    engine = built(["export", "--checkpoint", str(work / "checkpoint"), "--layers", "2:4", "--packed-experts",
                    "--dtype", "float16", "--routing-outputs"], export)
    plan, _ = called(engine, export)
    numbers.update({"aliases": ",".join(sorted({n.rsplit(".", 1)[-1] for n in plan.in_place})),
                    "swapped": ",".join(sorted({n.rsplit(".", 1)[-1] for n in plan.swapped})),
                    "tensors bound": len(plan.feeds) + len(plan.caches) + len(plan.outputs)})

    published_pair().to_json(work / "published.json")
    export = work / "published"
    engine = built(["export", "--config", str(work / "published.json"), "--seed", "0", "--layers", "2:4",
                    "--dtype", "bfloat16"], export)
    plan, outputs = called(engine, export)
    if not np.isfinite(outputs["logits"]).all():
        raise fault("the published widths' layer pair", "its logits are not finite")
    return {**numbers, "published aliases": ",".join(sorted({n.rsplit(".", 1)[-1] for n in plan.in_place})),
            "published tensors bound": len(plan.feeds) + len(plan.caches) + len(plan.outputs)}


def published_pair() -> K3Config:
    """kimi-k3's first 4 layers, whose layers 2 and 3 are a KDA and an MLA layer, at the published mixer
    widths (96 KDA heads of 128; 96 MLA heads, latent 576 = 512 + 64, values 512) and everything else
    small (vocabulary, hidden size, query rank, FFNs, 8 experts): the k3 plugins see the published model's
    shapes, TensorRT's own projections and the export stay small."""
    data = K3Config.from_preset("kimi-k3").first_layers(4).to_dict()
    data.update(vocab_size=256, hidden_size=256, q_lora_rank=256, intermediate_size=256,
                moe_intermediate_size=256, routed_expert_hidden_size=256, num_experts=8,
                num_experts_per_token=2, num_shared_experts=1)
    return K3Config.from_dict(data)


def called(engine: Path, export: Path) -> tuple[Any, dict[str, Any]]:
    """`engine` loaded by the engine runner (activation holds its tensors to the export's plan:
    k3export.engine.runner.engine_bindings) and called twice, a prefill and a decode, the stage's boundary
    at random; each call checks every binding and TensorRT's answers (enqueue) and reads every output
    back. Returns the plan the runner bound and the decode call's outputs."""
    import numpy as np

    from k3export.engine.runner import EngineRunner
    from k3export.onnx.export import resolve_shape

    random = np.random.default_rng(0)
    with EngineRunner(engine, export) as runner:
        runner.reset(2)
        for seq, cached in ((5, 0), (1, 5)):
            sizes = {"batch": 2, "seq": seq, "capacity": runner.signature.capacity}
            # float32 whatever the engine's dtype (numpy has no bfloat16): the runner copies a feed into it.
            feeds = {s.name: random.standard_normal(resolve_shape(s, sizes)).astype(np.float32)
                     for s in runner.plan.feeds if s.dtype != "int64"}
            outputs = runner.infer({**feeds, "cache_lengths": np.full(2, cached),
                                    "input_lengths": np.full(2, seq)}, check_inputs=False)
        return runner.plan, outputs


def probe_caches(export: Path) -> dict[str, Any]:
    import torch

    from k3export.engine.runner import binding_plan, device_caches
    from k3export.onnx.export import MANIFEST_FILE

    # The engine runner's own allocation, from its binding plan (no engine, so no profiles).
    capacity = json.loads((export / MANIFEST_FILE).read_text())["capacity"]
    caches = device_caches(binding_plan(export, []).caches, PROBE_BATCH, capacity, torch.device("cuda", 0))
    for cache in caches.values():
        cache.fill_(1)
    torch.cuda.synchronize()
    wrong = [n for n, c in caches.items() if not bool((c == 1).all())]
    if wrong:
        raise RuntimeError(f"caches not read back as written: {wrong}")
    return {"caches": len(caches), "MB": sum(c.nbytes for c in caches.values()) / 1e6,
            "dtypes": ",".join(sorted({str(c.dtype).removeprefix("torch.") for c in caches.values()})),
            "gpu": torch.cuda.get_device_name()}


def probe_communicator() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from k3export.runtime.nccl import communicator_capsule

    with socket.socket() as s:  # a free port for the one-process group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        capsule = communicator_capsule(dist.group.WORLD)
        if type(capsule).__name__ != "PyCapsule":
            raise TypeError(f"communicator_capsule gave a {type(capsule).__name__}, not a PyCapsule")
        ones = torch.ones(4, device="cuda")
        dist.all_reduce(ones)  # the group still works after its communicator was handed out
        torch.cuda.synchronize()
        if ones.tolist() != [1.0] * 4:
            raise RuntimeError(f"all_reduce over one rank gave {ones.tolist()}")
    finally:
        dist.destroy_process_group()
    return {"capsule": "PyCapsule", "NCCL": ".".join(map(str, torch.cuda.nccl.version()))}


# ---- main ----

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tools/gpu_check --engines", description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="print the planned steps and table on this machine and exit 0; no GPU needed")
    p.add_argument("--budget", type=float, default=float(TOTAL_BUDGET_S),
                   help="seconds in all: a step whose budget no longer fits is skipped (default %(default)s)")
    p.add_argument("--work", type=Path, help="the work folder (default: a new temporary one)")
    p.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                   help="folder for gpu_engines.txt, gpu_engines.json and the logs (default $OUT)")
    p.add_argument("--probe", choices=PROBES, help="run one probe (the caches and communicator steps run "
                   "this file so, each in its own process) and print its numbers as JSON")
    p.add_argument("--backend", choices=sorted(FLAVOURS), help="with --probe preflight: the TensorRT flavour")
    p.add_argument("--target", help="with --probe preflight: the GPU's compute capability (sm90, ...)")
    p.add_argument("folder", nargs="?", type=Path,
                   help="with --probe caches: the export folder; with --probe preflight: its work folder")
    args = p.parse_args(argv)
    if (args.probe in ("caches", "preflight")) != (args.folder is not None):
        p.error("a folder goes with --probe caches and --probe preflight, and only with them")
    if (args.probe == "preflight") != (args.backend is not None and args.target is not None):
        p.error("--backend and --target go with --probe preflight, and only with it")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        numbers = (probe_preflight(args.backend, args.target, args.folder) if args.probe == "preflight" else
                   probe_caches(args.folder) if args.probe == "caches" else probe_communicator())
        print(json.dumps(numbers))
        return 0
    if not args.dry_run and not gpu_targets():
        print("tools/gpu_check --engines: no GPU (nvidia-smi finds none): nothing to run here "
              "(--dry-run prints the plan)", file=sys.stderr)
        return 2
    machine = survey()
    if args.dry_run:
        print_plan(machine, plan(machine, args.work or Path("$WORK")), args.work, args.budget)
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="k3-gpu-engines-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = (args.out or work) / "gpu_engines_logs"
    logs.mkdir(parents=True, exist_ok=True)
    steps = plan(machine, work)
    print(machine.line(), flush=True)
    print(f"work folder ($WORK): {work}; logs: {logs}; --budget {args.budget:.0f} s", flush=True)
    start = time.monotonic()
    run_steps(steps, args.budget, logs, work)
    elapsed = time.monotonic() - start
    failed = [s for s in steps if s.result.startswith("failed")]
    # Log tails first, the table last: the device tool returns the end of the output.
    lines = []
    for s in failed:
        tail = Path(s.log).read_text().splitlines()[-15:] if s.log else []
        lines += [f"--- {s.name}: {s.result} (log {s.log})", *tail]
    counts = Counter(s.result.split(":")[0] for s in steps)
    lines += [machine.line(), f"work folder ($WORK): {work}", *table(result_rows(steps, work)),
              f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; "
              f"elapsed {elapsed:.0f} s of --budget {args.budget:.0f}"]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        write_out(args.out, text, machine, steps, work, elapsed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
