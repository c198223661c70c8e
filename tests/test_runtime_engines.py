"""The runtime up to the GPU boundary (issue 27): the runner a build's stages get (`--runner`) and its
refusals before any process group or session, the GPU of each process (LOCAL_RANK), the capsule that
hands a stage's NCCL communicator to TensorRT, and the watchdog that ends a process blocked on a
peer (gloo standing in for NCCL). No engine runs here: a build "with engines" is a manifest listing
engine files that nothing reads."""

from __future__ import annotations

import ctypes
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch import torchrun_command

import k3export.runtime
from k3export.artifacts import file_record, write_json
from k3export.cli import main
from k3export.errors import UserError
from k3export.runtime import __main__ as runtime
from k3export.runtime.engines import ENGINE, ONNX, choose_runner, device_of
from k3export.runtime.faults import engine_waits
from k3export.runtime.nccl import abort, pointer_capsule
from k3export.runtime.watchdog import Watchdog

WATCHDOG_WORKER = Path(__file__).with_name("watchdog_worker.py")


def fake_build(folder: Path, stages: int = 2, ranks: int = 1, engines: bool = True) -> Path:
    """A build folder whose manifest lists, per stage (per rank of a split stage), an export.json and,
    with `engines`, an engine file (bytes that are no engine: the runner choice reads only the
    manifest, and its refusals come before anything loads)."""
    entries, files = [], {}
    for s in range(stages):
        places = []
        for r in range(ranks):
            name = f"stage-{s}" if ranks == 1 else f"stage-{s}/rank-{r}"
            (folder / name).mkdir(parents=True)
            (folder / name / "export.json").write_text(json.dumps(
                {"parallel": {"rank": r, "ranks": ranks}, "layers": [s, s + 1]}))
            engine = f"{name}/{name.replace('/', '.')}.sm90.engine" if engines else None
            if engine:
                (folder / engine).write_bytes(b"not an engine")
            files.update({f: file_record(folder / f) for f in (f"{name}/export.json", engine) if f})
            places.append({"stage": s, "rank": r, "folder": name, "engine": engine})
        entry = {"index": s, "layers": [s, s + 1], "folder": f"stage-{s}", "engine": places[0]["engine"],
                 "files": {f: rec for f, rec in files.items() if f.startswith(f"stage-{s}/")}}
        if ranks > 1:
            entry.update(engine=None, ranks=places)
        entries.append(entry)
    write_json(folder / "manifest.json", {"recipe_file": "engines/k3-tiny.toml", "backend":
                                          "tensorrt" if engines else "onnx", "settings": {},
                                          "stages": entries, "files": files})
    return folder


@pytest.fixture
def no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before any process group or session: making one fails the test."""
    def forbidden(*_, **__) -> None:
        raise AssertionError("a process group or session was made before the refusal")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(k3export.runtime, "Pipeline", forbidden)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as it is (no GPU), also where a test runs on one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_default_runner_follows_the_builds_engines(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """No engines: onnx, saying why; engines for every stage (every rank): engine, its files per
    stage and rank, once the machine check passed (here a stand-in: nothing runs); --runner onnx on an
    engine build: onnx."""
    plain = fake_build(tmp_path / "plain", engines=False)
    choice = choose_runner(plain, None)
    assert (choice.kind, choice.engines) == (ONNX, [])
    assert choice.line() == ("runner: onnx (the build holds no TensorRT engine for stage 0: its ONNX graphs "
                             "in ONNX Runtime on CPU)")
    checked = []
    monkeypatch.setattr("k3export.engine.runner.require_engine_runtime", checked.append)
    grid = fake_build(tmp_path / "grid", ranks=2)
    choice = choose_runner(grid, None)
    assert checked == ["the runtime's --runner engine"]
    assert choice.kind == ENGINE and choice.line() == (
        "runner: engine (the build holds TensorRT engines; --runner onnx runs its ONNX graphs on CPU)")
    assert choice.engines == [[grid / f"stage-{s}/rank-{r}/stage-{s}.rank-{r}.sm90.engine" for r in range(2)]
                              for s in range(2)]
    # Only the last stage reads anything back to the host (its logits); each rank its own engine.
    assert choice.place(1, 1, 3).host_outputs == {"logits"} and choice.place(0, 1, 1).host_outputs == set()
    assert choice.place(0, 1, 1).path == choice.engines[0][1]
    asked = choose_runner(grid, "onnx")
    assert asked.line() == "runner: onnx (--runner onnx: its ONNX graphs in ONNX Runtime on CPU)"


@pytest.mark.usefixtures("no_process_group")
def test_runner_engine_on_a_build_without_engines_is_refused(tmp_path: Path, capsys) -> None:
    """Named: the build's manifest, the stage (and rank) without an engine, how to build engines."""
    build = fake_build(tmp_path / "plain", engines=False)
    expected = (f"--runner engine: {build / 'manifest.json'} records no TensorRT engine for stage 0 (built "
                f"with backend 'onnx'); build its engines with `k3export build engines/k3-tiny.toml "
                f"--backend tensorrt-rtx --out {build}`")
    assert main(["run", str(build), "--runner", "engine"]) == 2
    assert expected in capsys.readouterr().err
    assert runtime.main([str(build), "--runner", "engine"]) == 2
    assert expected in capsys.readouterr().err
    grid = fake_build(tmp_path / "grid", ranks=2)  # one rank's engine missing: no default engine run
    manifest = json.loads((grid / "manifest.json").read_text())
    manifest["stages"][1]["ranks"][0]["engine"] = None
    write_json(grid / "manifest.json", manifest)
    with pytest.raises(UserError, match="no TensorRT engine for stage 1 rank 0"):
        choose_runner(grid, "engine")
    assert choose_runner(grid, None).line().startswith("runner: onnx (the build holds no TensorRT engine for "
                                                       "stage 1 rank 0")


@pytest.mark.usefixtures("no_process_group", "no_gpu")
@pytest.mark.parametrize("runner", [[], ["--runner", "engine"]], ids=["default", "--runner engine"])
def test_engines_without_a_gpu_are_refused_before_any_process_group(tmp_path: Path, runner: list[str],
                                                                    capsys) -> None:
    """`k3export run` and `torchrun -m k3export.runtime` on a build with engines, by default or asked:
    exit 2 naming what is missing and --runner onnx, before any process group or session."""
    build = fake_build(tmp_path / "engines")
    for command in (lambda: main(["run", str(build), *runner]), lambda: runtime.main([str(build), *runner])):
        assert command() == 2
        err = capsys.readouterr().err
        assert "the runtime's --runner engine" in err and "GPU" in err, err
        assert err.strip().endswith("--runner onnx runs the build's ONNX graphs on CPU"), err
        assert ("which the runtime runs by default" in err) == (not runner)


def test_each_process_runs_on_its_hosts_local_rank() -> None:
    """torchrun's environment of 2 stages x 2 ranks (process p: stage p // 2, rank p % 2): on one
    host of 4 GPUs the four processes take four GPUs (the manifest's old "gpu": rank put both stages'
    rank r on GPU r); on two hosts of 2 each host's processes take its GPUs 0 and 1. Too few GPUs, or
    a LOCAL_RANK that is not one, is refused naming LOCAL_RANK and the count."""
    one_host = [device_of({"RANK": str(p), "LOCAL_RANK": str(p)}, 4) for p in range(4)]
    assert one_host == [0, 1, 2, 3]
    two_hosts = [device_of({"RANK": str(p), "LOCAL_RANK": str(p % 2)}, 2) for p in range(4)]
    assert two_hosts == [0, 1, 0, 1]
    assert device_of({}, 1) == 0  # `k3export run`: one process, no torchrun
    refusal = ("LOCAL_RANK = 2: this host has 2 GPUs (torch.cuda.device_count()) and each process runs its "
               "engine on GPU LOCAL_RANK: start at most 2 processes on it")
    with pytest.raises(UserError, match=re.escape(refusal)):
        device_of({"LOCAL_RANK": "2"}, 2)
    with pytest.raises(UserError, match="LOCAL_RANK = 'x': expected torchrun's index"):
        device_of({"LOCAL_RANK": "x"}, 2)


def test_a_communicator_pointer_travels_in_a_capsule() -> None:
    """The capsule TensorRT's set_communicator reads: the pointer back (PyCapsule_GetPointer), no name;
    a null pointer (a group without a communicator) is refused."""
    get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))
    get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
    for pointer in (0x7F3A_1234_5678, 2**64 - 16):
        capsule = pointer_capsule(pointer)
        assert type(capsule).__name__ == "PyCapsule"
        assert get_pointer(capsule, None) == pointer and get_name(capsule) is None
    with pytest.raises(ValueError, match="null pointer"):
        pointer_capsule(0)


def test_what_an_engine_call_waits_for_is_named() -> None:
    assert engine_waits(3, 2) == ("its engine's call (its sums with stage 1 rank 0 (process 2); the boundary "
                                  "from stage 0 rank 1 (process 1))")
    assert engine_waits(1, 1) == "its engine's call (the boundary from stage 0 (rank 0))"
    assert engine_waits(0, 1) == "its engine's call"


def test_the_abort_hook_runs_once() -> None:
    """The watchdog's deadline and a control-plane failure may both end a process: one abort."""
    calls = []
    watchdog = Watchdog("stage 0 (rank 0)", 60, lambda: calls.append(1))
    watchdog.abort()
    watchdog.abort()
    assert calls == [1]


def test_the_abort_skips_the_groups_this_process_is_not_in() -> None:
    """Every process makes every stage's group; for the stages it is not in, torch gives it
    NON_GROUP_MEMBER (-100), which has no abort: the others' communicators are still aborted."""
    aborted = []

    class Group:
        def abort(self) -> None:
            aborted.append(self)

    own, data = Group(), Group()
    abort([dist.GroupMember.NON_GROUP_MEMBER, own, dist.GroupMember.NON_GROUP_MEMBER, data])
    assert aborted == [own, data]


def test_the_watchdog_ends_a_process_blocked_on_a_silent_peer(tmp_path: Path) -> None:
    """tests/watchdog_worker.py under torchrun: a guarded wait that ends in time (then 2.5 s outside any
    wait) leaves the process alone; a gloo wait with no deadline of its own on a peer that stays silent
    ends it: its message names it and what it waited for, the abort hook ran once and hung, and the
    process is gone (its peer sees the link close) within the timeout (2 s) plus the abort's wait (1 s),
    not before it, and not later than a small slack after it."""
    aborts = tmp_path / "aborts"
    proc = subprocess.run(torchrun_command(2, str(WATCHDOG_WORKER), str(aborts)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "first message: 1.0" in proc.stdout and "answered" not in proc.stdout, proc.stdout
    began = float(re.search(r"second wait from ([\d.]+)", proc.stdout)[1])
    gone = float(re.search(r"process 0 gone at ([\d.]+)", proc.stdout)[1])
    assert 2 + 1 <= gone - began < 2 + 1 + 1, proc.stdout
    assert ("k3export.runtime: stage 0 (rank 0): waited 2 s (--timeout) for the boundary from stage 1 "
            "(rank 1): a process it waits for died or hangs; aborting the NCCL communicators\n"
            "k3export.runtime: stage 0 (rank 0): the abort of the NCCL communicators did not return within "
            "1 s; exiting without it\n") in proc.stderr
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*exitcode\s*: 1\b", proc.stderr), proc.stderr[-3000:]
    assert aborts.read_text() == "aborted\n"
