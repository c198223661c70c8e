"""Every `k3export ...` command in README.md and docs/*.md exists: a command line in a code block
parses with the CLI's own parser (placeholders such as DIR stand for any path), and a command named
inline in the text names a subcommand and options that exist. The cheap ones (info, plan) on files
that are in the repository run, and succeed."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

from k3export.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHEAP = ("info", "plan")


def code_lines(text: str) -> list[str]:
    """The lines of indented (4 spaces) and fenced code blocks, continuation lines (\\) joined."""
    lines, fenced, pending = [], False, ""
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ")):
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        lines.append(pending)
        pending = ""
    return lines


def commands(line: str) -> list[list[str]]:
    """The k3export invocations of a shell line (a `$ ` prompt, `&&` chains and comments allowed),
    each as its arguments after `k3export`; `...` (more options) is dropped."""
    found = []
    for part in line.removeprefix("$ ").split("&&"):
        if part.strip().startswith("k3export "):  # not program output, which may hold any text
            found.append([t for t in shlex.split(part, comments=True)[1:] if t != "..."])
    return found


def documented() -> list[tuple[str, list[str]]]:
    """(page, arguments) of every command line in a code block."""
    return [(page.name, argv) for page in PAGES for line in code_lines(page.read_text())
            for argv in commands(line)]


def named_inline() -> list[tuple[str, list[str]]]:
    """(page, arguments) of every `k3export ...` span in the text (outside code blocks)."""
    spans = []
    for page in PAGES:
        prose = "\n".join(line for line in page.read_text().splitlines() if not line.startswith("    "))
        # `k3export run: error: ...` quotes a message (the program name, a colon), not a command.
        spans += [(page.name, shlex.split(span)[1:]) for span in re.findall(r"`(k3export [^`\n]+)`", prose)
                  if not span.split()[1].endswith(":")]
    return spans


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_pages_hold_commands() -> None:
    """The extraction finds what the README shows (so that the tests below test something)."""
    argvs = [argv for page, argv in documented() if page == "README.md"]
    assert ["check", "--onnx", "out/tiny"] in argvs and ["info", "--preset", "kimi-k3"] in argvs
    every = {"info", "export", "check", "build", "plan", "run", "verify", "demo"}
    assert {argv[0] for argv in argvs} >= every
    assert commands("$ k3export export --preset k3-tiny --out d && k3export check --onnx d  # note") == [
        ["export", "--preset", "k3-tiny", "--out", "d"], ["check", "--onnx", "d"]]


def name(value: str | list[str]) -> str:
    return value if isinstance(value, str) else " ".join(value)


# The k3export output a folder given to these options (and to run's and verify's DIR) must be: a
# manifest of its kind (k3export.artifacts.KINDS), the parser opens it.
READS = {"--onnx": ("export.json", "export"), "--network": ("export.json", "export"),
         "--build": ("manifest.json", "build"), "--engine": ("manifest.json", "build")}
READ_BY_POSITION = {"run": READS["--build"], "verify": READS["--build"]}


def lay_out_folder(path: Path, before: str, program: str) -> None:
    """Makes the folder `path` that follows `before` (an option, or else a positional of `program`)
    on a command line, with the manifest of the kind of output it is read as (READS)."""
    path.mkdir(parents=True, exist_ok=True)
    read = READS.get(before) or (READ_BY_POSITION.get(program) if not before.startswith("-") else None)
    if read:
        manifest = {"written_by": "k3export", "command": read[1], "files": {}, "stages": []}
        (path / read[0]).write_text(json.dumps(manifest))


def lay_out_paths(argv: list[str], root: Path) -> None:
    """Makes the paths a command names under `root` (the parser refuses inputs that are not there):
    a name with a suffix (model.onnx, recipe.toml) or a file's placeholder (RECIPE, FILE, PATH) as a
    file, any other path or placeholder (DIR, out/tiny) as a folder (lay_out_folder)."""
    for before, token in zip(["", *argv[:-1]], argv, strict=True):
        if token.startswith("-") or not ("/" in token or token.isupper() or before in READS):
            continue
        path = root / token
        if path.suffix or token in ("RECIPE", "FILE", "PATH"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        else:
            lay_out_folder(path, before, argv[0])


@pytest.mark.parametrize(("page", "argv"), documented(), ids=name)
def test_command_lines_parse(page: str, argv: list[str], capsys, tmp_path, monkeypatch) -> None:
    lay_out_paths(argv, tmp_path)
    monkeypatch.chdir(tmp_path)
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{page}: `k3export {' '.join(argv)}` does not parse: {capsys.readouterr().err}")


def test_every_command_is_documented_with_a_command_line() -> None:
    """Each subcommand has at least one command line in the docs, and so is parsed by
    test_command_lines_parse (were the pattern to find none, those tests would be empty and pass)."""
    documented_commands = {argv[0] for _, argv in documented()}
    assert documented_commands == set(subparsers(build_parser())), documented_commands


def test_commands_named_in_the_text_exist() -> None:
    parser = build_parser()
    commands_ = subparsers(parser)
    globals_ = {o for a in parser._actions for o in a.option_strings}
    wrong = []
    inline = list(named_inline())
    assert inline, "no `k3export ...` found in the text: the pattern no longer matches the docs"
    for page, argv in inline:
        while argv and argv[0] in globals_:
            argv = argv[1:]
        if not argv or argv[0] not in commands_:
            wrong.append(f"{page}: `k3export {' '.join(argv)}`: no such command")
            continue
        options = {o for a in commands_[argv[0]]._actions for o in a.option_strings}
        wrong += [f"{page}: `k3export {' '.join(argv)}`: no option {t}" for t in argv[1:]
                  if t.startswith("--") and t.split("=")[0] not in options]
    assert not wrong, "\n".join(wrong)


def runnable(argv: list[str]) -> bool:
    """A cheap command whose arguments are all real: no placeholder (DIR), every path in the repo."""
    return argv[0] in CHEAP and not any(
        t.isupper() or ("/" in t and (t.startswith("/") or not (ROOT / t).exists())) for t in argv)


@pytest.mark.parametrize("argv", sorted({tuple(argv) for _, argv in documented() if runnable(argv)}),
                         ids=" ".join)
def test_cheap_commands_run(argv: tuple[str, ...], monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    assert main(list(argv)) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip()
