"""What a folder is, and who may replace it (k3export/artifacts.py's KINDS), on real folders: an
export (with check's replay folder in it), a build stopped by Ctrl-C between its stages (k3-tiny in
2 stages, the first of 1 layer so that it builds in seconds), a check report, an engine file with
its record, and the manifest state a grid build leaves with one rank of a stage built. Every refusal
exits 2 before anything runs, names the folder, what it holds and the command that takes it, and
leaves every file byte for byte."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from k3export.artifacts import BUILD, EXPORT, REPLAY, REPORT, OutputDir, OutputFile, identify, sha256
from k3export.cli import main
from k3export.errors import UserError
from k3export.runtime import Pipeline, Sampler, generate
from k3export.runtime.__main__ import main as runtime_main
from k3export.shards.recipe import load_recipe
from k3export.shards.stages import build_recipe

TINY = Path(__file__).resolve().parents[1] / "engines/k3-tiny.toml"


def interrupt(index: int) -> None:
    raise KeyboardInterrupt  # what Ctrl-C (SIGINT) raises, here once stage `index` is recorded


@pytest.fixture(scope="module")
def paths(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kinds")
    export = Path(shutil.copytree(tiny_export, root / "export"))
    recipe = root / "recipe.toml"
    recipe.write_text(TINY.read_text().replace("count = 2", "ranges = [[0, 1], [1, 9]]"))
    half = root / "half"
    with pytest.raises(KeyboardInterrupt):
        build_recipe(load_recipe(recipe), half, backend="onnx", after_stage=interrupt, log=lambda _: None)
    manifest = json.loads((half / "manifest.json").read_text())
    assert [bool(s["files"]) for s in manifest["stages"]] == [True, False]  # every stage, from the start
    assert main(["check", "--onnx", str(export), "--steps", "1", "--prompt-len", "3", "--report",
                 str(root / "report")]) == 0  # also writes check's replay folder, export/check
    # What `build RECIPE --stage 1 --rank 0` leaves on a 2-rank recipe until rank 1 is built too.
    grid = Path(shutil.copytree(half, root / "grid"))
    manifest = json.loads((grid / "manifest.json").read_text())
    manifest["recipe"]["parallel"] = {"ranks": 2}
    manifest["stages"][1]["rank_builds"] = {"0": {"folder": "stage-1/rank-0"}}
    (grid / "manifest.json").write_text(json.dumps(manifest))
    # What an export killed while its files move in leaves (test_bad_input kills real ones there):
    # its journal, and no manifest.
    interrupted = Path(shutil.copytree(tiny_export, root / "interrupted"))
    files = json.loads((interrupted / "export.json").read_text())["files"]
    (interrupted / ".k3export-journal.json").write_text(json.dumps(
        {"written_by": "k3export", "kind": EXPORT.name, "files": [*files, "export.json"]}))
    (interrupted / "export.json").unlink()
    engine = OutputFile(root / "tiny.sm89.engine", "build")  # as `build --onnx` records one
    engine.begin()
    engine.path.write_bytes(b"an engine's bytes")
    engine.finish({"export": str(export)})
    named = {"root": root, "export": export, "half": half, "report": root / "report", "grid": grid,
             "engine": engine.path, "recipe": recipe, "interrupted": interrupted}
    return {f"{{{name}}}": str(path) for name, path in named.items()}


def snapshot(root: Path) -> dict[str, str]:
    """Every file below `root` (hidden ones too) by its sha256."""
    return {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def fill(text: str, paths: dict[str, str]) -> str:
    for name, path in paths.items():
        text = text.replace(name, path)
    return text


def refused(paths: dict[str, str], argv: list[str], *culprits: str) -> None:
    """`k3export ARGV` (`runtime`: the torchrun entry's) exits 2 naming every culprit, no traceback,
    every file under the fixture's folder byte for byte as it was."""
    argv = [fill(a, paths) for a in argv]
    root = Path(paths["{root}"])
    before = snapshot(root)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = runtime_main(argv[1:]) if argv[0] == "runtime" else main(argv)
        except SystemExit as e:  # the runtime's parser
            code = e.code
    printed = " ".join(err.getvalue().split())
    assert code == 2 and "Traceback" not in printed, (code, printed[-2000:])
    for culprit in culprits:
        assert fill(culprit, paths) in printed, (culprit, printed[-2000:])
    assert snapshot(root) == before


@pytest.mark.parametrize("argv, culprits", [
    # The cases: the export being checked, a build, and an export written over a build.
    (["check", "--onnx", "{export}", "--steps", "1", "--report", "{export}"],
     ["--report {export}: holds an export", "written by `k3export export --out DIR`"]),
    (["check", "--onnx", "{export}", "--report", "{half}"],
     ["--report {half}: holds a build", "`k3export build RECIPE --out DIR`"]),
    (["export", "--preset", "k3-tiny", "--out", "{half}"], ["--out {half}: holds a build"]),
    (["check", "--onnx", "{export}", "--report", "{export}/mine"],
     ["inside {export}, the artifact being checked"]),
    (["check", "--onnx", "{export}", "--report", "{root}"], ["export/ (an export, k3export's)"]),
    (["check", "--onnx", "{export}", "--report", "{engine}"], ["holds an engine"]),
    (["export", "--preset", "k3-tiny", "--out", "{half}/stage-0"], ["a stage of a build (an export)"]),
    (["export", "--preset", "k3-tiny", "--out", "{report}", "--overwrite"], ["holds a check report"]),
    (["export", "--preset", "k3-tiny", "--out", "{export}/check"], ["holds check's replay folder"]),
    (["build", "{recipe}", "--backend", "onnx", "--out", "{export}"], ["--out {export}: holds an export"]),
    (["build", "{recipe}", "--backend", "onnx", "--out", "{half}/stage-0"], ["a stage of a build"]),
    (["build", "{recipe}", "--backend", "onnx", "--out", "{report}", "--overwrite"],
     ["holds a check report"]),
    (["demo", "--out", "{export}"], ["--out {export}: is an export"]),
    (["check", "--onnx", "{export}", "--report", "{interrupted}"],
     ["holds an interrupted write of an export"]),
    (["build", "{recipe}", "--backend", "onnx", "--out", "{root}"], ["interrupted/ (an export, k3export's)"]),
])
def test_an_output_folder_is_replaced_only_by_the_command_that_wrote_it(paths, argv, culprits):
    refused(paths, argv, *culprits)


def test_each_kind_is_taken_back_by_its_own_command(paths):
    """What a rerun meets (its own kind, parts included) is accepted, and an engine's file name is
    never one of another output's files, --overwrite or not."""
    export = Path(paths["{export}"])
    assert {"check/check.json", "model.onnx"} <= OutputDir(export, EXPORT).owned  # check/ goes with it
    OutputDir(export / "check", REPLAY, overwrite=None)
    assert "model.onnx" in OutputDir(paths["{interrupted}"], EXPORT).owned  # the rerun finishes it
    OutputDir(paths["{report}"], REPORT, overwrite=None)
    assert "stage-0/model.onnx" in OutputDir(paths["{half}"], BUILD).owned
    assert identify(paths["{engine}"]).manifest["export"] == str(export)
    for name in ("export", "model.onnx"):  # its record would be export.json; the graph itself
        with pytest.raises(UserError, match="is a file of an export"):
            OutputFile(export / name, "build", overwrite=True)


@pytest.mark.parametrize("argv", [
    ["run", "{half}"], ["runtime", "{half}"], ["check", "--build", "{half}"],
    ["check", "--build", "{half}", "--stage", "0"], ["check", "--engine", "{half}"], ["verify", "{half}"],
    ["plan", "{half}"],
])
def test_a_build_stopped_between_stages_is_refused_naming_what_finishes_it(paths, argv):
    refused(paths, argv, "{half}: an incomplete build: stage 1 of its 2 stages not built",
            "`k3export build {recipe} --backend onnx --out {half}`")


@pytest.mark.parametrize("argv", [["run", "{grid}"], ["check", "--build", "{grid}", "--stage", "1"]])
def test_a_stage_with_ranks_missing_is_refused_naming_them(paths, argv):
    refused(paths, argv, "stage 1 rank 1 of its 2 stages not built")


@pytest.mark.parametrize("argv, culprits", [
    (["run", "{export}"], ["{export} is an export", "check --onnx DIR", "expected a build"]),
    (["check", "--build", "{export}"], ["{export} is an export"]),
    (["check", "--engine", "{export}"], ["{export} is an export"]),
    (["check", "--onnx", "{half}"], ["{half} is a build", "check --build DIR", "expected an export"]),
    (["check", "--network", "{half}"], ["{half} is a build"]),
    (["build", "--onnx", "{half}", "--out", "{root}/new.engine"], ["{half} is a build"]),
    (["check", "--onnx", "{engine}"], ["{engine} is an engine", "check --engine FILE"]),
    (["check", "--onnx", "{report}"], ["{report} is a check report"]),
    (["run", "{report}"], ["{report} is a check report"]),
    (["check", "--build", "{export}/check"], ["is check's replay folder"]),
    (["plan", "{half}"], ["{half} is a build", "expected a RECIPE file; it was built from {recipe}"]),
])
def test_the_wrong_kind_is_named_with_what_reads_it(paths, argv, culprits):
    refused(paths, argv, *culprits)


def test_a_pipeline_without_its_last_stage_samples_nothing(paths):
    pipeline = Pipeline([Path(paths["{half}"]) / "stage-0"])  # was KeyError: 'logits' (exit 3)
    with pytest.raises(UserError, match="gives no logits"):
        generate(pipeline, [[1, 2, 3]], 2, Sampler())
    pipeline.close()


def test_a_check_that_compared_nothing_fails_with_its_reason():
    from k3export.check.driver import compared_nothing

    compared = [{"outputs": [{"name": "attn_res.5.partial"}]}]
    assert compared_nothing([{"outputs": []}], 0, False) == "no output was compared"
    assert "0 greedy token positions" in compared_nothing(compared, 0, True)
    assert compared_nothing(compared, 0, False) is None  # a layer range: its boundaries are compared
    assert compared_nothing(compared, 4, True) is None


def test_plans_unsplit_table_is_labelled_when_a_split_follows(monkeypatch, capsys):
    """`plan` with ranks: its first table (each stage whole on one GPU) says so, and a stage too large
    for one GPU there reads "no, unsplit", not an alarming NO (here every stage is too large: an H200
    of 1 byte)."""
    import k3export.shards.plan

    monkeypatch.setattr(k3export.shards.plan, "H200_BYTES", 1)
    tables = {}
    for ranks in ("1", "2"):
        assert main(["plan", "--preset", "k3-tiny", "--stages", "2", "--ranks", ranks]) == 0
        tables[ranks] = capsys.readouterr().out.split("\n\n")[1]  # the first table, after the header
    assert [line.endswith("  NO") for line in tables["1"].splitlines()[1:]] == [True, True]
    assert tables["2"].startswith("each stage unsplit, whole on one GPU (for reference: it is served split "
                                  "over 2 GPUs")
    assert [line.endswith("  no, unsplit") for line in tables["2"].splitlines()[2:]] == [True, True]
