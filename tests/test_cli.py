import importlib.util
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from k3export.cli import main


def test_info_kimi_k3(capsys):
    assert main(["info", "--preset", "kimi-k3"]) == 0
    out = capsys.readouterr().out
    assert "2.7795T total, 104.19B active per token" in out
    assert "(53.3x)" in out
    # 16 chosen experts x 3 projections x 3584 x 3072 multiply-adds x 2 FLOPs = 1.057e9 per token per layer.
    assert "1.06 GFLOP in the top-16 of 896 routed experts" in out


def test_info_json_from_config_file(tmp_path, capsys, tiny_config, tiny_model):
    """The counts are the eager model's own (its parameters counted here, not the report's sum of its
    parts, which holds by construction)."""
    tiny_config.to_json(tmp_path / "config.json")
    assert main(["info", "--config", str(tmp_path / "config.json"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"]["total"] == sum(p.numel() for p in tiny_model.parameters())
    assert report["parameters"]["total"] == sum(report["parameters"]["by_component"].values())
    weights = sum(p.numel() * p.element_size() for p in tiny_model.parameters())
    assert report["weight_bytes"]["all_in_model_dtype"] == weights


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"linear_attn_config": {"full_attn_layers": [200]}}))
    assert main(["info", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "'linear_attn_config.full_attn_layers'" in err


def test_demo_runs_the_pipeline(tmp_path, capfd):
    """The demo (in this process: a process of its own cost 5 s more of imports and first-export
    setup), then what a rerun into the same folder meets: every folder and file it wrote is one its
    command takes back (none refused as a user's), and every hash verifies. (Running the demo twice
    proved the same at twice the cost, half a minute of CI.)"""
    from k3export.artifacts import EXPORT, REPLAY, REPORT, OutputDir, OutputFile
    from k3export.check.driver import CHECK_DIR

    demo = tmp_path / "demo"
    assert main(["demo", "--steps", "4", "--out", str(demo)]) == 0
    printed, errors = capfd.readouterr()  # the file descriptors: TensorRT's own C++ logging too
    assert "relative error" in printed and "(ok)" in printed
    assert ("6 KDAChunkRecurrence, 6 KDAPrepare, 3 LatentMLACombine, 3 LatentMLASplits, 8 RoutedExpertsDown, "
            "8 RoutedExpertsGateUp, 8 RoutedExpertsGroup nodes") in printed
    assert "PASSED (float32" in printed
    assert (demo / "export" / "model.onnx").exists()
    report = demo / "report"
    assert (report / "report.md").read_text().startswith("# k3export check --onnx")
    assert (report / "layers.png").exists() and "first divergent: none" in printed
    # A rerun's commands check their outputs first, as here: export, check's own folder, the report.
    OutputDir(demo / "export", EXPORT)
    OutputDir(demo / "export" / CHECK_DIR, REPLAY, overwrite=None)
    OutputDir(report, REPORT, overwrite=None, option="--report")
    assert main(["verify", str(demo / "export")]) == 0
    # One stream, as `2>&1 | cat` makes it: the result line before the timing line (stdout flushed;
    # block-buffered, as it is in a pipe unless PYTHONUNBUFFERED is set).
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    verify = [sys.executable, "-m", "k3export.cli", "verify", str(demo / "export")]
    merged = subprocess.run(verify, env=buffered, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=60).stdout
    last = merged.splitlines()[-2:]
    assert last[0].endswith("every sha256 matches") and last[1].startswith("(verify took")
    if importlib.util.find_spec("tensorrt_rtx"):
        assert f"$ k3export check --network {demo / 'export'}" in printed
        OutputFile(demo / "k3-tiny.sm89.engine", "build")
        # TensorRT's own warnings are held back and counted, not printed amid the demo's lines.
        assert "[TRT]" not in printed + errors and "Int64 binding" not in printed
        assert re.search(r"\(TensorRT: [1-9]\d* warnings, \d+ info messages held back", errors)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="TensorRT-RTX is not installed")
def test_tensorrt_messages_reach_the_logger_not_stdout(tmp_path, capfd, caplog):
    """A graph with an int64 input makes the parser warn ("Make sure input x has Int64 binding"):
    the warning goes to the "k3export.tensorrt" logger at DEBUG (what --verbose shows) and is counted
    when not shown; nothing reaches the C stdout."""
    import onnx
    from onnx import TensorProto, helper

    from k3export.engine import trt_log
    from k3export.engine.build import parse
    from k3export.engine.flavours import load_tensorrt

    x = helper.make_tensor_value_info("x", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [2])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    trt = load_tensorrt()
    trt_log.held_back.clear()
    parse(tmp_path / "m.onnx", trt, trt_log.tensorrt_logger(trt))
    assert trt_log.held_back["warning"] >= 1
    with caplog.at_level(logging.DEBUG, logger="k3export.tensorrt"):
        parse(tmp_path / "m.onnx", trt, trt_log.tensorrt_logger(trt))
    warned = [r for r in caplog.records if r.levelno == logging.DEBUG and "Int64 binding" in r.getMessage()]
    assert warned and warned[0].getMessage().startswith("TensorRT warning: ")
    assert "Int64 binding" not in capfd.readouterr().out


def test_a_closed_stdout_ends_the_command_quietly():
    """`k3export plan ... | head`: the reader gone before the plan is printed ends the command as
    SIGPIPE would (exit 141), with no traceback and no "internal error"; `python -m k3export` is the
    same command."""
    command = [sys.executable, "-m", "k3export", "plan", "--preset", "kimi-k3", "--stages", "16"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the plan (seconds of work) is written
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "internal error" not in err
