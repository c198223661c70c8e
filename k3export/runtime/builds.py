"""A `k3export build RECIPE` folder held to its manifest, and its stages' export folders in order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from k3export.artifacts import BUILD, BUILD_MANIFEST, Artifact, read_manifest, require, verify
from k3export.errors import UserError
from k3export.onnx.export import MANIFEST_FILE


def _check_rank(build_dir: Path, stage: dict[str, Any], rank: dict[str, Any], ranks: int) -> None:
    """Refuses, naming the stage and rank, a rank folder that is missing or whose export.json is
    another rank's (another rank, rank count or layers: a folder moved or copied in)."""
    where = f"{build_dir / BUILD_MANIFEST}: stage {stage['index']} rank {rank['rank']}"
    export_json = build_dir / rank["folder"] / MANIFEST_FILE
    if not export_json.parent.is_dir():
        raise UserError(f"{where}: its folder {export_json.parent} is missing; build the stage again "
                        f"(k3export build RECIPE --stage {stage['index']})")
    try:
        export = json.loads(export_json.read_text())
        held = (export["parallel"]["rank"], export["parallel"]["ranks"], export["layers"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{where}: {export_json} is missing or not a rank's export.json (no 'parallel' "
                        "rank and ranks); build the stage again") from None
    expected = (rank["rank"], ranks, stage["layers"])
    if held != expected:
        raise UserError(f"{where}: {export_json} is rank {held[0]} of {held[1]} over layers {held[2]}, "
                        f"expected rank {expected[0]} of {expected[1]} over layers {expected[2]}: ranks of "
                        "different builds are mixed; build the stage again")


def verify_build(build_dir: str | Path, full: bool = False) -> dict[str, Any]:
    """Holds a `k3export build RECIPE` folder to its manifest (artifacts.verify, `full`: every file
    hashed), each rank folder of a split stage first checked to be there and to be that rank's;
    a problem names the stage and rank. Returns the manifest."""
    build_dir = Path(build_dir)
    manifest = read_manifest(build_dir, BUILD_MANIFEST)
    require(manifest, build_dir / BUILD_MANIFEST, "stages")
    parts = {}
    try:
        for stage in manifest["stages"]:
            if not stage.get("files"):
                continue
            for rank in stage.get("ranks", []):
                _check_rank(build_dir, stage, rank, len(stage["ranks"]))
                parts[f"{rank['folder']}/"] = f"stage {stage['index']} rank {rank['rank']}"
            if "ranks" not in stage:
                parts[f"{stage['folder']}/"] = f"stage {stage['index']}"
    except (KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{build_dir / BUILD_MANIFEST}: a stage entry lacks {e} or is not an object; the "
                        "folder is damaged or was written by another version of k3export, build it "
                        "again") from None
    return verify(build_dir, BUILD_MANIFEST, full, parts)


def stage_ranks(build_dir: str | Path) -> list[list[Path]]:
    """The export folders of a `k3export build RECIPE` folder, per stage its ranks' (one for a stage
    that is not split), in stage order, its files verified (verify_build)."""
    build_dir = Path(build_dir)
    manifest = verify_build(build_dir)
    Artifact(build_dir, BUILD, manifest).require_whole("")
    if manifest.get("settings", {}).get("no_weights"):
        raise UserError(f"{build_dir}: built with --no-weights; there are no numbers to run")
    return [[build_dir / r["folder"] for r in s.get("ranks", [s])] for s in manifest["stages"]]


def stage_exports(build_dir: str | Path) -> list[Path]:
    """The export folders of a build whose stages are not split, in stage order, files verified."""
    stages = stage_ranks(build_dir)
    ranks = len(stages[0])
    if ranks > 1:
        raise UserError(f"{build_dir}: every stage is split over {ranks} ranks ([parallel] ranks); run it "
                        f"with torchrun --nproc-per-node {ranks * len(stages)} -m k3export.runtime DIR")
    return [folders[0] for folders in stages]
