"""`k3export build RECIPE --out DIR`: one graph (and engine) per pipeline stage, built one at a time.

    DIR/manifest.json    the recipe and its sha256, the stages in order (layer ranges, files, I/O
                         specs, profiles), every file with sha256 and bytes, backend, target, versions
    DIR/stage-{i}/       model.onnx, model.onnx.data, config.json, export.json, and for a TensorRT
                         backend the engine stage-{i}.{target}.engine
    DIR/stage-{i}/rank-{r}/   the same for each rank r of a stage split by `[parallel] ranks = N`; the
                         stage's manifest entry lists its ranks' places ("stage", "rank", "folder"; no
                         GPU number: the runtime runs each process on its LOCAL_RANK's GPU)

With taps (`build RECIPE --taps`, or `taps = true` under the recipe's [build]) every stage's export
also outputs its layers' taps (export --taps), named by the model's layer indices (a stage over
layers 5..8 gives taps.5.* .. taps.8.*), for `check --build DIR --taps`; the runtime ignores them.
Taps are one of the manifest's settings, so a resume never mixes tapped and untapped stages.

With check's outputs (`build RECIPE --routing-outputs`, or `routing_outputs = true` under [build])
every stage's (and rank's) export also outputs its expert choices and a rank its partial sums (export
--routing-outputs), which `check --build DIR` reads, so that half-precision engines can be checked;
such engines are checking engines, not byte-identical to the served ones. One of the settings too.

Each stage loads only its own layers' weights (layer-range loading), and each rank of a split stage
only its slice of them (from a checkpoint; checkpoint.build_model), exports its graph, builds its
engine, and is dropped before the next starts, so peak memory follows the largest stage (or rank),
not the model. Stage folders are written through OutputDir (staged, renamed when complete) and the
manifest is rewritten after every stage, so a rerun skips each stage whose files still hash as the
manifest says (an interrupted build resumes) and rebuilds one whose files are missing or altered.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import gc
import importlib
import importlib.metadata
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from k3export.artifacts import (
    BUILD,
    BUILD_MANIFEST,
    MANIFEST_LOCK,
    STAGE,
    WRITTEN_BY,
    OutputDir,
    file_record,
    read_manifest,
    write_json,
)
from k3export.engine.flavours import FLAVOURS, load_tensorrt, require_machine, target_problem
from k3export.errors import UserError
from k3export.options import existing_file, non_negative_int
from k3export.progress import track
from k3export.shards.plan import Plan, plan_recipe
from k3export.shards.recipe import BACKENDS, Recipe, load_recipe
from k3export.weights.checkpoint import build_model

MANIFEST = BUILD_MANIFEST


def stage_folder(index: int) -> str:
    return f"stage-{index}"


def _versions(backend: str) -> dict[str, str]:
    import onnx

    from k3plugins.definitions import VERSION as PLUGIN_VERSION

    versions = {"torch": torch.__version__, "onnx": onnx.__version__, "k3export": importlib.metadata.version(
        "k3export"), "k3plugins_plugin_version": PLUGIN_VERSION}
    if backend in FLAVOURS:
        module = FLAVOURS[backend].module
        versions[module] = importlib.import_module(module).__version__
    return versions


def _settings(recipe: Recipe, backend: str, no_weights: bool, taps: bool, strip: bool,
              routing_outputs: bool) -> dict[str, Any]:
    """What decides a stage's files: a stage built under other settings is rebuilt."""
    # routing_outputs only when set, and the target only when --target overrides the recipe's (whose
    # sha256 covers its own), so that a build from before either option resumes as it was.
    overridden = recipe.target != recipe.data.get("build", {}).get("target")
    return {"recipe_sha256": recipe.sha256, "backend": backend, "no_weights": no_weights, "taps": taps,
            "strip": strip, **({"routing_outputs": True} if routing_outputs else {}),
            **({"target": recipe.target} if overridden else {})}


def _options(recipe: Recipe, backend: str, no_weights: bool, taps: bool, strip: bool,
             routing_outputs: bool) -> list[str]:
    """The options of `build RECIPE` that give these settings beyond the recipe's own: the manifest
    records them ("build_options") so that an incomplete build's refusal names the command that
    finishes it (k3export.artifacts.Artifact.require_whole)."""
    overridden = recipe.target != recipe.data.get("build", {}).get("target")
    given = {"--backend": backend if backend != recipe.backend else None,
             "--target": recipe.target if overridden else None, "--no-weights": no_weights,
             "--taps": taps and not recipe.taps,
             "--routing-outputs": routing_outputs and not recipe.routing_outputs, "--strip": strip}
    return [part for option, value in given.items() if value
            for part in ([option] if value is True else [option, value])]


def _unbuilt(plan: Plan, index: int) -> dict[str, Any]:
    """A stage's manifest entry before it is built: no files (so the build is not whole)."""
    layers = plan.stages[index].layers
    return {"index": index, "layers": [layers.start, layers.stop], "folder": stage_folder(index), "files": {}}


def _intact(out: Path, entry: dict[str, Any]) -> str | None:
    """None if every file the stage's manifest entry lists is there with its sha256, else why not."""
    if not entry.get("files"):
        return "not built"
    for name, record in entry["files"].items():
        path = out / name
        if not path.is_file():
            return f"{name} is missing"
        if file_record(path) != record:
            return f"{name} differs from {MANIFEST} (sha256)"
    return None


def _refuse_other_ranks(out: Path, recipe: Recipe) -> None:
    """Refuses to build into a folder built with another [parallel] ranks: its rank folders (or its
    unsplit stages) would be mixed with the new ones."""
    try:
        manifest = read_manifest(out, MANIFEST)
    except UserError:
        return  # none, or damaged: every stage is rebuilt
    recorded = manifest.get("recipe")  # the recipe's TOML as the folder was built from it
    built = recorded.get("parallel", {}).get("ranks", 1) if isinstance(recorded, dict) else 1
    if built != recipe.ranks:
        raise UserError(f"--out {out}: built with [parallel] ranks = {built} ({out / MANIFEST}), but "
                        f"{recipe.path} now says ranks = {recipe.ranks}; the ranks of the two builds would "
                        f"be mixed: build into a new folder, or delete {out} first")


def _previous(out: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The stage entries of the folder's manifest if it was built with the same settings."""
    if not (out / MANIFEST).is_file():
        return []
    try:
        manifest = read_manifest(out, MANIFEST)
    except UserError:
        return []  # damaged: every stage is rebuilt
    if manifest.get("settings") != settings:
        return []
    return manifest.get("stages") or []


def _release_exporter_graph() -> None:
    """Drops the last exported graph, which otherwise outlives the export with every weight of the
    stage: onnxscript's rewrite rules (torch.onnx's optimizer) keep their matcher's last graph, and
    that onnx_ir graph wraps the model's parameters (k3-small, a 259 MB stage: 252 MB held through
    the TensorRT-RTX build)."""
    gc.collect()
    try:
        from onnxscript.rewriter._matcher import SimplePatternMatcher
    except ImportError:  # another onnxscript: nothing known to clear
        return
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        matchers = [obj for obj in gc.get_objects() if isinstance(obj, SimplePatternMatcher)]
    for obj in matchers:
        for attr in ("_graph", "_match", "_current_node", "_tracer"):
            if hasattr(obj, attr):
                setattr(obj, attr, None)
    gc.collect()


def _build_export(recipe: Recipe, layers: range, name: str, rank: int, out: Path, backend: str,
                  no_weights: bool, taps: bool, strip: bool, overwrite: bool,
                  log: Callable[[str], None], routing_outputs: bool) -> dict[str, Any]:
    """Exports `layers` (rank `rank` of the recipe's ranks) into DIR/name and builds its engine; returns
    what the manifest records of it."""
    from k3export.engine.build import Limits, build_engine
    from k3export.onnx.export import MANIFEST_FILE, export_model

    # Without weights the graph still takes the recipe's expert format (MXFP4 inputs when packed).
    weights = {"stripped": True, **({"packed_experts": True} if recipe.packed_experts else {})} \
        if no_weights else recipe.weights
    model = build_model(recipe.config, getattr(torch, recipe.dtype), weights, layers, log=log, rank=rank,
                        ranks=recipe.ranks)
    folder = OutputDir(out / name, STAGE, overwrite=overwrite)
    result = None
    with folder.staged() as staged:
        export = export_model(model, staged, layers, weights, capacity=recipe.capacity, taps=taps,
                              routing_outputs=routing_outputs)
        # Free the stage's weights before the engine build: the parser holds its own copy.
        del model
        _release_exporter_graph()
        if backend in FLAVOURS:
            engine = staged / f"{name.replace('/', '.')}.{recipe.target}.engine"
            # Each profile its own ranges, as served; the cache capacity is the export's.
            limits = Limits(recipe.prefill_batch, recipe.prefill_seq, recipe.decode_batch, recipe.verify_seq)
            result = build_engine(staged, engine, load_tensorrt(backend), target=recipe.target, limits=limits,
                                  strip=strip, manifest=export)
    files = {f"{name}/{f}": record for f, record in folder.manifest["files"].items()}
    files[f"{name}/{MANIFEST_FILE}"] = file_record(out / name / MANIFEST_FILE)
    return {
        "folder": name, "graph": f"{name}/{export['graph']}",
        "engine": f"{name}/{Path(result.engine).name}" if result else None,
        "inputs": export["inputs"], "outputs": export["outputs"], "dtype": export["dtype"],
        "profiles": result.profiles if result else None,
        "device_memory": result.device_memory if result else None, "files": files,
    }


def _build_stage(recipe: Recipe, plan: Plan, index: int, out: Path, backend: str, no_weights: bool,
                 taps: bool, strip: bool, overwrite: bool, log: Callable[[str], None],
                 routing_outputs: bool) -> dict[str, Any]:
    """Exports stage `index` (and builds its engine) into DIR/stage-{index}, or with [parallel] ranks = N
    each rank into DIR/stage-{index}/rank-{r}, one after the other; returns its manifest entry."""
    stage = plan.stages[index]
    started = time.perf_counter()
    if recipe.ranks == 1:
        built = _build_export(recipe, stage.layers, stage_folder(index), 0, out, backend, no_weights, taps,
                              strip, overwrite, log, routing_outputs)
        built["seconds"] = round(time.perf_counter() - started, 1)
        return _stage_entry(plan, index, built)
    parts = [_build_export(recipe, stage.layers, rank_folder(index, r), r, out, backend, no_weights, taps,
                           strip, overwrite, log, routing_outputs) for r in range(recipe.ranks)]
    return _grid_entry(plan, index, parts, round(time.perf_counter() - started, 1))


def rank_folder(index: int, rank: int) -> str:
    return f"{stage_folder(index)}/rank-{rank}"


def _stage_entry(plan: Plan, index: int, built: dict[str, Any]) -> dict[str, Any]:
    stage = plan.stages[index]
    files = built.pop("files")
    return {"index": index, "layers": [stage.layers.start, stage.layers.stop], **built,
            "weight_bytes": stage.weight_bytes, "files": files}


def _grid_entry(plan: Plan, index: int, parts: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """A split stage's manifest entry from its ranks' records, in rank order."""
    # Every rank of a stage has the same feeds and outputs by name (its caches hold its heads).
    places = ("folder", "graph", "engine", "profiles", "device_memory")
    return _stage_entry(plan, index, {
        **parts[0], "folder": stage_folder(index), "graph": None, "engine": None,
        "ranks": [{"stage": index, "rank": r, **{k: p[k] for k in places}}
                  for r, p in enumerate(parts)],
        "seconds": seconds, "files": {name: record for p in parts for name, record in p["files"].items()}})


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Holds an exclusive lock on the build folder's manifest: the processes building one rank each
    (`build RECIPE --stage I --rank R`, one per GPU of a host) read and rewrite it in turn."""
    with open(out / MANIFEST_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_rank(recipe: Recipe, plan: Plan, index: int, rank: int, out: Path, backend: str,
                no_weights: bool, taps: bool, strip: bool, overwrite: bool, header: dict[str, Any],
                log: Callable[[str], None], routing_outputs: bool) -> dict[str, Any]:
    """Builds rank `rank` of stage `index` alone and records it: until every rank of the stage is
    there the stage's entry keeps them under "rank_builds" with no files (so the stage counts as not
    built); the last rank to finish assembles the entry a whole-stage build writes."""
    started = time.perf_counter()
    part = _build_export(recipe, plan.stages[index].layers, rank_folder(index, rank), rank, out, backend,
                         no_weights, taps, strip, overwrite, log, routing_outputs)
    part["seconds"] = round(time.perf_counter() - started, 1)
    with _locked(out):
        manifest = {**header, "stages": _previous(out, header["settings"]), "files": {}}
        stages = {e.get("index"): e for e in manifest["stages"]}
        for i in range(len(plan.stages)):  # entries for the stages no process has touched yet
            stages.setdefault(i, _unbuilt(plan, i))
        done = {**stages[index].get("rank_builds", {}), str(rank): part}
        if len(done) == recipe.ranks:
            parts = [done[str(r)] for r in range(recipe.ranks)]
            stages[index] = _grid_entry(plan, index, parts, max(p["seconds"] for p in parts))
        else:
            stages[index] = {**stages[index], "files": {}, "rank_builds": done}
        manifest["stages"] = [stages[i] for i in range(len(plan.stages))]
        manifest["files"] = {name: rec for e in manifest["stages"] for name, rec in e["files"].items()}
        write_json(out / MANIFEST, manifest)
    log(f"stage {index} rank {rank}: built; {len(done)} of {recipe.ranks} ranks of the stage recorded")
    return manifest


def build_recipe(recipe: Recipe, out: str | Path, *, backend: str | None = None, no_weights: bool = False,
                 taps: bool | None = None, strip: bool = False, only: list[int] | None = None,
                 rank: int | None = None, overwrite: bool = False,
                 log: Callable[[str], None] = print,
                 after_stage: Callable[[int], None] | None = None,
                 routing_outputs: bool | None = None) -> dict[str, Any]:
    """Builds the recipe's stages into `out` (all, or the indices in `only`), skipping stages whose
    files still match the manifest; `after_stage(i)` runs once stage i is recorded. `taps`: the
    stages export their layers' taps (default: the recipe's build.taps); `routing_outputs`: check's
    outputs (default: the recipe's build.routing_outputs). `rank`: only that rank of
    the one stage in `only` (a process per rank, any number at once on one folder). Returns the
    manifest."""
    backend = backend or recipe.backend
    taps = recipe.taps if taps is None else taps
    routing_outputs = recipe.routing_outputs if routing_outputs is None else routing_outputs
    # Everything this machine lacks, named at once, before any export or checkpoint read.
    checkpoint = [] if no_weights or recipe.checkpoint is None or recipe.checkpoint.is_dir() else [
        f"{recipe.path}: [weights] checkpoint = {recipe.data['weights']['checkpoint']!r}: no folder at "
        f"{recipe.checkpoint.resolve()} (download the checkpoint there, or build with --no-weights)"]
    if backend in FLAVOURS:
        problem = target_problem(FLAVOURS[backend], recipe.target)
        if problem:
            raise UserError(f"{recipe.path}: target {recipe.target!r} (its [build] target, or --target) "
                            f"with backend {backend!r}: expected {problem}")
        require_machine(FLAVOURS[backend], recipe.target, checkpoint, strip=strip)
    elif checkpoint:
        raise UserError(checkpoint[0])
    plan = plan_recipe(recipe)
    indices = range(len(plan.stages))
    bad = [i for i in only or [] if i not in indices]
    if bad:
        grid = f" (each split over {recipe.ranks} ranks; --stage I builds all of stage I's ranks, "\
            "--stage I --rank R one)" \
            if recipe.ranks > 1 else ""
        raise UserError(f"--stage {bad[0]}: expected a stage of {recipe.path}, "
                        f"0..{len(plan.stages) - 1}{grid}")
    if rank is not None and (recipe.ranks == 1 or len(only or []) != 1 or rank >= recipe.ranks):
        raise UserError(f"--rank {rank}: expected one --stage I and a rank 0..{recipe.ranks - 1} of "
                        f"{recipe.path}'s [parallel] ranks = {recipe.ranks}" if recipe.ranks > 1 else
                        f"--rank {rank}: {recipe.path} does not split its stages ([parallel] ranks = 1)")
    out = Path(out)
    # A killed run leaves a staging folder behind; it is ours (in rank mode only this rank's: the
    # other ranks' processes may be writing theirs), so clear it before the check.
    patterns = [f"{rank_folder(only[0], rank)}/.k3export-stage-*"] if rank is not None else \
        ["stage-*/.k3export-stage-*", "stage-*/rank-*/.k3export-stage-*"]
    for stale in [path for pattern in patterns for path in out.glob(pattern)]:
        shutil.rmtree(stale, ignore_errors=True)
    OutputDir(out, BUILD, overwrite=overwrite)  # refuses a folder holding a user's files
    _refuse_other_ranks(out, recipe)
    settings = _settings(recipe, backend, no_weights, taps, strip, routing_outputs)
    manifest: dict[str, Any] = {
        "written_by": WRITTEN_BY, "command": "build", "recipe_file": str(recipe.path),
        "recipe_sha256": recipe.sha256, "recipe": recipe.data, "settings": settings,
        "backend": backend, "target": recipe.target if backend != "onnx" else None,
        "dtype": recipe.dtype, "taps": taps, "cache": {"capacity": recipe.capacity, "batch": recipe.batch},
        "profiles": {"prefill": {"batch": recipe.prefill_batch, "seq": recipe.prefill_seq},
                     "decode": {"batch": recipe.decode_batch},
                     **({"verify": {"batch": recipe.decode_batch, "seq": recipe.verify_seq}}
                        if recipe.verify_seq else {})},
        "versions": _versions(backend), "stages": [], "files": {},
        "build_options": _options(recipe, backend, no_weights, taps, strip, routing_outputs),
    }
    if rank is not None:
        return _build_rank(recipe, plan, only[0], rank, out, backend, no_weights, taps, strip, overwrite,
                           manifest, log, routing_outputs)
    # Every stage is in the manifest from the start (those not reached yet as they were, or unbuilt),
    # so that a build stopped between stages is never taken for a whole one of fewer stages.
    previous = {e.get("index"): e for e in _previous(out, settings)}
    manifest["stages"] = [previous[i] if previous.get(i, {}).get("layers") == _unbuilt(plan, i)["layers"]
                          else _unbuilt(plan, i) for i in range(len(plan.stages))]
    for i, stage in track(enumerate(plan.stages), "build: stages", total=len(plan.stages)):
        layers = [stage.layers.start, stage.layers.stop]
        entry = manifest["stages"][i]
        problem = _intact(out, entry)
        if problem is None:
            log(f"stage {i} (layers {layers[0]}..{layers[1] - 1}): up to date, skipped")
        elif only is not None and i not in only:
            entry = _unbuilt(plan, i)
        else:
            log(f"stage {i} (layers {layers[0]}..{layers[1] - 1}, {stage.weight_bytes / 1e9:.3g} GB of "
                f"weights): {problem}, building ({backend})")
            entry = _build_stage(recipe, plan, i, out, backend, no_weights, taps, strip, overwrite, log,
                                 routing_outputs)
            gc.collect()
        manifest["stages"][i] = entry
        manifest["files"] = {name: rec for e in manifest["stages"] for name, rec in e["files"].items()}
        write_json(out / MANIFEST, manifest)
        if after_stage is not None:
            after_stage(i)
    return manifest


def cmd_build_recipe(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    given = (("--strip", args.strip), ("--target", args.target is not None))
    engine_only = [option for option, present in given if present]
    if (args.backend or recipe.backend) == "onnx" and engine_only:
        raise UserError(f"build --backend onnx {engine_only[0]}: an ONNX build has no engines, which "
                        f"{engine_only[0]} is for; expected --backend tensorrt-rtx or tensorrt with it")
    if args.target is not None:  # instead of the recipe's [build] target, as --backend is for its backend
        recipe = dataclasses.replace(recipe, target=args.target)
    manifest = build_recipe(recipe, args.out, backend=args.backend, no_weights=args.no_weights,
                            taps=True if args.taps else None, strip=args.strip, only=args.stage,
                            rank=args.rank, overwrite=args.overwrite,
                            routing_outputs=True if args.routing_outputs else None)
    built = [s for s in manifest["stages"] if s["files"]]
    size = sum(r["bytes"] for r in manifest["files"].values())
    print(f"wrote {args.out}/{MANIFEST}: {len(built)} of {len(manifest['stages'])} stages "
          f"({manifest['backend']}{', with taps' if manifest['taps'] else ''}"
          f"{', with check outputs' if manifest['settings'].get('routing_outputs') else ''}), "
          f"{size / 1e6:.1f} MB in {len(manifest['files'])} files")
    return 0


def add_build_arguments(build: argparse.ArgumentParser) -> None:
    """The sharded form of `k3export build`: a recipe instead of --onnx."""
    build.add_argument("recipe", nargs="?", metavar="RECIPE", type=existing_file,
                       help="a recipe (engines/*.toml): build every pipeline stage into --out DIR")
    build.add_argument("--backend", choices=BACKENDS, help="with RECIPE: instead of the recipe's backend "
                       "(onnx stops after the export); with --onnx DIR: tensorrt-rtx (the default) or "
                       "tensorrt (full TensorRT, on a machine with the target GPU)")
    build.add_argument("--no-weights", action="store_true",
                       help="with RECIPE: graphs at real shapes, the weights as inputs (no checkpoint read)")
    build.add_argument("--taps", action="store_true",
                       help="with RECIPE: every stage exports its layers' taps too (as export --taps; or "
                       "taps = true under the recipe's [build]), for `check --build DIR --taps`")
    build.add_argument("--routing-outputs", action="store_true",
                       help="with RECIPE: every stage (and rank) exports check's outputs too (as export "
                       "--routing-outputs: expert choices, and a rank's partial sums; or routing_outputs = "
                       "true under the recipe's [build]), for `check --build DIR` of half-precision "
                       "engines; such checking engines are not byte-identical to served ones")
    build.add_argument("--stage", type=non_negative_int, action="append", metavar="I",
                       help="with RECIPE: build only stage I (repeatable); the others keep what they have")
    build.add_argument("--rank", type=non_negative_int, metavar="R",
                       help="with RECIPE and one --stage I of a split stage: build only its rank R, a "
                       "process a rank (a host runs its 8 at once into one --out folder, each with "
                       "CUDA_VISIBLE_DEVICES=R)")
    build.add_argument("--overwrite", action="store_true",
                       help="with RECIPE: write into a folder that holds other files (they are kept)")
