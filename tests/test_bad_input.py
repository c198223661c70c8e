"""Bad input through the command line, as a new user gives it: each case runs `k3export` (its
`main`, as the console script calls it, in this process with its output captured: a process of its
own would only add seconds of imports) and asserts the exit code (2), that the message names the
culprit, that no traceback is printed, and that files already there (a user's file, a previous good
artifact) are unchanged.
Also: every combination of options the CLI refuses (tests/refusals.py, the table the fuzz's oracle
reads too) is refused naming its option; runs killed at chosen points and at seeded random moments leave
no incomplete file at a final name, and the rerun completes and verifies."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from refusals import REFUSALS, Refusal
from safetensors.torch import load_file, save_file

from k3export.artifacts import sha256
from k3export.check.driver import run_check
from k3export.cli import build_parser, main
from k3export.weights.checkpoint import INDEX_NAME, CheckpointError, save_checkpoint


def k3export(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`k3export ARGS`: its exit code and output. With `env` (a fault injected through the
    environment, such as a kill) it runs as a process of its own."""
    if env:
        return subprocess.run([sys.executable, "-m", "k3export.cli", *args], capture_output=True, text=True,
                              timeout=600, env={**os.environ, **env})
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["k3export", *args], code, out.getvalue(), err.getvalue())


def refused(result: subprocess.CompletedProcess, *culprits: str) -> None:
    """Exit 2, one short message naming every culprit, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    for culprit in culprits:
        assert culprit in result.stderr, (culprit, result.stderr[-2000:])


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


# -- combinations of options ---------------------------------------------------------------------------

@pytest.mark.parametrize("refusal", [r for r in REFUSALS if "{build}" not in r.argv],
                         ids=lambda r: " ".join(r.argv))
def test_each_refused_combination_names_its_option(refusal: Refusal, tiny_export, tmp_path):
    """Each example of tests/refusals.py that needs no build (the fuzz runs those too, on its build):
    exit 2 naming the option, nothing written; and its own predicate says it applies."""
    recipe = Path(__file__).resolve().parents[1] / "engines/k3-tiny.toml"
    paths = {"{export}": str(tiny_export), "{recipe}": str(recipe), "{missing}": str(tmp_path / "missing")}
    argv = [paths.get(a, a) for a in refusal.argv]
    assert refusal.applies(argv[0], build_parser().parse_args(argv))
    refused(k3export(*argv), refusal.culprit)
    assert not (tmp_path / "missing").exists()


# -- output folders ---------------------------------------------------------------------------------

def test_export_refuses_a_folder_with_a_users_file(tmp_path):
    folder = tmp_path / "precious"
    folder.mkdir()
    (folder / "thesis.txt").write_text("draft")
    refused(k3export("export", "--preset", "k3-tiny", "--out", str(folder)), "thesis.txt", "--overwrite")
    assert snapshot(folder) == {"thesis.txt": sha256(folder / "thesis.txt")}
    refused(k3export("export", "--preset", "k3-tiny", "--out", str(folder / "thesis.txt")), "a file is there")
    assert (folder / "thesis.txt").read_text() == "draft"


# A one-layer range of k3-tiny exports in a quarter of the whole model's time; what these tests prove
# (how an output folder is written, replaced and recovered) does not depend on the graph.
RANGE_EXPORT = ("export", "--preset", "k3-tiny", "--seed", "0", "--layers", "0:1")


# Seconds range_export's export took, in this process (the kill test's moments are fractions of it).
EXPORT_SECONDS: dict[str, float] = {}


@pytest.fixture(scope="module")
def range_export(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("range") / "export"
    started = time.perf_counter()
    assert main([*RANGE_EXPORT, "--out", str(folder)]) == 0
    EXPORT_SECONDS["range"] = time.perf_counter() - started
    return folder


def test_overwrite_replaces_only_what_the_tool_wrote(range_export, tmp_path):
    """A previous export with a user's file beside it: --overwrite keeps the user's file and replaces
    the export's own files; a rerun into the tool's own folder needs no flag."""
    folder = tmp_path / "again"
    shutil.copytree(range_export, folder)
    assert main([*RANGE_EXPORT, "--out", str(folder)]) == 0
    (folder / "notes.md").write_text("mine")
    (folder / "model.onnx.data").write_bytes(b"stale")  # an old artifact the rerun must replace
    refused(k3export(*RANGE_EXPORT, "--out", str(folder)), "notes.md")
    assert main([*RANGE_EXPORT, "--out", str(folder), "--overwrite"]) == 0
    assert (folder / "notes.md").read_text() == "mine"
    assert sha256(folder / "model.onnx.data") == sha256(range_export / "model.onnx.data")
    assert main(["verify", str(folder)]) == 0


def test_build_refuses_to_replace_a_file_it_did_not_write(tiny_export, tmp_path):
    engine = tmp_path / "model.engine"
    engine.write_text("somebody's engine")
    refused(k3export("build", "--onnx", str(tiny_export), "--out", str(engine)), str(engine), "--overwrite")
    assert engine.read_text() == "somebody's engine"


# -- export folders that are not what they claim ------------------------------------------------------

@pytest.fixture()
def damaged(tiny_export, tmp_path):
    """A copy of the export to damage (the session's export stays intact)."""
    folder = tmp_path / "copy"
    shutil.copytree(tiny_export, folder, ignore=shutil.ignore_patterns("check"))
    return folder


@pytest.mark.parametrize("command", ["check", "build"])
def test_missing_and_tampered_files_are_refused_before_anything_runs(damaged, tmp_path, command):
    extra = ["--out", str(tmp_path / "x.engine")] if command == "build" else []
    data = damaged / "model.onnx.data"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 1  # same size, one bit changed
    data.write_bytes(bytes(blob))
    refused(k3export(command, "--onnx", str(damaged), *extra), "model.onnx.data", "sha256")
    (damaged / "model.onnx").unlink()
    refused(k3export(command, "--onnx", str(damaged), *extra), "model.onnx", "missing")
    assert not (tmp_path / "x.engine").exists()


def test_damaged_manifests_name_the_file_and_field(damaged):
    manifest = damaged / "export.json"
    good = json.loads(manifest.read_text())
    manifest.write_text(manifest.read_text()[:100])
    refused(k3export("check", "--onnx", str(damaged)), str(manifest), "not valid JSON")
    manifest.write_text(json.dumps({k: v for k, v in good.items() if k != "dtype"}))
    refused(k3export("check", "--onnx", str(damaged)), str(manifest), "'dtype'")
    manifest.write_text(json.dumps({**good, "files": {"../../etc/passwd": {"sha256": "0", "bytes": 1}}}))
    refused(k3export("check", "--onnx", str(damaged)), "../../etc/passwd", "inside")
    refused(k3export("check", "--onnx", str(damaged / "nowhere")), "nowhere")


def test_verify_hashes_everything(damaged):
    assert k3export("verify", str(damaged)).returncode == 0
    config = damaged / "config.json"
    stat = config.stat()
    config.write_text(config.read_text().replace("64", "65", 1))
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime: only a full hash sees it
    refused(k3export("verify", str(damaged)), "config.json", "sha256")


# -- configs ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "culprit"), [
    ('{"linear_attn_config": {"full_attn_layers": [4], "gate_lower_bound": "x"}}', "gate_lower_bound"),
    ('{"linear_attn_config": {"full_attn_layers": [4], "kda_layers": 3}}', "kda_layers"),
    ('{"linear_attn_config": {"full_attn_layers": [true]}}', "full_attn_layers"),
    ('{"linear_attn_config": {"full_attn_layers": [4, 94]}}', "full_attn_layers"),
    ('{"linear_attn_config": {"full_attn_layers": [4], "short_conv_kernel_size": 1}}', "short_conv"),
    ('{"hidden_size": 70000000, "linear_attn_config": {"full_attn_layers": [4]}}', "hidden_size"),
    ('{"num_attention_heads": 7, "linear_attn_config": {"full_attn_layers": [4]}}', "num_heads"),
    ('{"hidden_size": 7168}', "linear_attn_config"),
    ('{"hidden_size": 7168', "not valid JSON"),
])
def test_bad_configs(tmp_path, text, culprit):
    path = tmp_path / "config.json"
    path.write_text(text)
    refused(k3export("info", "--config", str(path)), str(path), culprit)


def test_unknown_config_keys_are_warned_about_except_known_hf_ones(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"rope_theta": 1.0, "architectures": ["X"], "hiden_size": 7168,
                                "linear_attn_config": {"full_attn_layers": [4], "headdim": 1}}))
    assert main(["info", "--config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "hiden_size" in err and "linear_attn_config.headdim" in err
    assert "rope_theta" not in err and "architectures" not in err


# -- checkpoints ----------------------------------------------------------------------------------------

@pytest.fixture()
def sharded(tiny_model, tmp_path):
    folder = tmp_path / "ckpt"
    save_checkpoint(tiny_model, folder, max_shard_bytes=600_000)
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) >= 3
    return folder, shards


def test_truncated_and_missing_shards_are_named_together_before_loading(sharded, tmp_path):
    folder, shards = sharded
    shards[-1].write_bytes(shards[-1].read_bytes()[:-1000])
    shards[0].unlink()
    out = tmp_path / "out"
    result = k3export("export", "--checkpoint", str(folder), "--out", str(out))
    refused(result, shards[0].name, "missing", shards[-1].name, "download it again")
    assert not out.exists()


def test_misshaped_and_unexpected_tensors_are_listed_together(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    save_checkpoint(tiny_model, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.input_layernorm.weight"] = torch.ones(3)
    tensors["model.layers.1.self_attn.A_log"] = torch.ones(2, dtype=torch.int32)
    tensors["model.layers.99.mystery.weight"] = torch.ones(1)
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    result = k3export("export", "--checkpoint", str(folder), "--out", str(tmp_path / "out"))
    refused(result, "mis-shaped", "model.layers.0.input_layernorm.weight", "int32",
            "unexpected", "model.layers.99.mystery.weight", "missing", "lm_head.weight")


def test_pickles_and_paths_outside_the_folder_are_refused(sharded, tmp_path):
    folder, _ = sharded
    index = json.loads((folder / INDEX_NAME).read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere.safetensors"
    (folder / INDEX_NAME).write_text(json.dumps(index))
    refused(k3export("info", "--checkpoint", str(folder)), "../elsewhere.safetensors", "inside")
    index["weight_map"][name] = "pytorch_model.bin"
    (folder / INDEX_NAME).write_text(json.dumps(index))
    refused(k3export("info", "--checkpoint", str(folder)), "pytorch_model.bin", "pickle")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(folder / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    refused(k3export("info", "--checkpoint", str(pickled)), "pytorch_model.bin", "pickle")


def test_mxfp4_values_beyond_float16_are_refused():
    from k3export.ops import mxfp4

    packed = torch.full((2, 16), 0x77, dtype=torch.uint8)  # code 7: 6.0
    scale = torch.full((2, 1), 127 + 14, dtype=torch.uint8)  # 6 * 2^14 = 98304 > 65504
    mxfp4.check(packed, scale, "w", torch.bfloat16)
    with pytest.raises(mxfp4.MXFP4Error, match=r"w: scale bytes of 141 make values beyond the float16"):
        mxfp4.check(packed, scale, "w", torch.float16)


# -- sizes --------------------------------------------------------------------------------------------

def test_a_model_larger_than_memory_is_refused_before_allocating(tmp_path):
    out = tmp_path / "k3"
    result = k3export("export", "--preset", "kimi-k3", "--out", str(out))
    refused(result, "5,559.0 GB", "available", "--no-weights")
    assert not out.exists()


# -- internal errors and --debug ---------------------------------------------------------------------

def test_internal_errors_keep_their_traceback(monkeypatch, capsys, tmp_path):
    import k3export.cli as cli

    path = tmp_path / "config.json"
    path.write_text("{")
    assert cli.main(["--debug", "info", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and f"k3export: error: {path}: not valid JSON" in err
    # A value the parser refuses has no traceback to show: argparse's message, exit 2.
    assert cli.main(["--debug", "info", "--config", str(tmp_path / "nothing.json")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"argument --config: {tmp_path / 'nothing.json'}: no such file" in err

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "cmd_info", broken)
    assert cli.main(["info", "--preset", "k3-tiny"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'a bug'" in err and "internal error" in err


# -- crash safety -------------------------------------------------------------------------------------

def _complete(folder: Path, reference: Path) -> None:
    """Every file at a final name equals the complete export's; nothing half-written is visible."""
    for name, digest in snapshot(folder).items():
        if not name.startswith("."):
            assert digest == sha256(reference / name), name


@pytest.mark.parametrize("point", ["staged", "moving", "before-manifest"])
def test_killed_exports_leave_no_incomplete_file_and_rerun(range_export, tmp_path, point):
    folder = tmp_path / "killed"
    args = (*RANGE_EXPORT, "--out", str(folder))
    result = k3export(*args, env={"K3EXPORT_TEST_KILL_AT": point})
    assert result.returncode == -signal.SIGKILL
    _complete(folder, range_export)
    assert not (folder / "export.json").exists()  # the folder is not taken as a complete export
    assert main([*args, "--quiet"]) == 0  # the rerun, in this process (no second start-up)
    assert main(["verify", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["config.json", "export.json", "model.onnx", "model.onnx.data", ".k3export-verified.json"])


def test_export_killed_at_random_moments(range_export, tmp_path):
    """Three exports into one folder, each killed (SIGKILL) at a moment drawn with a fixed seed
    after its output folder appeared, while it still ran: each leaves no incomplete file at a final
    name; then the rerun completes and verifies. The moments are fractions of this machine's
    in-process export time (range_export's), so most land in the export and some in its commit."""
    folder = tmp_path / "random"
    args = [sys.executable, "-m", "k3export.cli", *RANGE_EXPORT, "--out", str(folder)]
    draws = random.Random(25)
    for _ in range(3):
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not folder.exists():  # the imports and the model come first
            assert process.poll() is None, "the export ended before its folder appeared"
            time.sleep(0.02)
        time.sleep(draws.uniform(0.0, 0.7) * EXPORT_SECONDS["range"])
        assert process.poll() is None, "the export ended before it could be killed"
        process.kill()
        assert process.wait() == -signal.SIGKILL
        _complete(folder, range_export)
    assert main([*RANGE_EXPORT, "--out", str(folder), "--quiet"]) == 0
    assert main(["verify", str(folder)]) == 0


# -- numerical faults ----------------------------------------------------------------------------------

def test_a_nan_weight_fails_the_check_naming_it(tiny_model, tmp_path):
    """A checkpoint with one Inf weight exports (the file is what it is) and the check fails (exit 1),
    naming the weight, then the first step and outputs where NaN/Inf appear."""
    from k3export.weights.checkpoint import build_model

    model = build_model(tiny_model.config, torch.float32, {"seed": 0})
    name = "model.layers.5.post_attention_layernorm.weight"
    with torch.no_grad():
        model.get_parameter(name)[3] = float("inf")
    save_checkpoint(model, tmp_path / "ckpt")
    exported = k3export("export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "x"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    # The checkpoint, once it lacks one tensor of layer 7, is refused naming it before the check
    # starts, although the streamed eager side would read layer 7 only after the graph's every step.
    file = tmp_path / "ckpt" / "model.safetensors"
    whole = file.read_bytes()
    missing = "model.layers.7.input_layernorm.weight"
    save_file({k: v for k, v in load_file(file).items() if k != missing}, file)
    refused(k3export("check", "--onnx", str(tmp_path / "x"), "--steps", "1", "--eager", "streamed"),
            str(tmp_path / "ckpt"), "missing (1)", missing)
    assert not [p for p in (tmp_path / "x" / "check").rglob("*") if p.is_file()]  # nothing written
    started = []  # the artifact's runner, had the check started
    with pytest.raises(CheckpointError, match=missing):
        run_check(tmp_path / "x", steps=1, eager="streamed", log=lambda _: None,
                  graph_runner=lambda signature, extra: started.append(signature))
    assert not started
    file.write_bytes(whole)
    result = k3export("check", "--onnx", str(tmp_path / "x"), "--steps", "1")
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"NaN/Inf first in {name} at weights" in result.stdout
    assert "NaN/Inf in" in result.stdout and "prefill" in result.stdout


def test_an_eager_side_that_does_not_fit_is_refused_with_the_numbers(monkeypatch):
    """check's eager side and the machine's memory: auto holds it in memory when its weights take at
    most half of the memory available, and streams it otherwise, also where it would fit (k3-tiny
    float16: a few MB of weights with the float32 twin, under 1 MB a layer); a mode that does not fit
    is refused before anything runs, naming both numbers."""
    from k3export.check.runners import eager
    from k3export.config import K3Config
    from k3export.errors import UserError

    config = K3Config.from_preset("k3-tiny")

    def plan_with(available: float, choice: str = "auto") -> eager.EagerPlan:
        monkeypatch.setattr(eager, "available_memory", lambda: round(available))
        return eager.plan_eager(choice, config, "float16", {"seed": 0}, [range(0, 9)])

    in_memory = plan_with(1e6).in_memory_bytes
    plan = plan_with(2 * in_memory)
    assert plan.mode == "in-memory" and plan.spans == [range(0, 9)] and "are within 50% of the" in plan.why
    for available in (1.99 * in_memory, 1e6):  # fits, but without the headroom; does not fit
        plan = plan_with(available)
        assert plan.mode == "streamed" and "are more than 50% of the" in plan.why
        assert plan.spans == [range(i, i + 1) for i in range(9)]
    assert plan_with(1.99 * in_memory, "in-memory").mode == "in-memory"  # asked for, and it fits
    assert plan.streamed_bytes < 1e6 < plan.in_memory_bytes
    assert (f"weights held at once: streamed {plan.streamed_bytes / 1e9:.3g} GB, in memory "
            f"{plan.in_memory_bytes / 1e9:.3g} GB") in plan.line()
    monkeypatch.setattr(eager, "available_memory", lambda: 1_000_000)
    with pytest.raises(UserError, match=r"--eager in-memory: the largest stage of the eager model and its "
                       r"float32 twin holds 0\.00\d+ GB of weights and this machine has 0\.001 GB "
                       "available; "
                       "check with --eager streamed"):
        eager.plan_eager("in-memory", config, "float16", {"seed": 0}, [range(0, 9)])
    monkeypatch.setattr(eager, "available_memory", lambda: 100_000)
    with pytest.raises(UserError, match=r"--eager streamed: one layer of the eager model and its float32 "
                       r"twin holds 0\.000\d+ GB of weights and this machine has 0\.0001 GB available"):
        eager.plan_eager("auto", config, "float16", {"seed": 0}, [range(0, 9)])

