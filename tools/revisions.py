"""Benchmarks that compare two commits: a `git worktree` per commit, and Python run against it, so
that nothing uncommitted in this working tree (another change in progress) enters either side."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_in(tree: Path, *args: str, capture: bool = False) -> str:
    """Runs `python *args` with `tree`'s k3export importable ahead of this checkout's; its stdout
    when `capture`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    result = subprocess.run([sys.executable, *args], env=env, check=True, cwd=tree, text=True,
                            stdout=subprocess.PIPE if capture else None)
    return result.stdout if capture else ""


def checkout(out: Path, rev: str) -> tuple[str, Path]:
    """A worktree of `rev` under `out` (made once): its commit and folder."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    folder = out / f"checkout-{commit}"
    if not folder.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder), commit],
                       check=True)
    return commit, folder


def moved(name: str, now: str, before: str) -> object:
    """`name` from module `now`, or from `before` in a revision older than the move (k3export's
    top-level modules went into packages in issue 17: k3export.checkpoint -> k3export.weights.checkpoint,
    k3export.onnx.check -> k3export.onnx.runner and k3export.check, ...)."""
    try:
        module = importlib.import_module(now)
    except ModuleNotFoundError:
        module = importlib.import_module(before)
    return getattr(module, name)
