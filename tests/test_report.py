"""check --report DIR: report.json, report.md and the plots, their series checked against the
report's own numbers recomputed here."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from k3export.artifacts import verify
from k3export.check.driver import run_check
from k3export.check.machine import peak_memory
from k3export.cli import main
from k3export.onnx.taps import SUBLAYERS

STEPS = 2


@pytest.fixture(scope="module")
def taps_report(taps_export, tmp_path_factory):
    folder = tmp_path_factory.mktemp("report") / "r"
    code = main(["check", "--onnx", str(taps_export), "--taps", "--steps", str(STEPS), "--prompt-len", "12",
                 "--report", str(folder)])
    assert code == 0
    return folder


def test_report_files_are_written_and_valid(taps_report):
    verify(taps_report, "check.json", full=True)  # every file listed with its sha256
    assert sorted(p.name for p in taps_report.iterdir() if not p.name.startswith(".")) == [
        "check.json", "layers.png", "report.json", "report.md", "steps.png"]
    for name in ("layers.png", "steps.png"):
        with Image.open(taps_report / name) as image:
            assert image.format == "PNG" and image.width > 300 and image.height > 200
            image.verify()
    report = json.loads((taps_report / "report.json").read_text())
    assert report["passed"] and report["verdict"].startswith("PASSED")
    md = (taps_report / "report.md").read_text().splitlines()
    assert md[0].startswith("# k3export check --onnx") and md[2].startswith("**PASSED")
    sections = [line for line in md if line.startswith("## ")]
    assert sections[:4] == ["## Headroom and machine", "## Worst outputs", "## First divergent layer",
                            "## Taps per layer (worst over the steps)"]
    # The headroom row: the worst output over its bound, recomputed from the per-step comparisons.
    worst = max((c for s in report["steps"] for c in s["outputs"]), key=lambda c: c["rel"] / c["bound"])
    row = next(line for line in md if line.startswith("| worst relative error over its bound |"))
    assert f"| {worst['rel'] / worst['bound']:.3f} | {worst['name']} at " in row
    assert any(line.startswith("ran on: ") and report["machine"]["cpu"] in line for line in md)


def test_plotted_series_hold_the_report_numbers(taps_report):
    """One point per layer (9) and per step (prefill + STEPS), with the values recomputed from the
    per-step comparisons in report.json: prefill as is, decode the largest over the decode steps."""
    report = json.loads((taps_report / "report.json").read_text())
    layers = report["plots"]["layers"]
    for phase in ("prefill", "decode"):
        steps = [s for s in report["taps"]["steps"] if (s["step"] == "prefill") == (phase == "prefill")]
        assert len(steps) == (1 if phase == "prefill" else STEPS)
        for sublayer in SUBLAYERS:
            expected = {}
            for step in steps:
                for tap in step["taps"]:
                    if tap["sublayer"] == sublayer:
                        expected[tap["layer"]] = max(expected.get(tap["layer"], 0.0), tap["rel"])
            drawn = layers[phase][sublayer]
            assert drawn["x"] == list(range(9))
            assert drawn["y"] == pytest.approx([expected[i] for i in range(9)], rel=1e-12)
    logits = [next(c["rel"] for c in s["outputs"] if c["name"] == "logits") for s in report["steps"]]
    drawn = report["plots"]["steps"]
    assert drawn["logits"]["y"] == pytest.approx(logits, rel=1e-12) and len(logits) == STEPS + 1
    assert drawn["bound"]["y"] == [report["tolerance"]["rel"]] * (STEPS + 1)
    assert drawn["labels"] == ["prefill", *(f"decode {i}" for i in range(1, STEPS + 1))]


def test_report_without_taps_plots_the_layers_caches(tiny_export, tmp_path):
    folder = tmp_path / "r"
    assert main(["check", "--onnx", str(tiny_export), "--steps", "1", "--prompt-len", "8",
                 "--report", str(folder)]) == 0
    report = json.loads((folder / "report.json").read_text())
    prefill = report["steps"][0]["outputs"]
    expected = [max(c["rel"] for c in prefill if c["name"].startswith(f"present.{i}.")) for i in range(9)]
    assert report["plots"]["layers"]["prefill"]["caches"]["y"] == pytest.approx(expected, rel=1e-12)
    assert "Not localised" in (folder / "report.md").read_text()


def test_report_folder_of_foreign_files_is_refused_before_the_check(tiny_export, tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    assert main(["check", "--onnx", str(tiny_export), "--report", str(folder)]) == 2
    err = capsys.readouterr()
    assert f"--report {folder}" in err.err and "notes.txt" in err.err and "eager reference" not in err.out
    assert "--overwrite" not in err.err  # check has no such option


def test_the_eager_sides_peak_is_its_own(tiny_export):
    """The report's eager peak is the process's high-water mark from the eager side's start, not
    before it: 600 MB held and freed before the check (as an artifact's memory is) is not in it."""
    resident = np.ones(600_000_000 // 8)  # every page written: resident
    held = peak_memory()
    del resident
    report = run_check(tiny_export, steps=1, prompt_len=8, log=lambda _: None)
    assert 0 < report["eager"]["peak_memory"] < held - 400e6
