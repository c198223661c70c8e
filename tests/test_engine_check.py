"""check --engine: argument handling and refusals (no GPU here). The engine runner's plan and cache
logic are tested in test_engine_runner.py."""

from __future__ import annotations

import json

import pytest

from k3export.check.runners.engine import engine_targets
from k3export.cli import main
from k3export.engine import runner as engine_runner
from k3export.engine.build import Limits, profile_shapes
from k3export.errors import UserError


def test_check_takes_exactly_one_artifact(tiny_export, capsys):
    assert main(["check", "--engine", str(tiny_export / "model.onnx"), "--onnx", str(tiny_export)]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["check", "--taps"]) == 2


def test_engine_arguments_are_refused_naming_the_culprit(tiny_export, tmp_path, capsys):
    assert main(["check", "--engine", str(tmp_path / "none.engine")]) == 2
    assert "none.engine: no such file" in capsys.readouterr().err
    stray = tmp_path / "stray.engine"
    stray.write_bytes(b"not ours")
    assert main(["check", "--engine", str(stray)]) == 2
    assert "stray.engine.json is missing or names no 'export'" in capsys.readouterr().err
    build = tmp_path / "build"
    (build / "stage-0").mkdir(parents=True)
    (build / "manifest.json").write_text(json.dumps({"stages": [{"folder": "stage-0"}]}))
    assert main(["check", "--engine", str(build)]) == 2
    assert "stages hold no engines" in capsys.readouterr().err
    # A split build's ranks have engines that cannot run alone: named, with the command that can.
    ranks = [{"stage": 0, "rank": r, "folder": f"stage-0/rank-{r}", "engine": f"stage-0/rank-{r}/r.engine"}
             for r in range(2)]
    (build / "manifest.json").write_text(json.dumps({"stages": [{"folder": "stage-0", "engine": None,
                                                                 "ranks": ranks}]}))
    assert main(["check", "--engine", str(build)]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert "a build split over 2 ranks a stage" in err and f"check --build {build} --stage I" in err


def test_no_gpu_is_refused_with_what_is_missing(tiny_export, tmp_path, capsys, monkeypatch):
    engine = tmp_path / "tiny.engine"
    engine.write_bytes(b"\0" * 16)
    record = tmp_path / "tiny.engine.json"
    record.write_text(json.dumps({"export": str(tiny_export)}))
    assert engine_targets(engine) == [(engine, tiny_export)]
    assert main(["check", "--engine", str(engine), "--steps", "1"]) == 2
    assert "tiny.engine.json: not a build record with 'profiles' and 'backend'" in capsys.readouterr().err
    profiles = profile_shapes(json.loads((tiny_export / "export.json").read_text()), Limits())
    built = {"export": str(tiny_export), "backend": "tensorrt-rtx", "profiles": profiles}
    record.write_text(json.dumps(built))
    assert main(["check", "--engine", str(engine), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "needs an NVIDIA GPU (torch.cuda.is_available() is False)" in err
    assert "k3export check --network DIR" in err
    monkeypatch.setattr(engine_runner.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="and TensorRT \\(neither tensorrt nor tensorrt_rtx"):
        engine_runner.require_engine_runtime("check --engine")


def test_half_precision_engine_without_routing_outputs_is_refused(tiny_export, tmp_path, capsys):
    """An engine's outputs are fixed when it is built: a float16 engine is checked only if its export
    outputs its expert choices (export --routing-outputs), refused before anything else otherwise."""
    export = tmp_path / "f16"
    export.mkdir()
    manifest = json.loads((tiny_export / "export.json").read_text())
    (export / "export.json").write_text(json.dumps({**manifest, "dtype": "float16"}))
    engine = tmp_path / "tiny.engine"
    engine.write_bytes(b"\0" * 16)
    (tmp_path / "tiny.engine.json").write_text(json.dumps({"export": str(export)}))
    assert main(["check", "--engine", str(engine), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "a float16 check holds the eager model to the engine's own expert choices" in err
    assert "k3export export --routing-outputs" in err and "NVIDIA GPU" not in err
