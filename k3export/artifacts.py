"""Artifacts on disk: what each folder is, written whole or not at all, and replaced only by the
command that wrote it.

What a folder (or engine file) is, is decided here, once, by one table (KINDS): its manifest's name
and `command` give its kind, and the kind says which command alone replaces it and which options read
it. `identify` opens a path as an `Artifact` (its kind, its manifest, whether a build is whole), the
options' types (k3export.options.artifact_path) refuse a wrong kind by it, naming what was found and
the option that takes it, and `OutputDir` refuses to write over anything but its own kind.

Every file is written under a temporary name and renamed when complete, so an interrupted run
never leaves a half-written file at a final name. A command that writes a folder (`export`,
`build RECIPE`, `check`) goes through `OutputDir`: it writes only into a folder that is new,
empty, or holds that command's own previous output of the same kind, recognised by its manifest (a
JSON file whose `files` lists every file the tool wrote, with sha256 and bytes). Anything else is
refused before anything runs, naming what was found and the command that takes it; `--overwrite`
writes beside the user's files, and even then only files listed in the folder's own manifest (and
its parts': a build's stages, an export's check/) are removed. `verify` holds a folder to its
manifest before anything reads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from k3export.errors import UserError

BUILD_MANIFEST = "manifest.json"  # a `k3export build RECIPE` folder's
WRITTEN_BY = "k3export"
_STAGE_PREFIX = ".k3export-stage-"
# Lists the files being moved into place while a commit runs, so that a rerun after a kill
# mid-commit still knows them as ours.
_JOURNAL = ".k3export-journal.json"
# size and mtime of each file when it was last hashed: the fast path of `verify`.
_STAT_CACHE = ".k3export-verified.json"
# Serialises the processes that rewrite one manifest (a build's ranks, each its own process).
MANIFEST_LOCK = ".k3export-manifest.lock"
_OURS = (_JOURNAL, _STAT_CACHE, MANIFEST_LOCK)
# Tests kill the process at a named point of a commit (K3EXPORT_TEST_KILL_AT=point) to prove that
# a run killed anywhere leaves no incomplete file at a final name and that the rerun completes.
_KILL_AT = "K3EXPORT_TEST_KILL_AT"


@dataclass(frozen=True)
class Kind:
    """What a k3export folder (or engine file) is: found by its manifest, replaced only by `writer`."""

    name: str  # as messages name it: "an export"
    manifest: str  # its manifest's file name (an engine: the record FILE.json beside it)
    command: str  # the manifest's `command`: the subcommand that wrote it
    writer: str  # the command line that writes it, and alone replaces it
    readers: str  # the options that read it
    report: bool = False  # check.json: a --report folder (its manifest names the artifact checked)

    def matches(self, manifest: dict[str, Any]) -> bool:
        return manifest.get("command") == self.command and ("artifact" in manifest) == self.report


_EXPORT_READERS = "check --onnx DIR, check --network DIR and build --onnx DIR read it"
EXPORT = Kind("an export", "export.json", "export", "k3export export --out DIR", _EXPORT_READERS)
STAGE = Kind("a stage of a build (an export)", "export.json", "build",
             "k3export build RECIPE --out BUILD (the build it is part of)", _EXPORT_READERS)
BUILD = Kind("a build", BUILD_MANIFEST, "build", "k3export build RECIPE --out DIR",
             "run DIR, torchrun -m k3export.runtime DIR, check --build DIR and check --engine DIR read it")
REPORT = Kind("a check report", "check.json", "check", "k3export check ... --report DIR",
              "it is read as it is (report.md; k3export verify DIR)", report=True)
REPLAY = Kind("check's replay folder", "check.json", "check", "k3export check --onnx EXPORT (the export it "
              "lies in)", "polygraphy run reads it (check prints how)")
ENGINE = Kind("an engine", "FILE.json", "build", "k3export build --onnx DIR --out FILE",
              "check --engine FILE reads it")
# Every kind, in the order a folder is recognised: the first whose manifest is there and matches.
KINDS = (EXPORT, STAGE, BUILD, REPORT, REPLAY)
# Every manifest a k3export command writes; a folder holding one with `written_by` is ours.
MANIFEST_NAMES = tuple(dict.fromkeys(kind.manifest for kind in KINDS))
# The k3export folders a kind holds as its own parts, replaced with it: a build's stage (and rank)
# exports, the replay folder check writes into the export it checks.
PARTS = {BUILD: (STAGE, REPLAY), EXPORT: (REPLAY,), STAGE: (REPLAY,)}


def _manifest_at(path: Path) -> dict[str, Any] | None:
    """The JSON object at `path` if k3export wrote it (`written_by`), else None."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("written_by") == WRITTEN_BY else None


@dataclass
class Artifact:
    """A path k3export wrote, opened once: its kind and manifest (None when the manifest cannot be
    read: `verify` names the damage)."""

    path: Path
    kind: Kind
    manifest: dict[str, Any] | None

    def describe(self) -> str:
        """What it is, who writes it and what reads it, as messages name it."""
        kind = self.kind
        return f"{kind.name} ({kind.manifest}, written by `{kind.writer}`; {kind.readers})"

    def missing(self) -> list[str]:
        """A build's stages (and ranks of a split stage) not built yet, by name; [] when it is whole
        (or not a build). Every stage the plan has is in the manifest from the build's start, with no
        files until it is built; a split stage's ranks built so far are under "rank_builds"."""
        stages = (self.manifest or {}).get("stages")
        whole_entries = isinstance(stages, list) and all(isinstance(s, dict) for s in stages)
        if self.kind is not BUILD or not whole_entries:
            return []  # not a build, or a damaged one: verify_build names what is wrong with it
        ranks = (self.manifest.get("recipe") or {}).get("parallel", {}).get("ranks", 1)
        missing = []
        for stage in stages:
            if stage.get("files"):
                continue
            done = {int(r) for r in stage.get("rank_builds", {})}
            if done:
                missing += [f"stage {stage.get('index')} rank {r}" for r in range(ranks) if r not in done]
            else:
                missing.append(f"stage {stage.get('index')}" + (f" (its {ranks} ranks)" if ranks > 1 else ""))
        return missing

    def require_whole(self, option: str) -> None:
        """Refuses, naming what is missing and the command that finishes it, a build not yet whole
        (stopped between its stages, or built with --stage)."""
        missing = self.missing()
        if missing:
            stages = len(self.manifest["stages"])
            finish = " ".join(["k3export build", str(self.manifest.get("recipe_file", "RECIPE")),
                               *self.manifest.get("build_options", []), "--out", str(self.path)])
            raise UserError(f"{option}{self.path}: an incomplete build: {', '.join(missing)} of its {stages} "
                            f"stages not built (stopped between stages, or built with --stage); finish it "
                            f"with `{finish}` (the stages built are kept)")


def identify(path: str | Path) -> Artifact | None:
    """What k3export wrote at `path`: a folder by its manifest (KINDS), an engine by its record
    FILE.json; None for anything else. A manifest k3export cannot read (damaged, or not its own)
    still names the kind its file name is first in, with no manifest."""
    path = Path(path)
    if path.is_file():
        record = _manifest_at(path.with_name(f"{path.name}.json"))
        return Artifact(path, ENGINE, record) if record and record.get("command") == "build" else None
    if not path.is_dir():
        return None
    for name in MANIFEST_NAMES:
        if (path / name).is_file():
            manifest = _manifest_at(path / name)
            kinds = [k for k in KINDS if k.manifest == name]
            kind = next((k for k in kinds if manifest and k.matches(manifest)), kinds[0])
            return Artifact(path, kind, manifest)
    return None


def _test_kill_point(point: str) -> None:
    if os.environ.get(_KILL_AT) == point:
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yields a temporary path to write; renames it to `path` only if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, (json.dumps(data, indent=2) + "\n").encode())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    return {"sha256": sha256(path), "bytes": path.stat().st_size}


def read_manifest(folder: Path, name: str) -> dict[str, Any]:
    """A k3export manifest, or a UserError naming the file and what is wrong with it."""
    path = folder / name
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such file (is {folder} a k3export output folder?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e}); the folder is damaged, write it again") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise UserError(f"{path}: expected a k3export manifest (an object with a 'files' object)")
    return manifest


def require(manifest: dict[str, Any], path: Path, *keys: str) -> None:
    """Raises naming the manifest and the first of `keys` it lacks."""
    for key in keys:
        if key not in manifest:
            raise UserError(f"{path}: field '{key}' is missing; the folder is damaged or was written "
                            "by another version of k3export, write it again")


def _inside(folder: Path, name: str, manifest: Path) -> Path:
    """folder/name, refusing names that leave the folder (absolute, `..`, links out)."""
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise UserError(f"{manifest}: file entry {name!r}: expected a path inside {folder}")
    path = folder / rel
    if not path.resolve().is_relative_to(folder.resolve()):
        raise UserError(f"{manifest}: file entry {name!r} leads outside {folder} (a symbolic link?)")
    return path


def verify(folder: str | Path, manifest_name: str, full: bool = False,
           parts: dict[str, str] | None = None) -> dict[str, Any]:
    """Holds `folder` to its manifest: every listed file present, inside the folder, of its size and
    sha256. Files whose size and mtime match the last verification are not hashed again unless
    `full`; a changed file changes its mtime, so it is hashed and caught. `parts`: a sub-folder
    (`stage-1/rank-0/`) -> what it is (`stage 1 rank 0`), named first in a message about its files.
    Returns the manifest."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder")
    manifest = read_manifest(folder, manifest_name)
    stat_path = folder / _STAT_CACHE
    try:
        seen = {} if full else json.loads(stat_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        seen = {}
    verified = {}
    for name, record in manifest["files"].items():
        path = _inside(folder, name, folder / manifest_name)
        part = next((f"{what}: " for prefix, what in (parts or {}).items() if name.startswith(prefix)), "")
        if not path.is_file():
            raise UserError(f"{part}{path}: missing (listed in {folder / manifest_name}); write the folder "
                            "again")
        stat = path.stat()
        if not isinstance(record, dict) or stat.st_size != record.get("bytes"):
            raise UserError(f"{part}{path}: {stat.st_size} bytes, expected {record.get('bytes')} "
                            f"({folder / manifest_name}); the file is truncated or was changed")
        key = [stat.st_size, stat.st_mtime_ns]
        if seen.get(name) != key and sha256(path) != record.get("sha256"):
            raise UserError(f"{part}{path}: sha256 differs from {folder / manifest_name}; the file was "
                            "changed after it was written (or comes from another build), write the folder "
                            "again")
        verified[name] = key
    with contextlib.suppress(OSError):  # a read-only folder is verified all the same
        write_json(stat_path, verified)
    return manifest


def _outputs_below(folder: Path) -> list[tuple[PurePosixPath, Kind, set[str]]]:
    """Every k3export output in `folder` and below it (staging folders left out), outer ones first:
    where, its kind, and its files (relative to `folder`): its manifest and what that lists, or for
    one whose commit was interrupted, what its journal says was moving in."""
    by_name = {kind.name: kind for kind in KINDS}
    found = []
    for name in (*MANIFEST_NAMES, _JOURNAL):
        for path in folder.rglob(name):
            base = PurePosixPath(path.parent.relative_to(folder).as_posix())
            record = _manifest_at(path)  # one k3export cannot read is the user's file
            if record is None or any(part.startswith(_STAGE_PREFIX) for part in base.parts):
                continue
            if name == _JOURNAL:
                which, files = by_name.get(record.get("kind")), set(record.get("files") or [])
            else:
                which = next((k for k in KINDS if k.manifest == name and k.matches(record)), None)
                files = {name, *(record.get("files") or {})}
            if which is not None:
                found.append((base, which, {str(base / f) for f in files}))
    return sorted(found, key=lambda f: len(f[0].parts))


def _owned(folder: Path, kind: Kind) -> tuple[set[str], dict[str, str]]:
    """Files in `folder` (relative posix paths) that the command writing `kind` there may replace: the
    folder's own output of that kind and its parts' below it (PARTS: a build's stages, an export's
    check/), interrupted commits included. Also the other k3export output in it, by sub-folder
    ("reports": "a check report"; "." for an interrupted write of another kind): never replaced."""
    owned, others = set(_OURS), {}
    for base, which, files in _outputs_below(folder):
        if any(base.is_relative_to(PurePosixPath(other)) for other in others if other != "."):
            continue  # inside another output: its own
        if which is kind if not base.parts else which in PARTS.get(kind, ()):
            owned |= files
        else:
            others[base.as_posix()] = which.name if base.parts else f"an interrupted write of {which.name}"
    return owned, others


def _files(folder: Path) -> set[str]:
    """Every file below `folder` (relative posix paths), our staging folders, journals and stat
    caches left out at any depth (nested output folders have their own)."""
    names = (p.relative_to(folder) for p in folder.rglob("*") if p.is_file() or p.is_symlink())
    return {name.as_posix() for name in names
            if name.name not in _OURS and not any(part.startswith(_STAGE_PREFIX) for part in name.parts)}


def _listing(names: set[str], most: int = 5) -> str:
    shown = sorted(names)[:most]
    return ", ".join(shown) + (f" and {len(names) - most} more" if len(names) > most else "")


class OutputDir:
    """The folder a command writes (see the module docstring). Checks it at construction, before
    any heavy work; `staged()` yields an empty folder inside it to write into, and `commit` moves
    the files into place with the manifest last and removes what the old manifest listed."""

    def __init__(self, path: str | Path, kind: Kind, overwrite: bool | None = False,
                 option: str = "--out") -> None:
        """`kind`: what the command writes (KINDS); `option` names the folder in messages: the
        command-line option that gave it. `overwrite` None: the command has no --overwrite (a folder
        holding other files is only refused)."""
        self.path, self.kind, self.option = Path(path), kind, option
        self.manifest_name, self.command = kind.manifest, kind.command
        expected = f"expected a new or empty folder, or {kind.name} that `{kind.writer}` wrote"
        if self.path.exists() and not self.path.is_dir():
            found = identify(self.path)
            what = f"holds {found.describe()}" if found else "a file is there"
            raise UserError(f"{option} {self.path}: {what}; {expected}. Nothing was changed")
        self.manifest: dict[str, Any] = {}  # what commit wrote
        self.owned: set[str] = set()
        self.foreign: set[str] = set()
        if self.path.is_dir():
            found = identify(self.path)
            if found and found.manifest is not None and found.kind is not kind:
                raise UserError(f"{option} {self.path}: holds {found.describe()}; {expected}. Nothing was "
                                "changed: choose another folder")
            self.owned, others = _owned(self.path, kind)
            self.foreign = _files(self.path) - self.owned
            interrupted = others.pop(".", None)
            if interrupted:
                raise UserError(f"{option} {self.path}: holds {interrupted}; {expected}. Nothing was "
                                "changed: rerun the command that was writing it, or choose another folder")
            if self.foreign and not overwrite:
                theirs = [f"{base}/ ({what}, k3export's)" for base, what in sorted(others.items())]
                loose = {f for f in self.foreign
                         if not any(PurePosixPath(f).is_relative_to(base) for base in others)}
                listing = ", ".join([*theirs, _listing(loose)] if loose else theirs)
                raise UserError(
                    f"{option} {self.path}: holds files `{kind.writer}` did not write ({listing}); "
                    f"{expected}. Nothing was changed: choose another "
                    + ("folder." if overwrite is None else
                       "folder, or pass --overwrite to write beside them (they are kept; only files listed "
                       "in the folder's own k3export manifests are replaced)"))

    @contextlib.contextmanager
    def staged(self) -> Iterator[Path]:
        """An empty folder to write the output into; on success it is committed, on failure removed
        (and the folder keeps what it held)."""
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in self.path.glob(f"{_STAGE_PREFIX}*"):  # left by a killed run of ours
            shutil.rmtree(stale, ignore_errors=True)
        stage = self.path / f"{_STAGE_PREFIX}{os.getpid()}"
        stage.mkdir()
        try:
            yield stage
            self.commit(stage)
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def commit(self, stage: Path) -> dict[str, Any]:
        """Records every staged file in the staged manifest (sha256, bytes), then moves the files
        into place, the manifest last, and removes the old output's files that are not replaced."""
        manifest_path = stage / self.manifest_name
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        new = sorted(_files(stage) - {self.manifest_name})
        clash = set(new) & self.foreign
        if clash:
            raise UserError(f"{self.option} {self.path}: would replace files k3export did not write "
                            f"({_listing(clash)}); choose another folder")
        manifest = {"written_by": WRITTEN_BY, "command": self.command, **manifest,
                    "files": {name: file_record(stage / name) for name in new}}
        write_json(manifest_path, manifest)
        _test_kill_point("staged")
        write_json(self.path / _JOURNAL, {"written_by": WRITTEN_BY, "kind": self.kind.name,
                                          "files": sorted(self.owned | set(new) | {self.manifest_name})})
        # No manifest while files move: a folder caught half-way is never taken as complete.
        (self.path / self.manifest_name).unlink(missing_ok=True)
        (self.path / _STAT_CACHE).unlink(missing_ok=True)
        for name in new:
            (self.path / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(stage / name, self.path / name)
            _test_kill_point("moving")
        for name in sorted(self.owned - set(new) - {self.manifest_name, *_OURS}):
            path = self.path / name
            path.unlink(missing_ok=True)
            # The folders our files were in go too once empty (never the output folder itself).
            for parent in path.parents:
                if parent == self.path or not parent.is_dir() or any(parent.iterdir()):
                    break
                parent.rmdir()
        _test_kill_point("before-manifest")
        os.replace(manifest_path, self.path / self.manifest_name)
        (self.path / _JOURNAL).unlink()
        self.manifest = manifest
        return manifest


class OutputFile:
    """A file a command writes (an engine), with its record `<file>.json` beside it (the command,
    the file's sha256 and bytes, and what the command adds). An existing file is replaced only if
    its record says k3export wrote it, or with --overwrite. The record names the file as pending
    before the file is written, so a rerun after a kill still knows it as ours."""

    def __init__(self, path: str | Path, command: str, overwrite: bool = False) -> None:
        self.path, self.command = Path(path), command
        self.record_path = self.path.with_name(f"{self.path.name}.json")
        if self.path.is_dir():
            found = identify(self.path)
            what = f"holds {found.describe()}" if found else "a folder is there"
            raise UserError(f"--out {self.path}: {what}; expected a file name. Nothing was changed")
        # Never a file of another k3export output, --overwrite or not (the record of `--out DIR/export`
        # would be that export's export.json).
        holder = identify(self.path.parent)
        held = {holder.kind.manifest, *holder.manifest.get("files", {})} if holder and holder.manifest \
            else set()
        for path in (self.path, self.record_path):
            if path.name in held:
                raise UserError(f"--out {self.path}: {path} is a file of {holder.describe()}; expected a "
                                "file name of its own. Nothing was changed")
        ours = self._ours()
        for path in (self.path, self.record_path):
            if path.exists() and not ours and not overwrite:
                raise UserError(f"--out {self.path}: {path} exists and k3export did not write it; "
                                "choose another name, or pass --overwrite to replace it")

    def _ours(self) -> bool:
        try:
            record = json.loads(self.record_path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return False
        return isinstance(record, dict) and record.get("written_by") == WRITTEN_BY \
            and self.path.name in {*record.get("files", {}), *record.get("pending", [])}

    def begin(self) -> None:
        write_json(self.record_path, {"written_by": WRITTEN_BY, "command": self.command, "files": {},
                                      "pending": [self.path.name]})

    def finish(self, details: dict[str, Any]) -> dict[str, Any]:
        record = {"written_by": WRITTEN_BY, "command": self.command, **details,
                  "files": {self.path.name: file_record(self.path)}}
        write_json(self.record_path, record)
        return record
