"""Artifacts on disk: written whole or not at all, into folders that hold nothing of the user's.

Every file is written under a temporary name and renamed when complete, so an interrupted run
never leaves a half-written file at a final name. A command that writes a folder (`export`,
`build RECIPE`, `check`) goes through `OutputDir`: it writes only into a folder that is new,
empty, or holds that command's own previous output, recognised by its manifest (a JSON file whose
`files` lists every file the tool wrote, with sha256 and bytes). Anything else is refused, naming
what was found; `--overwrite` writes beside the user's files, and even then only files listed in
the old manifest are removed. `verify` holds a folder to its manifest before anything reads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from k3export.errors import UserError

# Every manifest a k3export command writes; a folder holding one with `written_by` is ours.
BUILD_MANIFEST = "manifest.json"  # a `k3export build RECIPE` folder's
MANIFEST_NAMES = ("export.json", BUILD_MANIFEST, "check.json")
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


def _owned(folder: Path) -> set[str]:
    """Files in `folder` (relative posix paths) that k3export wrote: those its manifests list
    (nested output folders, like an export's check/, included), the manifests themselves, and
    those an interrupted commit was moving in."""
    owned = set(_OURS)
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, TypeError):
        owned |= set(json.loads((folder / _JOURNAL).read_text()))
    for name in MANIFEST_NAMES:
        for path in folder.rglob(name):
            try:
                manifest = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError):
                continue
            if not isinstance(manifest, dict) or manifest.get("written_by") != WRITTEN_BY:
                continue
            base = path.parent.relative_to(folder)
            owned.add(str(PurePosixPath(base, name)))
            owned |= {str(PurePosixPath(base, f)) for f in manifest.get("files") or {}}
    return owned


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

    def __init__(self, path: str | Path, manifest_name: str, command: str, overwrite: bool | None = False,
                 option: str = "--out") -> None:
        """`option` names the folder in messages: the command-line option that gave it. `overwrite`
        None: the command has no --overwrite (a folder holding other files is only refused)."""
        self.path, self.manifest_name, self.command = Path(path), manifest_name, command
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"{option} {self.path}: a file is there; expected a new or empty folder, or "
                            f"one that `k3export {command}` wrote")
        self.manifest: dict[str, Any] = {}  # what commit wrote
        self.owned: set[str] = set()
        self.foreign: set[str] = set()
        if self.path.is_dir():
            self.owned = _owned(self.path)
            self.foreign = _files(self.path) - self.owned
            if self.foreign and not overwrite:
                raise UserError(
                    f"{option} {self.path}: holds files k3export did not write ({_listing(self.foreign)}); "
                    f"expected a new or empty folder, or one that `k3export {command}` wrote. Choose another "
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
            raise UserError(f"--out {self.path}: would replace files k3export did not write "
                            f"({_listing(clash)}); choose another folder")
        manifest = {"written_by": WRITTEN_BY, "command": self.command, **manifest,
                    "files": {name: file_record(stage / name) for name in new}}
        write_json(manifest_path, manifest)
        _test_kill_point("staged")
        write_json(self.path / _JOURNAL, sorted(self.owned | set(new) | {self.manifest_name}))
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
            raise UserError(f"--out {self.path}: a folder is there; expected a file name")
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
