"""Sharded builds of engines/k3-tiny.toml: stage graphs that chain by name, dtype and shape (read
from the ONNX files), resume after an interruption, files held to the manifest by sha256, the
TensorRT-RTX build with one engine per stage, and the sharded runtime (in-process and 2 processes
over gloo) against one ONNX Runtime session and the eager model; the 3-stage build carries taps,
which the runtime ignores and check --build --taps compares per layer."""

import dataclasses
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import launch
import numpy as np
import onnx
import pytest
import torch
import torch.distributed as dist
from reference import assert_eager_ran, without_headroom

from k3export.artifacts import file_record, verify
from k3export.check.compare import TOLERANCES, top1_agreement
from k3export.check.driver import valid_entries
from k3export.check.runners.chain import prefix_feeds, run_build_check
from k3export.check.runners.eager import EagerRunner, EagerSide
from k3export.cli import main
from k3export.errors import UserError
from k3export.onnx.export import ExportGraph
from k3export.onnx.runner import Signature
from k3export.onnx.taps import SUBLAYERS, tap_names
from k3export.runtime import (
    Generation,
    Pipeline,
    Sampler,
    Stage,
    generate,
    random_prompts,
    stage_exports,
    stage_ranks,
)
from k3export.runtime.faults import SILENCE_SECONDS, FaultBoard, process_name
from k3export.runtime.schedule import default_micro_batches, last_positions, split_rows
from k3export.shards.recipe import load_recipe
from k3export.shards.stages import MANIFEST, _previous, build_recipe

TINY = Path(__file__).resolve().parents[1] / "engines/k3-tiny.toml"


class Interrupted(Exception):
    """Raised by the test hook after the first stage: a build stopped part way."""


def count_calls(mp: pytest.MonkeyPatch) -> dict[str, list[range]]:
    """Records the layer range of every stage export and engine build (exports are byte-identical,
    so hashes cannot tell a rebuilt stage from a skipped one)."""
    import k3export.engine.build as engine
    import k3export.onnx.export as export

    calls: dict[str, list[range]] = {"export": [], "engine": []}
    real_export, real_engine = export.export_model, engine.build_engine

    def export_model(model, out_dir, layers, *args, **kwargs):
        calls["export"].append(layers)
        return real_export(model, out_dir, layers, *args, **kwargs)

    def build_engine(export_dir, out, trt, **kwargs):
        calls["engine"].append(Path(export_dir))
        return real_engine(export_dir, out, trt, **kwargs)

    mp.setattr(export, "export_model", export_model)
    mp.setattr(engine, "build_engine", build_engine)
    return calls


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


@pytest.fixture(scope="session")
def onnx_build(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """engines/k3-tiny.toml in 3 stages with the onnx backend and taps (build --taps), built as a
    user would live through it: stopped after its first stage, rerun (resume), then one file altered
    and rerun (that stage rebuilt)."""
    out = tmp_path_factory.mktemp("shards") / "tiny"
    recipe = dataclasses.replace(load_recipe(TINY), stage_count=3)
    runs: dict[str, Any] = {}

    def stop_after_first(index: int) -> None:
        if index == 0:
            raise Interrupted

    with pytest.MonkeyPatch.context() as mp:
        calls = count_calls(mp)
        with pytest.raises(Interrupted):
            build_recipe(recipe, out, backend="onnx", taps=True, after_stage=stop_after_first,
                         log=lambda _: None)
        runs["interrupted"] = list(calls["export"])
        calls["export"].clear()
        manifest = build_recipe(recipe, out, backend="onnx", taps=True, log=lambda _: None)
        runs["resumed"] = list(calls["export"])
        calls["export"].clear()
        flip_byte(out / "stage-1/model.onnx.data")
        with pytest.raises(UserError) as refused:
            verify(out, MANIFEST, full=True)
        runs["refused"] = str(refused.value)
        build_recipe(recipe, out, backend="onnx", taps=True, log=lambda _: None)
        runs["rebuilt"] = list(calls["export"])
    runs["ranges"] = [range(*s["layers"]) for s in manifest["stages"]]
    return out, runs


def test_resume_skips_finished_stages(onnx_build) -> None:
    _, runs = onnx_build
    first, *rest = runs["ranges"]
    assert runs["interrupted"] == [first]
    assert runs["resumed"] == rest  # stage 0 was not exported again


def test_taps_are_a_build_setting(onnx_build) -> None:
    """A resume without taps reuses no tapped stage (and the reverse): taps are one of the settings."""
    out, _ = onnx_build
    settings = json.loads((out / MANIFEST).read_text())["settings"]
    assert settings["taps"] is True and len(_previous(out, settings)) == 3
    assert _previous(out, {**settings, "taps": False}) == []


def test_altered_file_refused_and_its_stage_rebuilt(onnx_build) -> None:
    out, runs = onnx_build
    assert "stage-1/model.onnx.data" in runs["refused"] and "sha256" in runs["refused"]
    assert runs["rebuilt"] == [runs["ranges"][1]]
    verify(out, MANIFEST, full=True)  # whole again


def graph_io(path: Path) -> tuple[dict, dict]:
    """name -> (element type, dims) of the graph's inputs and outputs, as the file declares them."""
    model = onnx.load(path, load_external_data=False)

    def spec(value: onnx.ValueInfoProto) -> tuple[int, list[int | str]]:
        tensor = value.type.tensor_type
        return tensor.elem_type, [d.dim_param or d.dim_value for d in tensor.shape.dim]

    return ({v.name: spec(v) for v in model.graph.input}, {v.name: spec(v) for v in model.graph.output})


def test_stage_outputs_are_next_stage_inputs(onnx_build) -> None:
    out, runs = onnx_build
    files = [graph_io(out / f"stage-{i}/model.onnx") for i in range(len(runs["ranges"]))]
    assert "input_ids" in files[0][0] and "logits" in files[-1][1]
    for (_, outputs), layers in zip(files, runs["ranges"], strict=True):
        # Taps by the model's layer indices, after every other output; nothing reads them on.
        assert [n for n in outputs if n.startswith("taps.")] == list(outputs)[-3 * len(layers):] == \
            tap_names(layers)
    for (inputs_a, outputs_a), (inputs_b, _) in itertools.pairwise(files):
        sent = {n: s for n, s in outputs_a.items() if not n.startswith(("present.", "taps."))}
        # What the next stage takes beyond its own caches and the per-row inputs every stage takes.
        received = {n: s for n, s in inputs_b.items() if not n.startswith("past.") and n not in inputs_a}
        assert sent and sent == received
    assert [i for r in runs["ranges"] for i in r] == list(range(load_recipe(TINY).config.num_hidden_layers))


def test_refuses_a_folder_of_user_files(tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["build", str(TINY), "--out", str(tmp_path), "--backend", "onnx"]) == 2
    assert "notes.txt" in capsys.readouterr().err and (tmp_path / "notes.txt").read_text() == "mine"
    assert main(["build", str(TINY), "--out", str(tmp_path / "new"), "--stage", "7"]) == 2


@pytest.fixture(scope="session")
def rtx_build(tmp_path_factory) -> tuple[Path, dict[str, Any], dict[str, list]]:
    """engines/k3-tiny.toml as it is: 2 stages, TensorRT-RTX for sm89."""
    if importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.skip("tensorrt_rtx is not installed")
    out = tmp_path_factory.mktemp("shards") / "tiny-rtx"
    with pytest.MonkeyPatch.context() as mp:
        calls = count_calls(mp)
        manifest = build_recipe(load_recipe(TINY), out, log=lambda _: None)
    return out, manifest, calls


def test_tensorrt_rtx_build(rtx_build, tmp_path: Path) -> None:
    out, manifest, calls = rtx_build
    assert manifest["backend"] == "tensorrt-rtx" and len(calls["engine"]) == load_recipe(TINY).stage_count
    engines = [s["engine"] for s in manifest["stages"]]
    assert all((out / e).is_file() and (out / e).stat().st_size and e in manifest["files"] for e in engines)
    verify(out, MANIFEST, full=True)
    altered = tmp_path / "altered"
    shutil.copytree(out, altered)
    flip_byte(altered / engines[0])
    with pytest.raises(UserError, match="sha256"):
        verify(altered, MANIFEST, full=True)


@pytest.fixture(params=["3 stages, onnx", "2 stages, tensorrt-rtx"])
def sharded(request) -> Path:
    """A built k3-tiny folder: 3 onnx stages, or the recipe's 2 (their exports run in ONNX Runtime)."""
    return request.getfixturevalue("onnx_build" if request.param.endswith("onnx") else "rtx_build")[0]


def teacher_forced(run: Any, prompts: list[list[int]], steps: int, tokens: list[np.ndarray] | None
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Valid logits of a prefill and `steps` decode steps, each row fed `tokens` (the reference's
    greedy choices) or, without them, its own; returns (logits per call, tokens fed)."""
    lengths = np.array([len(p) for p in prompts])
    ids = np.zeros((len(prompts), lengths.max()), np.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    request = {"input_ids": ids, "cache_lengths": np.zeros(len(prompts), np.int64), "input_lengths": lengths}
    logits, fed = [], []
    for step in range(steps + 1):
        out = run(request)["logits"]
        logits.append(np.concatenate([out[b, :n] for b, n in enumerate(request["input_lengths"])]))
        chosen = tokens[step] if tokens else last_positions(out, request["input_lengths"]).argmax(-1)
        fed.append(chosen)
        request = {"input_ids": chosen[:, None].astype(np.int64),
                   "cache_lengths": request["cache_lengths"] + request["input_lengths"],
                   "input_lengths": np.ones(len(prompts), np.int64)}
    return logits, fed


def relative(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - ref) / np.linalg.norm(ref.astype(np.float64)))


def test_sharded_run_matches_unsharded_and_eager(sharded: Path, tiny_export: Path, tiny_model) -> None:
    """Prompts of 20 and 10 tokens, then 16 greedy decode steps, every side fed the unsharded run's
    tokens: the chain of stages within 1e-5 of one ONNX Runtime session and within float32's bound
    (1e-4) of the eager model, with the same greedy tokens wherever the top-1 margin is decisive."""
    out = sharded
    prompts = random_prompts(2, 20, 256, seed=1)
    assert [len(p) for p in prompts] == [20, 10]  # right-padding in the prefill
    whole = Pipeline([tiny_export])
    whole.reset(2)
    reference, tokens = teacher_forced(whole, prompts, 16, None)
    sharded = Pipeline(stage_exports(out))
    sharded.reset(2)
    chained, _ = teacher_forced(sharded, prompts, 16, tokens)
    signature = Signature(json.loads((tiny_export / "export.json").read_text()))
    with EagerRunner(ExportGraph(tiny_model, range(9)), "eager", signature) as eager:
        eager.reset(2)
        eager_logits, _ = teacher_forced(lambda r: eager.infer(r, check_inputs=False), prompts, 16, tokens)
    for ours, ref, ref_eager in zip(chained, reference, eager_logits, strict=True):
        assert relative(ours, ref) <= 1e-5
        assert relative(ours, ref_eager) <= TOLERANCES["float32"].rel
        assert top1_agreement(ours, ref_eager, TOLERANCES["float32"].margin).mismatches == 0
    whole.close()
    sharded.close()


def torchrun(build: Path, *options: str, timeout: float = 300) -> dict[str, Any]:
    """`torchrun -m k3export.runtime BUILD OPTIONS --json`, one process a stage: its summary."""
    proc = launch.succeeded(launch.torchrun(len(stage_exports(build)), "-m", "k3export.runtime", str(build),
                                            *options, "--json", timeout=timeout))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def torchrun_command(build: Path, *options: str, monitor_interval: float = 0.1) -> list[str]:
    """torchrun polls its processes every `monitor_interval` seconds (0.1, its default)."""
    return launch.torchrun_command(len(stage_exports(build)), "-m", "k3export.runtime", str(build), *options,
                                   monitor_interval=monitor_interval)


def in_process(build: Path, prompts: list[list[int]], new_tokens: int, sampler: Sampler,
               micro_batches: int = 1, stop: frozenset[int] = frozenset()) -> Generation:
    pipeline = Pipeline(stage_exports(build))
    try:
        return generate(pipeline, prompts, new_tokens, sampler, stop, micro_batches)
    finally:
        pipeline.close()


@pytest.mark.parametrize(("build", "micro_batches"), [("onnx_build", 2), ("rtx_build", 1)],
                         ids=["3 stages, onnx-2", "2 stages, tensorrt-rtx-1"])
def test_torchrun_micro_batches_give_the_tokens_of_one_batch(request: pytest.FixtureRequest, build: str,
                                                             micro_batches: int) -> None:
    """3 prompts, 16 greedy tokens each, one process a stage with the rows in 1 micro-batch or 2 (of 2
    and 1 rows, in flight together): the tokens of the whole batch run in one process. (Each build
    with one of the two counts: a torchrun of 2 or 3 processes costs about 11 s here.)"""
    sharded = request.getfixturevalue(build)[0]
    stages = len(stage_exports(sharded))
    # --runner onnx: the TensorRT-RTX build's engines (its default runner) need a GPU.
    distributed = torchrun(sharded, "--runner", "onnx", "--prompt-len", "12", "--batch", "3",
                           "--max-new-tokens", "16", "--seed", "3", "--micro-batches", str(micro_batches))
    local = in_process(sharded, random_prompts(3, 12, 256, seed=3), 16, Sampler())
    assert distributed["tokens"] == local.tokens and all(len(t) == 16 for t in local.tokens)
    assert distributed["micro_batches"] == micro_batches and distributed["threads"] >= 1
    assert len(distributed["stage_seconds"]) == len(distributed["stages"]) == stages
    for times in distributed["stages"]:
        assert 0 < times["busy_seconds"] <= times["window_seconds"]
        assert times["busy_seconds"] + times["waiting_seconds"] == pytest.approx(times["window_seconds"])
    # Bytes a decoded token: the next stage's AttnRes inputs (float32, one row of seq 1) and each
    # message's header (4 int64) shared by its micro-batch's rows; the last stage sends a token back.
    header = 32 * micro_batches / 3
    stage_specs = json.loads((sharded / MANIFEST).read_text())["stages"]
    for times, following in zip(distributed["stages"], stage_specs[1:], strict=False):
        floats = sum(np.prod([d for d in spec["shape"] if isinstance(d, int)]) for spec in following["inputs"]
                     if spec["name"].startswith("attn_res."))
        assert times["sent_bytes_per_token"] == pytest.approx(4 * floats + header)
    assert distributed["stages"][-1]["sent_bytes_per_token"] == pytest.approx(8 + header)


def test_micro_batches_in_one_process_change_only_the_grouping(onnx_build) -> None:
    """In one process the rows' greedy tokens are the same in 1, 2 or 3 micro-batches. Sampling with a
    seed draws the same tokens again for the same micro-batches, and under torchrun too, also when a
    stop token ends one micro-batch (row 2 alone) before the other."""
    out, _ = onnx_build
    prompts = random_prompts(3, 12, 256, seed=4)
    greedy = [in_process(out, prompts, 8, Sampler(), m).tokens for m in (1, 2, 3)]
    assert greedy[0] == greedy[1] == greedy[2]

    def sampler() -> Sampler:  # torchrun's with --seed 4, which also drew the prompts
        return Sampler(temperature=0.8, top_k=20, seed=4)

    free = in_process(out, prompts, 8, sampler(), 2).tokens
    assert free != greedy[0]
    stop = frozenset({free[2][2]})
    sampled = [in_process(out, prompts, 8, sampler(), 2, stop).tokens for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0][2]) <= 3 < len(sampled[0][0])
    distributed = torchrun(out, "--prompt-len", "12", "--batch", "3", "--max-new-tokens", "8", "--seed", "4",
                           "--micro-batches", "2", "--temperature", "0.8", "--top-k", "20",
                           "--stop", str(*stop))
    assert distributed["tokens"] == sampled[0]


def test_split_rows() -> None:
    assert split_rows(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_rows(16, 2) == [range(0, 8), range(8, 16)] and split_rows(3, 1) == [range(3)]
    assert default_micro_batches(16, 2) == 2 and default_micro_batches(1, 4) == 1
    for count in (0, 4):
        with pytest.raises(UserError, match=f"--micro-batches {count}: expected 1 up to the batch's 3"):
            split_rows(3, count)


def test_run_refuses_bad_micro_batches_and_threads(onnx_build, capsys, monkeypatch) -> None:
    """Refused before any stage is loaded (as under torchrun): loading one fails the test."""
    out, _ = onnx_build

    def loading(stage: Stage, export_dir: Path, name: str, *_: Any, **__: Any) -> None:
        raise AssertionError(f"{name} was loaded before the refusal")

    monkeypatch.setattr(Stage, "__init__", loading)
    code = main(["run", str(out), "--batch", "3", "--micro-batches", "4"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--micro-batches 4: expected 1 up to the batch's 3 sequences" in err
    assert main(["run", str(out), "--threads", "0"]) == 2
    assert "argument --threads: expected an integer >= 1, got 0" in capsys.readouterr().err


def started_worker(torchrun: subprocess.Popen, rank: int) -> int:
    """The pid of torchrun's worker of `rank` (its child whose environment says RANK=rank)."""
    for proc in Path("/proc").iterdir():
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if parent == torchrun.pid and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no worker of rank {rank}")


class Stderr:
    """A process's stderr, read by a thread of its own as it comes, so that a test can wait for a line
    with a deadline (a plain read blocks until the process writes or ends)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(proc.stderr), daemon=True)
        self.reader.start()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, patterns: list[str], seconds: float) -> float:
        """Waits until every regular expression of `patterns` is in the text; returns when (monotonic)."""
        deadline = time.monotonic() + seconds
        while not all(re.search(p, self.text()) for p in patterns):
            assert time.monotonic() < deadline and self.reader.is_alive(), (patterns, self.text()[-3000:])
            time.sleep(0.05)
        return time.monotonic()


def fault_a_worker(command: list[str], banner: str, victim: int, fault: str, names: list[str],
                   named: str = "") -> str:
    """Starts `command` (torchrun), waits until its processes print `banner` (their sessions loaded),
    then kills (SIGKILL) or stops (SIGSTOP, a hang) the worker of process `victim` while they decode.
    Every other process (`names`: each process's name as messages give it) must say what it met and then
    name the victim as the process the run stopped for (runtime.faults), in that order, within
    --timeout (3 s) + 15 s; a hung victim must be named by a missed deadline (the regular expression
    `named`) within 3 + 5 s, and is let go once every other process has named it, so that torchrun's
    SIGTERM ends it. Every process must be gone within 3 + 15 s; torchrun fails. Returns everything
    the processes wrote to stderr."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = Stderr(proc)
    err.wait_for([f"(?m)^{re.escape(banner)}"], 300)
    time.sleep(0.5)
    pid = started_worker(proc, victim)
    os.kill(pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    stopped = time.monotonic()
    if named:
        assert err.wait_for([named], 3 + 5) - stopped < 3 + 5
    met = (r"stopped by SIGTERM: torchrun stops every process|the link with .+ broke|a sum with .+ failed"
           r"|.+ (took nothing or sent nothing|did not join a sum) for 3 s \(--timeout\)")
    cause = rf"the run stopped because {re.escape(names[victim])} went silent: no word and no heartbeat"
    # Its two lines, in that order (other processes' lines may come between).
    said = [rf"k3export.runtime: {re.escape(name)}: ({met})[^\n]*\n(?:[^\n]*\n)*?"
            rf"k3export.runtime: {re.escape(name)}: {cause}" for p, name in enumerate(names) if p != victim]
    err.wait_for(said, 3 + 15)
    if fault == "hung":
        os.kill(pid, signal.SIGCONT)
    assert proc.wait(timeout=max(stopped + 3 + 15 - time.monotonic(), 0.1)) != 0
    err.reader.join()
    return err.text()


def test_a_killed_stage_stops_the_others(onnx_build) -> None:
    """Stage 1 of 3 killed (SIGKILL) while the others decode: each other stage says what it met (its
    link with the dead one broke, or torchrun's SIGTERM, whichever came first) and then names stage 1
    as the process the run stopped for, and is gone within the stated time; torchrun names it too. (A
    hung one, SIGSTOP, is named the same way: test_parallel_grid.py::test_a_failed_rank_stops_the_others.)"""
    out, _ = onnx_build
    command = torchrun_command(out, "--prompt-len", "12", "--batch", "2", "--max-new-tokens", "200",
                               "--timeout", "3")
    err = fault_a_worker(command, "k3export.runtime: 3 stages", 1, "killed",
                         [process_name(p, 1) for p in range(3)])
    # torchrun lists every failed process (its "Root Cause" is whichever it saw first).
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: -9", err), err[-2000:]


def test_the_fault_board_names_the_process_the_run_stopped_for() -> None:
    """runtime.faults.FaultBoard over a store of this process: a process that failed on its own is named
    at once; one that never spoke and whose heartbeat stopped (killed) is named once it has been silent
    for SILENCE_SECONDS, not before; processes that beat, or said they stopped or finished, never are."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    store = dist.PrefixStore("k3export.faults", dist.TCPStore("127.0.0.1", server.port, is_master=False))
    for process, said in [(1, ""), (2, FaultBoard.STOPPED + "the link broke"), (3, FaultBoard.FINISHED)]:
        store.set(f"said/{process}", said)  # processes that no longer beat
        store.add(f"beat/{process}", 1)
    live = FaultBoard(store, 4, 5, 1)  # beats on its own thread
    board = FaultBoard(store, 0, 5, 1)
    started = time.monotonic()
    cause = board.cause("stopped by SIGTERM")
    assert SILENCE_SECONDS <= time.monotonic() - started < SILENCE_SECONDS + 1
    assert cause == ("the run stopped because stage 1 (rank 1) went silent: no word and no heartbeat for 2 s "
                     "(it was killed, crashed or hangs)")
    assert store.get("said/0") == b"stopped: stopped by SIGTERM"
    live.say(FaultBoard.FAILED + "ValueError: bad")
    started = time.monotonic()
    assert board.cause("the link with stage 4 (rank 4) broke") == (
        "the run stopped because stage 4 (rank 4) failed (ValueError: bad)")
    assert time.monotonic() - started < 1
    class GoneStore:  # torchrun ended (a real client's failures also log C++ stacks: noise here)
        def __getattr__(self, name: str) -> Any:
            def fails(*_: Any) -> None:
                raise dist.DistNetworkError("Connection refused\nException raised from ...")
            return fails

    board.store = live.store = GoneStore()
    assert board.cause("stopped by SIGTERM") == ("the run stopped, and its store did not answer (Connection "
                                                 "refused); torchrun's report lists each exit")


def test_sampling_is_seeded() -> None:
    """One seed draws the same tokens twice; another seed draws others (a sampler that ignored its
    seed, or drew greedily, would pass the first alone)."""
    logits = np.random.default_rng(0).normal(size=(64, 50))
    draw = [Sampler(temperature=0.8, top_k=10, top_p=0.9, seed=seed)(logits) for seed in (5, 5, 6)]
    assert (draw[0] == draw[1]).all()
    assert (draw[0] != draw[2]).any() and (draw[0] != logits.argmax(-1)).any()
    assert (Sampler(temperature=1.0, top_k=1)(logits) == logits.argmax(-1)).all()


def perturb_stage_weights(build: Path, stage: int) -> None:
    """Scales the largest weight of one stage's ONNX file by 1.05 and records the new files' hashes,
    as a consistent but wrong build would have them."""
    folder = build / f"stage-{stage}"
    model = onnx.load(folder / "model.onnx")
    weight = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    weight.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(weight) * 1.05, weight.name))
    (folder / "model.onnx.data").unlink()
    onnx.save(model, folder / "model.onnx", save_as_external_data=True, location="model.onnx.data")
    stage_manifest = json.loads((folder / "export.json").read_text())
    for name in ("model.onnx", "model.onnx.data"):
        stage_manifest["files"][name] = file_record(folder / name)
    (folder / "export.json").write_text(json.dumps(stage_manifest))
    manifest = json.loads((build / MANIFEST).read_text())
    for name in ("model.onnx", "model.onnx.data", "export.json"):
        record = file_record(folder / name)
        key = f"stage-{stage}/{name}"
        manifest["files"][key] = manifest["stages"][stage]["files"][key] = record
    (build / MANIFEST).write_text(json.dumps(manifest))


def test_check_build_names_the_divergent_stage(onnx_build, tmp_path: Path) -> None:
    """The chain passes, its eager side held whole a stage at a time or streamed one layer at a time
    with the same numbers, taps included, bit for bit; a perturbed stage fails and is named."""
    out, _ = onnx_build
    report = run_build_check(out, steps=4, batch=2, prompt_len=12, log=lambda _: None, taps=True,
                             eager="in-memory")
    streamed = run_build_check(out, steps=4, batch=2, prompt_len=12, log=lambda _: None, taps=True,
                               eager="streamed")
    assert_eager_ran(streamed, report, report["stages"])
    assert streamed["steps"] == report["steps"] and streamed["taps"] == report["taps"]
    assert report["passed"] and report["first_divergent_stage"] is None
    assert report["taps"]["first_divergent"] is None
    assert all(s["rel"] <= 1e-4 for step in report["steps"] for s in step["stages"])
    # Every stage boundary is compared, as the next stage receives it.
    compared = {c["name"] for c in report["steps"][0]["outputs"]}
    assert {"logits", *(f"attn_res.{at}.{part}" for at in (3, 6) for part in ("bank", "partial"))} <= compared
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    perturb_stage_weights(bad, 1)
    report = run_build_check(bad, steps=2, batch=2, prompt_len=12, log=lambda _: None)
    assert not report["passed"] and report["first_divergent_stage"] == 1
    assert report["steps"][0]["stages"][0]["passed"]


def test_check_build_a_stage_at_a_time(onnx_build, tmp_path: Path) -> None:
    """check --build --stage I: stage I's outputs alone over a prefill and 2 decode steps, against the
    eager model of its layers, its input boundary computed by the eager model of the layers before it
    (streamed). Stage 0's prefill is the whole chain's, number for number (the same tokens into the
    same graph and model); a later stage takes the eager boundary where the chain feeds its own stage's,
    so its numbers differ in the last bits and it passes the same bound. A perturbed stage alone fails,
    and is named."""
    out, _ = onnx_build
    chain = run_build_check(out, steps=0, batch=2, prompt_len=12, log=lambda _: None)
    for i in (0, 2):
        alone = run_build_check(out, steps=2, batch=2, prompt_len=12, log=lambda _: None, stage=i,
                                eager="streamed")
        assert alone["passed"] and alone["stage_numbers"] == [i] and alone["first_divergent_stage"] is None
        assert [s["step"] for s in alone["steps"]] == ["prefill", "decode 1", "decode 2"]
        outputs = json.loads((out / stage_folder(i) / "export.json").read_text())["outputs"]
        theirs = {c["name"]: c for c in alone["steps"][0]["outputs"]}
        assert set(theirs) == {s["name"] for s in outputs if not s["name"].startswith("taps.")}
        ours = {c["name"]: c for c in chain["steps"][0]["outputs"] if c["name"] in theirs}
        assert set(ours) == set(theirs)
        if i == 0:
            assert ours == theirs
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    perturb_stage_weights(bad, 1)
    report = run_build_check(bad, steps=0, batch=2, prompt_len=12, log=lambda _: None, stage=1,
                             eager="streamed")
    assert not report["passed"] and report["first_divergent_stage"] == 1


def test_a_stage_alones_boundary_is_the_chains(onnx_build, monkeypatch: pytest.MonkeyPatch) -> None:
    """The boundary a stage checked alone takes (prefix_feeds: the eager model of the layers before it)
    against the chain's own stages before it on the same tokens, prefill and 2 decode steps: within
    float32's bound on every valid entry, not equal (measured about 1e-6 relative). A boundary from
    the wrong layers or weights would cancel out in the check itself (the artifact and the eager side
    take the same feeds); here it cannot."""
    out, _ = onnx_build
    folders, exports = stage_ranks(out), stage_exports(out)
    requests: list[dict[str, np.ndarray]] = []
    run = EagerSide.run
    monkeypatch.setattr(EagerSide, "run",
                        lambda side, feeds, *rest: requests.extend(feeds) or run(side, feeds, *rest))
    signature = Signature(json.loads((exports[2] / "export.json").read_text()))
    boundaries = prefix_feeds(out, folders, 2, signature, 2, 0, [12, 7], "streamed", lambda _: None)
    pipeline = Pipeline(exports[:2])
    try:
        pipeline.reset(2)
        chained = [pipeline(request) for request in requests]
    finally:
        pipeline.close()
    passed = [s for s in Signature(json.loads((exports[1] / "export.json").read_text())).outputs
              if s.name in {f.name for f in signature.feeds}]
    assert passed and len(chained) == len(boundaries) == 3
    for request, ours, theirs in zip(requests, chained, boundaries, strict=True):
        after = request["cache_lengths"] + request["input_lengths"]
        for spec in passed:
            a, b = (valid_entries(spec, x[spec.name], after, request["input_lengths"])
                    for x in (ours, theirs))
            error = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert 0 < error < TOLERANCES["float32"].rel, (spec.name, error)


def test_the_documented_build_check(onnx_build, capsys) -> None:
    """docs/sharding.md's check of a tapped build (2 stages there, 3 here: its lines do not depend on
    the count), as the code printed them before the check moved into k3export/check."""
    out, _ = onnx_build
    assert main(["check", "--build", str(out), "--taps", "--steps", "4", "--prompt-len", "24"]) == 0
    printed = capsys.readouterr().out.splitlines()
    documented = (Path(__file__).parents[1] / "docs" / "sharding.md").read_text().splitlines()
    for line in ["first divergent: none (every tap within its envelope)",
                 "first divergent stage: none (every stage's outputs within the bound at every step)",
                 "PASSED (float32, relative error <= 0.0001; greedy streams identical: True; token "
                 "mismatches 0, ties 0 of 44 positions)"]:
        assert line in map(without_headroom, printed) and f"    {line}" in map(without_headroom, documented)


def stage_folder(stage: int, rank: int | None = None) -> str:
    """A build's folder of a stage, or of one rank of a split stage."""
    return f"stage-{stage}" if rank is None else f"stage-{stage}/rank-{rank}"


def rerecord(build: Path, stage: int, changed: list[str], rank: int | None = None) -> None:
    """Records the new sha256 of files changed in the folder of stage `stage` (or of its `rank`): in
    its export.json (its own files) and the build's manifest (those and export.json), so that the
    build still verifies."""
    folder = build / stage_folder(stage, rank)
    stage_manifest = json.loads((folder / "export.json").read_text())
    for name in changed:
        if name != "export.json":
            stage_manifest["files"][name] = file_record(folder / name)
    (folder / "export.json").write_text(json.dumps(stage_manifest))
    manifest = json.loads((build / MANIFEST).read_text())
    for name in {*changed, "export.json"}:
        key = f"{stage_folder(stage, rank)}/{name}"
        manifest["files"][key] = manifest["stages"][stage]["files"][key] = file_record(folder / name)
    (build / MANIFEST).write_text(json.dumps(manifest))


def corrupt_stage(build: Path, stage: int, suffix: str, factor: float = 1.5, rank: int | None = None) -> None:
    """Scales the float32 initializer named ...`suffix` of one stage (or of its `rank`) where its
    external data holds it (stage-N[/rank-R]/model.onnx.data), the new hashes recorded."""
    folder = build / stage_folder(stage, rank)
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    target = next(t for t in model.graph.initializer if t.name.endswith(suffix))
    where = {e.key: e.value for e in target.external_data}
    offset, length = int(where["offset"]), int(where["length"])
    data = bytearray((folder / "model.onnx.data").read_bytes())
    values = np.frombuffer(data, np.float32, count=length // 4, offset=offset)
    data[offset:offset + length] = (values * factor).astype(np.float32).tobytes()
    (folder / "model.onnx.data").write_bytes(bytes(data))
    rerecord(build, stage, ["model.onnx.data"], rank)


# (weight, layer, sublayer, stage) in the 3-stage build (layers 0..2, 3..5, 6..8): a KDA layer's
# mixer in the first stage; the MoE of the second stage's last layer, whose error leaves the stage
# only through the AttnRes boundary it sends (so that boundary, not stage 2's caches, names stage 1).
BUILD_CORRUPTIONS = [
    ("layers.2.self_attn.q_conv1d.weight", 2, "mixer", 0),
    ("layers.5.block_sparse_moe.routed_expert_up_proj.weight", 5, "ffn", 1),
]


@pytest.mark.parametrize(("weight", "layer", "sublayer", "stage"), BUILD_CORRUPTIONS)
def test_check_build_taps_names_the_corrupted_layer(onnx_build, tmp_path: Path, capsys, weight, layer,
                                                    sublayer, stage) -> None:
    out, runs = onnx_build
    assert layer in runs["ranges"][stage]
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    corrupt_stage(bad, stage, weight)
    assert main(["check", "--build", str(bad), "--taps", "--steps", "1", "--prompt-len", "12", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    first = report["taps"]["first_divergent"]
    assert (first["layer"], first["sublayer"], first["stage"]) == (layer, sublayer, stage)
    assert first["rel"] > 1e-4 and report["first_divergent_stage"] == stage
    for step in report["taps"]["steps"]:
        before = [t for t in step["taps"] if (t["layer"], SUBLAYERS.index(t["sublayer"]))
                  < (layer, SUBLAYERS.index(sublayer))]
        assert all(t["rel"] <= 1e-4 for t in before)


def test_check_build_taps_refused_on_a_build_without_taps(onnx_build, tmp_path: Path, capsys) -> None:
    """The same build with its taps taken out of every stage's export.json (re-recorded): --taps is
    refused (exit 2) naming the folder and how to build one with taps, before anything runs."""
    out, runs = onnx_build
    plain = tmp_path / "plain"
    shutil.copytree(out, plain)
    for i in range(len(runs["ranges"])):
        path = plain / f"stage-{i}/export.json"
        manifest = json.loads(path.read_text())
        del manifest["taps"]
        manifest["outputs"] = [s for s in manifest["outputs"] if not s["name"].startswith("taps.")]
        path.write_text(json.dumps(manifest))
        rerecord(plain, i, ["export.json"])
    assert main(["check", "--build", str(plain), "--taps", "--steps", "1"]) == 2
    err = capsys.readouterr()
    assert str(plain) in err.err and "--taps" in err.err and "k3export build RECIPE" in err.err
    assert "eager reference" not in err.out
    mine = tmp_path / "mine"  # --report into a folder of someone else's files: refused before the check
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(["check", "--build", str(out), "--report", str(mine)]) == 2
    err = capsys.readouterr()
    assert "notes.txt" in err.err and "eager reference" not in err.out


def test_check_build_report(onnx_build, tmp_path: Path, capsys) -> None:
    """check --build --taps --report: the report files of the other artifacts, the plotted series
    the report's own numbers (taps per layer; without --taps the layers' caches), a stages table."""
    from PIL import Image

    out, _ = onnx_build
    folder = tmp_path / "r"
    assert main(["check", "--build", str(out), "--taps", "--steps", "2", "--prompt-len", "12",
                 "--report", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "first divergent: none" in text and "first divergent stage: none" in text
    verify(folder, "check.json", full=True)
    for name in ("layers.png", "steps.png"):
        with Image.open(folder / name) as image:
            assert image.format == "PNG" and image.width > 300
    report = json.loads((folder / "report.json").read_text())
    assert report["passed"] and report["artifact"] == f"--build {out}"
    md = (folder / "report.md").read_text()
    assert md.startswith(f"# k3export check --build {out}") and "## Stages" in md
    for phase, steps in (("prefill", report["taps"]["steps"][:1]), ("decode", report["taps"]["steps"][1:])):
        for sublayer in SUBLAYERS:
            expected = [max(t["rel"] for s in steps for t in s["taps"] if t["layer"] == i
                            and t["sublayer"] == sublayer) for i in range(9)]
            drawn = report["plots"]["layers"][phase][sublayer]
            assert drawn["x"] == list(range(9)) and drawn["y"] == pytest.approx(expected, rel=1e-12)
    logits = [next(c["rel"] for c in s["outputs"] if c["name"] == "logits") for s in report["steps"]]
    assert report["plots"]["steps"]["logits"]["y"] == pytest.approx(logits, rel=1e-12)
    # Without --taps: each layer's caches, compared in the stage that holds them.
    assert main(["check", "--build", str(out), "--steps", "1", "--prompt-len", "8", "--report",
                 str(tmp_path / "plain")]) == 0
    report = json.loads((tmp_path / "plain/report.json").read_text())
    prefill = report["steps"][0]["outputs"]
    expected = [max(c["rel"] for c in prefill if c["name"].startswith(f"present.{i}.")) for i in range(9)]
    assert report["plots"]["layers"]["prefill"]["caches"]["y"] == pytest.approx(expected, rel=1e-12)
    assert "build RECIPE --taps" in (tmp_path / "plain/report.md").read_text()


@pytest.fixture
def engines_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list:
    """The runtime's and check's engine path over the CPU stand-in of an engine (tests/engine_standin.py:
    the parsed network evaluated on the memory the runner binds, refusing what TensorRT refuses; not an
    engine), two GPUs counted; returns the runners made and the stand-in engines they loaded, in
    order."""
    from engine_standin import CpuMemoryEngineRunner, install

    from k3export.engine import runner

    made = []

    class Recorded(CpuMemoryEngineRunner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.returned: list[dict[str, Any]] = []
            made.append(self)

        def call(self, feeds: dict[str, Any]) -> Any:
            self.returned.append(super().call(feeds))
            return self.returned[-1]

    engines = install(monkeypatch, gpus=2)
    monkeypatch.setattr(runner, "EngineRunner", Recorded)
    return made, engines


def test_engine_builds_are_refused_at_the_gpu_boundary(rtx_build, capsys) -> None:
    """A build with engines: the runtime and check --build take its engines by default, and here
    (no GPU) refuse before anything runs, naming what is missing and --runner onnx."""
    out = rtx_build[0]
    for command, who in ((["run", str(out), "--max-new-tokens", "2"], "the runtime"),
                         (["check", "--build", str(out), "--steps", "1"], "check --build")):
        assert main(command) == 2
        err = capsys.readouterr().err.replace("\n", " ")
        assert f"holds TensorRT engines, which {who} runs by default" in err, err
        assert "needs an NVIDIA GPU" in err and "--runner onnx runs the build's ONNX graphs on CPU" in err


def test_check_build_takes_the_stages_engines(rtx_build, engines_on_cpu: tuple) -> None:
    """check --build on a build with engines runs each stage's engine through the engine runner, from
    the engine file and profiles its manifest records (the network evaluated in the engine's place)."""
    out, manifest, _ = rtx_build
    runners, engines = engines_on_cpu
    report = run_build_check(out, steps=1, batch=2, prompt_len=8, log=lambda _: None)
    assert report["runner"] == "engine" and report["passed"] and report["first_divergent_stage"] is None
    assert [r.engine_path for r in runners] == [out / s["engine"] for s in manifest["stages"]]
    assert [r.plan.profiles for r in runners] == [s["profiles"] for s in manifest["stages"]]
    # Each stage's engine on its own GPU (s * N + r mod 2), its context holding prefill's then decode's
    # profile, refusing nothing.
    contexts = [c for e in engines for c in e.contexts]
    assert [c.gpu for c in contexts] == [0, 1]
    assert all([profile for profile, _ in c.calls] == [0, 1] and not c.refusals for c in contexts)


def test_the_runtime_generates_on_the_stages_engines(rtx_build, engines_on_cpu: tuple, capsys) -> None:
    """`k3export run` on the engine path gives the tokens the ONNX graphs give; what the first stage
    returns stays tensors in the engine's memory (the boundary crosses to the next stage as it is), and
    only the last stage's logits are read to the host."""
    out = rtx_build[0]
    runners, engines = engines_on_cpu
    rows = {}
    for runner in ("onnx", "engine"):
        assert main(["run", str(out), "--runner", runner, "--batch", "2", "--prompt-len", "8",
                     "--max-new-tokens", "3", "--json"]) == 0
        captured = capsys.readouterr()
        assert f"runner: {runner}" in captured.err
        summary = json.loads(captured.out)
        rows[runner] = summary["tokens"]
        assert (summary["threads"] is None) == (runner == "engine")  # ONNX Runtime's threads, if it ran
    assert rows["engine"] == rows["onnx"]
    first, last = runners
    assert first.returned and len(first.returned) == len(last.returned)
    for outputs in first.returned:
        assert all(isinstance(v, torch.Tensor) and v.device == first.device for v in outputs.values())
    for outputs in last.returned:
        assert isinstance(outputs["logits"], np.ndarray)
        assert all(isinstance(v, torch.Tensor) for n, v in outputs.items() if n != "logits")
    assert not any(c.refusals for e in engines for c in e.contexts)


def test_target_option_overrides_the_recipes(tmp_path: Path, capsys) -> None:
    """build RECIPE --target is the build's target instead of the recipe's [build] target (refused
    here for one TensorRT-RTX has not), and one of the settings a resume compares."""
    assert main(["build", str(TINY), "--out", str(tmp_path / "out"), "--target", "sm90"]) == 2
    assert "target 'sm90' (its [build] target, or --target) with backend 'tensorrt-rtx'" in \
        capsys.readouterr().err.replace("\n", " ")
    from k3export.shards.stages import _settings

    recipe = load_recipe(TINY)
    assert "target" not in _settings(recipe, "tensorrt-rtx", False, False, False, False)
    moved = _settings(dataclasses.replace(recipe, target="sm120"), "tensorrt-rtx", False, False, False, False)
    assert moved["target"] == "sm120"
