"""k3export.progress: bars on a terminal, nothing otherwise or with --quiet."""

from __future__ import annotations

import io
import sys

import pytest

from k3export import progress
from k3export.cli import build_parser


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def quiet_reset():
    yield
    progress.set_quiet(False)


def as_terminal(monkeypatch) -> Terminal:
    """stderr replaced by a terminal; in the test itself, as pytest's capture restores sys.stderr
    between a fixture's setup and the test."""
    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setenv("TERM", "xterm")  # rich draws nothing on a "dumb" terminal
    return stream


def test_a_terminal_gets_a_bar_with_elapsed_and_remaining_time(monkeypatch, quiet_reset):
    terminal = as_terminal(monkeypatch)
    assert list(progress.track(range(3), "steps")) == [0, 1, 2]
    shown = terminal.getvalue()
    assert "steps" in shown and "3/3" in shown and "remaining" in shown and "0:00:00" in shown
    with progress.spinner("export"):
        pass
    assert "export" in terminal.getvalue()


def test_quiet_and_non_terminals_get_nothing(monkeypatch, quiet_reset):
    terminal = as_terminal(monkeypatch)
    progress.set_quiet(True)
    assert list(progress.track(iter("ab"), "steps", total=2)) == ["a", "b"]
    with progress.spinner("export"):
        pass
    assert terminal.getvalue() == ""
    progress.set_quiet(False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or a log file
    assert not progress.enabled()
    assert list(progress.track([1, 2], "steps")) == [1, 2]
    assert sys.stderr.getvalue() == ""


@pytest.mark.parametrize("command", [["check", "--onnx", "x"],
                                     ["export", "--preset", "k3-tiny", "--out", "x"],
                                     ["build", "--onnx", "x", "--out", "y"]])
def test_long_commands_take_quiet(command, tmp_path, monkeypatch):
    (tmp_path / "x").mkdir()  # the input folder the parser requires: an export, by its manifest
    manifest = '{"written_by": "k3export", "command": "export", "files": {}}'
    (tmp_path / "x" / "export.json").write_text(manifest)
    monkeypatch.chdir(tmp_path)
    assert build_parser().parse_args([*command, "--quiet"]).quiet
    assert not build_parser().parse_args(command).quiet
