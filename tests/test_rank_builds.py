"""`build RECIPE --stage I --rank R`: one rank a process, several at once into one folder (as a host
builds its 8 ranks on its 8 GPUs), recorded in one manifest under a lock; and its refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_parallel_grid import short_recipe

from k3export.artifacts import BUILD, OutputDir
from k3export.cli import main
from k3export.runtime import verify_build
from k3export.shards.stages import MANIFEST, _intact

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "engines/k3-tiny-2x2.toml"  # 2 stages x 2 ranks


def build_rank(recipe: Path, out: Path, stage: int, rank: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "k3export.cli", "build", str(recipe), "--out", str(out),
                             "--backend", "onnx", "--stage", str(stage), "--rank", str(rank)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_ranks_built_by_concurrent_processes(tmp_path: Path) -> None:
    """Three processes at once: both ranks of stage 0 and rank 1 of stage 1. Each rank's record
    survives the others' rewrites of the manifest; stage 0 is complete, stage 1 not (a whole build
    rebuilds it). The 2 x 2 recipe on a 3-layer k3-tiny: what is proven is the manifest's, not the graphs'."""
    recipe, out = short_recipe(tmp_path, "float32", 2, 2), tmp_path / "grid"
    processes = [build_rank(recipe, out, 0, 1), build_rank(recipe, out, 1, 1), build_rank(recipe, out, 0, 0)]
    for p in processes:
        output = p.communicate(timeout=300)[0]
        assert p.returncode == 0, output
    manifest = json.loads((out / MANIFEST).read_text())
    complete, partial = manifest["stages"]
    # The entry a whole-stage build writes, its ranks in order.
    assert [r["rank"] for r in complete["ranks"]] == [0, 1] and "rank_builds" not in complete
    assert _intact(out, complete) is None
    for r in (0, 1):
        export = json.loads((out / f"stage-0/rank-{r}/export.json").read_text())
        assert export["parallel"]["rank"] == r and export["parallel"]["ranks"] == 2
    assert partial["files"] == {} and list(partial["rank_builds"]) == ["1"]
    assert _intact(out, partial) == "not built"
    verify_build(out, full=True)
    # The folder stays one that build wrote (its lock file is k3export's): the next rank may start.
    OutputDir(out, BUILD)


@pytest.mark.parametrize(("recipe", "options", "message"), [
    (GRID, ["--rank", "0"], "expected one --stage I and a rank 0..1"),
    (GRID, ["--stage", "0", "--stage", "1", "--rank", "0"], "expected one --stage I"),
    (GRID, ["--stage", "0", "--rank", "2"], "a rank 0..1"),
    (ROOT / "engines/k3-tiny.toml", ["--stage", "0", "--rank", "0"], "does not split its stages"),
])
def test_rank_refusals(tmp_path: Path, capsys, recipe: Path, options: list[str], message: str) -> None:
    out = tmp_path / "b"
    assert main(["build", str(recipe), "--out", str(out), "--backend", "onnx", *options]) == 2
    assert message in capsys.readouterr().err and not out.exists()
