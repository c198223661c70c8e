"""The two TensorRT flavours: the table, target checks, and every refusal of a build this machine
cannot make, before anything is exported or read (k3export/engine/flavours.py)."""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path

import pytest

from k3export.cli import main
from k3export.engine import flavours
from k3export.engine.flavours import FLAVOURS, machine_problems, target_problem

ROOT = Path(__file__).resolve().parents[1]
HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
HAS_FULL = importlib.util.find_spec("tensorrt") is not None


def test_the_table() -> None:
    rtx, full = FLAVOURS["tensorrt-rtx"], FLAVOURS["tensorrt"]
    assert (rtx.module, rtx.extra, rtx.needs_gpu) == ("tensorrt_rtx", "engine", False)
    assert (full.module, full.extra, full.needs_gpu) == ("tensorrt", "tensorrt", True)
    # One registration per op and flavour: each flavour names its own plugin module.
    assert rtx.plugins != full.plugins
    assert target_problem(rtx, "sm89") is None and target_problem(rtx, "sm120") is None
    assert "TensorRT-RTX's targets" in target_problem(rtx, "sm90")
    assert target_problem(full, "sm90") is None and target_problem(full, "sm100") is None
    assert "compute capability" in target_problem(full, "h200")


def test_extras_install_each_flavour() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for flavour in FLAVOURS.values():
        assert any(flavour.module.replace("_", "-") in requirement for requirement in extras[flavour.extra])


@pytest.mark.skipif(not HAS_RTX, reason="tensorrt_rtx is not installed")
def test_module_is_the_flavour() -> None:
    trt = flavours.load_tensorrt("tensorrt-rtx")
    assert flavours.flavour_of(trt) is FLAVOURS["tensorrt-rtx"]
    for feature in FLAVOURS["tensorrt-rtx"].preview_features:
        assert hasattr(trt.PreviewFeature, feature)


def fake_nvidia_smi(folder: Path, capabilities: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An `nvidia-smi` on PATH answering the compute-capability query as a machine with these GPUs
    would (its CSV output format)."""
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\nprintf '" + "".join(f"{c}\\n" for c in capabilities) + "'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


def test_full_tensorrt_builds_only_for_the_gpu_present(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    full = FLAVOURS["tensorrt"]
    fake_nvidia_smi(tmp_path, ["9.0"] * 8, monkeypatch)
    assert flavours.gpu_targets() == ["sm90"] * 8
    gpu = [p for p in machine_problems(full, "sm100") if "GPU" in p]
    assert gpu == ["no sm100 GPU (B200 / GB200): full TensorRT builds for the GPU it runs on, and this "
                   "machine has sm90"]
    assert not [p for p in machine_problems(full, "sm90") if "GPU" in p]
    # TensorRT-RTX needs no GPU.
    fake_nvidia_smi(tmp_path, [], monkeypatch)
    assert flavours.gpu_targets() == []
    assert not [p for p in machine_problems(FLAVOURS["tensorrt-rtx"], "sm89") if "GPU" in p]


@pytest.mark.skipif(HAS_FULL, reason="full TensorRT is installed here")
def test_published_recipe_reaches_the_gpu_boundary(tmp_path: Path, capsys) -> None:
    """`build engines/kimi-k3.toml --stage 0` ends, in a second, with exit 2 naming what this machine
    lacks (not a refusal by design), before any export or checkpoint read: no folder is made."""
    out = tmp_path / "k3"
    assert main(["build", str(ROOT / "engines/kimi-k3.toml"), "--out", str(out), "--stage", "0"]) == 2
    err = capsys.readouterr().err
    assert "pip install -c constraints-gpu.txt -e '.[tensorrt]'" in err
    assert "no sm90 GPU (H100 / H200)" in err
    assert "checkpoint = '../checkpoints/Kimi-K3': no folder at" in err
    assert "run it on a host with sm90 GPUs and full TensorRT installed" in err
    assert not out.exists()
    # Without weights the checkpoint is not needed, and is not named.
    assert main(["build", str(ROOT / "engines/kimi-k3.toml"), "--out", str(out), "--stage", "0",
                 "--no-weights"]) == 2
    assert "checkpoint" not in capsys.readouterr().err and not out.exists()


def unread_export(folder: Path) -> str:
    """A folder that is an export by its manifest (the parser takes it) and nothing else: each
    refusal below comes before its files are read."""
    (folder / "export.json").write_text('{"written_by": "k3export", "command": "export", "files": {}}')
    return str(folder)


@pytest.mark.parametrize(("options", "message"), [
    (["--backend", "tensorrt-rtx", "--target", "sm90"], "TensorRT-RTX's targets"),
    (["--backend", "tensorrt"], "expected --target"),
    (["--backend", "onnx"], "an export is already ONNX"),
    (["--backend", "tensorrt", "--target", "h200"], "a compute capability such as 'sm90'"),
    (["--target", "h200"], "TensorRT-RTX's targets"),
])
def test_build_onnx_refusals(tmp_path: Path, capsys, options: list[str], message: str) -> None:
    out = tmp_path / "model.engine"
    assert main(["build", "--onnx", unread_export(tmp_path), "--out", str(out), *options]) == 2
    assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.skipif(HAS_FULL, reason="full TensorRT is installed here")
def test_build_onnx_with_full_tensorrt_names_what_is_missing(tmp_path: Path, capsys) -> None:
    # The folder is no export: the refusal comes before it is read.
    out = tmp_path / "model.engine"
    assert main(["build", "--onnx", unread_export(tmp_path), "--out", str(out), "--backend", "tensorrt",
                 "--target", "sm90"]) == 2
    err = capsys.readouterr().err
    assert "`import tensorrt` fails" in err and "no sm90 GPU" in err and not out.exists()


@pytest.mark.skipif(not HAS_RTX, reason="tensorrt_rtx is not installed")
def test_stripped_build_needs_a_gpu(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorRT-RTX 1.7 aborts the process building a weight-stripped engine without a GPU (measured):
    refused instead, before the export is read, as a recipe's stripped build is."""
    fake_nvidia_smi(tmp_path, [], monkeypatch)
    out = tmp_path / "model.engine"
    assert main(["build", "--onnx", unread_export(tmp_path), "--out", str(out), "--strip"]) == 2
    assert "a GPU for a weight-stripped build (--strip)" in capsys.readouterr().err and not out.exists()
    assert main(["build", str(ROOT / "engines/k3-tiny.toml"), "--out", str(tmp_path / "b"), "--strip"]) == 2
    assert "weight-stripped" in capsys.readouterr().err and not (tmp_path / "b").exists()
