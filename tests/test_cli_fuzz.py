"""A fuzz test over the whole command line: argument vectors drawn from the parsers' own tables
(every subcommand of `k3export` and `python -m k3export.runtime`, every option and positional, so a
new option is fuzzed without editing this file), with values of every kind: integers (0,
negatives, huge), floats (nan, inf, negatives), strings, token ids past the vocabulary, paths that
do not exist, a file where a folder is expected and the reverse, a folder of someone else's files,
and options repeated or in conflict. Every run must end with exit 0 or 2 (exit 1, a failed check,
cannot happen: every artifact drawn is good) and print neither a traceback nor "internal error"; a
value its option's own type refuses must end in exit 2 naming the option, two options of one
exclusive group in exit 2, and a command that one of tests/refusals.py's refusals applies to (`build
--onnx DIR --taps`, `check --runner` without `--build`, a token id past the vocabulary, ...) in exit
2. Besides the generated examples, explicit ones add each option once with an edge value to a valid
command (the sweep) and run each refusal's example, which must name its culprit; every program's work
must have been reached by the examples. The generator itself must draw every drawable option: measured
on its own draws (not on the sweep's, which hold every option by construction).

Commands run in this process (`k3export.cli.main`, the runtime's `main`) against a k3-tiny build
made once (one stage, whose folder is also an export). Some drawn commands would do real work far
longer than a fuzz example; those run up to the moment that work begins (every check of their input
before it runs) and stop there, see WORK_STOPPED. `K3EXPORT_FUZZ_EXAMPLES=2000 pytest
tests/test_cli_fuzz.py` runs longer.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import importlib
import io
import os
import re
import shutil
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from refusals import REFUSALS, Refusal

from k3export.cli import build_parser, main
from k3export.config import K3Config
from k3export.model import K3ForCausalLM
from k3export.runtime import Sampler
from k3export.runtime.__main__ import build_parser as runtime_parser
from k3export.runtime.__main__ import main as runtime_main
from k3export.shards.recipe import load_recipe
from k3export.shards.stages import build_recipe
from k3export.weights.published import write_published

TINY_RECIPE = Path(__file__).resolve().parents[1] / "engines/k3-tiny.toml"
VOCABULARY = K3Config.from_preset("k3-tiny").vocab_size  # of the build every command is given

# Where drawn commands that would do minutes of work stop: the first step of that work raises
# WorkBegins instead, after every check of the command's input has run.
WORK_STOPPED = {
    "export, build RECIPE": ("k3export.artifacts", "OutputDir", "staged",
                             "the folder an export is staged in (a valid k3-tiny export takes 10 s)"),
    "build --onnx": ("k3export.artifacts", "OutputFile", "begin",
                     "the engine's record, begun before TensorRT-RTX builds (20 s and more)"),
    "demo": ("k3export.demo", None, "run_demo", "the demo's eager model, then its export, check and build"),
    "runtime": ("k3export.runtime.__main__", None, "watch_signals",
                "the process joins torchrun's process group (which needs torchrun)"),
}


class WorkBegins(BaseException):
    """Raised where a command's long work would begin; a BaseException, so that `main` does not
    report it as an internal error."""


@contextlib.contextmanager
def work_stopped() -> Iterator[None]:
    def begins(*_: object, **__: object) -> None:
        raise WorkBegins

    with pytest.MonkeyPatch.context() as patch:
        for module, owner, name, _ in WORK_STOPPED.values():
            target = importlib.import_module(module)
            patch.setattr(getattr(target, owner) if owner else target, name, begins)
        yield


# Options never drawn, and why.
NOT_DRAWN = {
    "--debug": "asks for the traceback of input errors",
    "--kernels": "the Triton interpreter over the whole network: minutes (tests/kernels run it)",
}

# Integers at the edges of every range (0, negatives, 32- and 64-bit limits, beyond a float) and
# small valid ones. Mid-sized valid values only make the real work longer: they are not drawn.
EDGE_INTEGERS = [0, -1, -3, 1, 2, 3, 8, 255, 256, 257, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 10**30,
                 10**400]
integers = st.one_of(st.sampled_from(EDGE_INTEGERS), st.integers(-5, 5), st.integers(min_value=10**9))
floats = st.one_of(st.sampled_from(["nan", "inf", "-inf", "-1", "-0.0", "0", "0.5", "1", "1.5", "1e308",
                                    "1e400"]), st.floats().map(repr))
texts = st.one_of(st.sampled_from(["", " ", "-", "--", "abc", "0:2", ":", "3:1", "1,2,3", "-5", "1e3", "0x10",
                                   "é", "../..", "a" * 300]),
                  st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
                          max_size=12))
# Token ids at the tiny build's vocabulary edge (256 ids) half the time.
token_ids = st.one_of(st.sampled_from([0, 1, 255, 256, 257, 300]), integers)
token_lists = st.lists(token_ids, min_size=1, max_size=4).map(lambda ids: ",".join(map(str, ids)))


@pytest.fixture(scope="module", autouse=True)
def _scratch_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Relative paths the fuzz draws ("-3", "abc") are written below a folder of its own, not into
    the checkout (check --report -3 writes a report there)."""
    previous = Path.cwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(previous)


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k3-tiny's 3-layer cut (every layer kind; test_parallel_grid.short_recipe) in one stage (onnx
    backend): a build whose stage-0 folder is an export of the whole model (capacity 256 tokens,
    vocabulary 256). What the commands are given decides their exits, not the model's depth: the
    9-layer model cost the fixture 10 s and every valid check and run drawn three times its time."""
    from test_parallel_grid import short_recipe

    recipe = short_recipe(tmp_path_factory.mktemp("fuzz-recipe"), "float32", 1, 1)
    build = tmp_path_factory.mktemp("fuzz") / "build"  # alone in its folder: tests look beside it
    build_recipe(load_recipe(recipe), build, log=lambda _: None)
    return build


@pytest.fixture(scope="module")
def paths(build: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths a user might give, by their placeholder "{name}" (PATHS): the tiny build, its export and
    files of it, a recipe, a published checkpoint with a shard missing, and wrong ones: missing, a
    file, an empty folder, a folder of someone else's files, a path below a file."""
    root = tmp_path_factory.mktemp("fuzz")
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()
    model.init_weights(0)
    checkpoint = root / "checkpoint"
    shards = write_published(model, checkpoint)
    shards[3].unlink()  # layer 3's shard: a partial download
    recipe = shutil.copy(TINY_RECIPE, root / "recipe.toml")
    theirs = root / "theirs"
    theirs.mkdir()
    (theirs / "thesis.txt").write_text("draft")
    (theirs / "export.json").write_text("not json")
    (root / "notes.txt").write_text("hello")
    (root / "empty").mkdir()
    named = {"build": build, "export": build / "stage-0", "manifest": build / "manifest.json",
             "config": build / "stage-0/config.json", "graph": build / "stage-0/model.onnx",
             "checkpoint": checkpoint, "recipe": recipe, "theirs": theirs, "file": root / "notes.txt",
             "empty": root / "empty", "missing": root / "missing", "deeper": root / "missing/deeper",
             "below a file": root / "notes.txt/below"}
    assert list(named) == PATHS
    return {f"{{{name}}}": str(path) for name, path in named.items()}


# The paths' names: vectors hold them as "{name}" and each run puts in the fixture's paths.
PATHS = ["build", "export", "manifest", "config", "graph", "checkpoint", "recipe", "theirs", "file", "empty",
         "missing", "deeper", "below a file"]


# Valid commands that a drawn vector starts from two times in three (drawn options are added after: a
# repeated option's last value wins), so that the work behind the parser runs too. Small sizes keep
# a valid check or run under two seconds.
BASES = {
    "check": [["--onnx", "{export}", "--steps", "1", "--prompt-len", "3"],
              ["--build", "{build}", "--steps", "1", "--prompt-len", "3"]],
    "run": [["{build}", "--max-new-tokens", "2"]],
    "runtime": [["{build}"]],
    "info": [["--preset", "k3-tiny"], ["--checkpoint", "{checkpoint}"], ["--config", "{config}"]],
    "plan": [["--preset", "k3-tiny", "--stages", "2"], ["{recipe}"]],
    "verify": [["{build}"]],
    "export": [["--preset", "k3-tiny", "--out", "{missing}"]],
    "build": [["--onnx", "{export}", "--out", "{missing}"], ["{recipe}", "--out", "{missing}"]],
    "demo": [[]],
}


def values(action: argparse.Action) -> st.SearchStrategy[str]:
    """Values for one option: mostly of the kind its type parses, sometimes of any kind."""
    paths = [f"{{{name}}}" for name in PATHS]
    anything = st.one_of(integers.map(str), floats, texts, st.sampled_from(paths))
    kind = getattr(action.type, "__name__", "")
    if action.choices:
        own = st.sampled_from([str(c) for c in action.choices])
    elif kind.startswith("existing") or action.metavar in ("DIR", "FILE", "PATH", "RECIPE"):
        own = st.sampled_from(paths)
    elif action.metavar == "ID":  # --stop
        own = token_ids.map(str)
    elif kind.startswith("integer"):
        own = st.one_of(st.integers(1, 3), integers).map(str)  # small valid ones half the time
    elif kind.startswith("number"):
        own = st.one_of(st.floats(0, 1).map(repr), floats)
    elif kind == "token_ids":
        own = token_lists
    else:
        own = texts
    return st.one_of(own, own, own, anything)


def drawable(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)
            and not set(a.option_strings) & set(NOT_DRAWN)]


@functools.cache
def programs() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser by name, and the runtime's as "runtime"."""
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {**subparsers.choices, "runtime": runtime_parser()}


def named(action: argparse.Action) -> str:
    """An action as argparse's messages name it (`argument --out/-o: ...`, `argument DIR: ...`)."""
    return "/".join(action.option_strings) or action.metavar or action.dest


@dataclasses.dataclass
class Vector:
    program: str
    parser: argparse.ArgumentParser  # the one its actions belong to
    argv: list[str]  # as main takes it (the subcommand first, but for the runtime)
    drawn: list[tuple[argparse.Action, str | None]]  # each option and positional drawn, with its value
    given: list[argparse.Action]  # every action in argv: those of the base command too
    refusal: Refusal | None = None  # the refusal whose example it is


@st.composite
def argument_vectors(draw: st.DrawFn) -> Vector:
    """A subcommand of k3export (or the runtime's parser), about as often as it has options, and one
    of its options or positionals in the spotlight (so that every one is drawn within the examples);
    two times in three one of its BASES with the spotlight and other options added, else one member
    of each required group (sometimes two: a conflict) and its positionals; then other options at
    random, some repeated."""
    parsers = programs()
    weights = {p: len(drawable(parser)) + 3 for p, parser in parsers.items()}
    program = draw(st.sampled_from([p for p in sorted(parsers) for _ in range(weights[p])]))
    parser = parsers[program]
    actions = drawable(parser)
    # An index drawn as an integer: the first of a shuffle (st.permutations), biased to the first actions,
    # needed 1000 draws to reach every option, an index 700 (measured 2026-12-02).
    spotlight = actions[draw(st.integers(0, len(actions) - 1))]
    # A base command holds its positionals: a positional in the spotlight is drawn without one.
    based = program in BASES and bool(spotlight.option_strings) and draw(st.integers(0, 2)) > 0
    argv = list(draw(st.sampled_from(BASES[program]))) if based else []
    given = [a for a in actions if set(a.option_strings) & set(argv)]
    chosen = [spotlight] if spotlight.option_strings else []
    for group in parser._mutually_exclusive_groups:
        members = [a for a in group._group_actions if a in actions]
        if group.required and members and not based:
            chosen += draw(st.lists(st.sampled_from(members), min_size=1, max_size=2, unique=True))
    if not based:
        chosen += [a for a in actions if a.required and a.option_strings and draw(st.integers(0, 9))]
    optional = [a for a in actions if a.option_strings and not a.required]
    chosen += draw(st.lists(st.sampled_from(optional), max_size=1 if based else 3)) if optional else []
    drawn = with_options(draw, argv, chosen)
    for action in actions:
        if not action.option_strings and not based and (action.nargs != "?" or action is spotlight
                                                         or draw(st.booleans())):
            drawn.append((action, draw(values(action))))
            argv.append(drawn[-1][1])
    return Vector(program, parser, argv if program == "runtime" else [program, *argv], drawn,
                  given + [a for a, _ in drawn])


def with_options(draw: st.DrawFn, argv: list[str], actions: list[argparse.Action]
                 ) -> list[tuple[argparse.Action, str | None]]:
    """Appends each of `actions` to `argv`, by one of its names, with a value drawn for it; returns
    each with its value."""
    drawn: list[tuple[argparse.Action, str | None]] = []
    for action in actions:
        argv.append(draw(st.sampled_from(action.option_strings)))
        value = None if action.nargs == 0 else draw(values(action))
        argv += [] if value is None else [value]
        drawn.append((action, value))
    return drawn


@st.composite
def refusal_vectors(draw: st.DrawFn) -> Vector:
    """A refusal's example (tests/refusals.py) with one or two other options of its program added, so
    that the oracle meets each refusal's trigger among other options, not only as the table wrote it."""
    program, *argv = draw(st.sampled_from(REFUSALS)).argv
    parser = programs()[program]
    options = [a for a in drawable(parser) if a.option_strings]
    given = [a for a in options if set(a.option_strings) & set(argv)]
    drawn = with_options(draw, argv, draw(st.lists(st.sampled_from(options), min_size=1, max_size=2)))
    return Vector(program, parser, [program, *argv], drawn, given + [a for a, _ in drawn])


def commands() -> st.SearchStrategy[Vector]:
    """What the fuzz draws: commands from the parsers' tables, and as often a refusal's example grown."""
    return st.one_of(argument_vectors(), refusal_vectors())


def refused_by_its_type(action: argparse.Action, value: str | None) -> bool:
    """Whether argparse will refuse the value: the option's own type raises, or the value it gives is
    not among the option's choices."""
    if value is None:
        return False
    try:
        parsed = action.type(value) if callable(action.type) else value
    except (argparse.ArgumentTypeError, TypeError, ValueError):
        return True
    return bool(action.choices) and parsed not in action.choices


def refusals_for(vector: Vector, argv: list[str]) -> list[Refusal]:
    """The refusals (tests/refusals.py) that apply to the command, once its parser takes it."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = vector.parser.parse_args(argv if vector.program == "runtime" else argv[1:])
    except SystemExit:
        return []
    return [r for r in REFUSALS if r.applies(vector.program, args)]


def run(program: str, argv: list[str]) -> tuple[int, str]:
    """Exit code and everything printed, in this process; exit 0 when the command's long work
    begins (WorkBegins: every check of its input passed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), work_stopped():
        try:
            code = runtime_main(argv) if program == "runtime" else main(argv)
        except SystemExit as e:  # the runtime's parser: 2 for a refused value
            code = e.code
        except WorkBegins:
            code = 0
    return code, out.getvalue()


def edge_value(action: argparse.Action) -> str:
    """One value at an edge of what the option takes: its last choice, a folder of someone else's
    files, the first token id past the vocabulary, 0, nan, or nothing."""
    kind = getattr(action.type, "__name__", "")
    if action.choices:
        return str(list(action.choices)[-1])
    if kind.startswith("existing") or action.metavar in ("DIR", "FILE", "PATH", "RECIPE"):
        return "{theirs}"
    if action.metavar in ("ID", "IDS"):
        return str(VOCABULARY)
    return "0" if kind.startswith("integer") else "nan" if kind.startswith("number") else ""


def sweep() -> list[Vector]:
    """Every program's base commands as they are (valid: each reaches its work), then every option of
    every parser once, added to the program's first base command with its edge value, and every
    positional alone: the fuzz's explicit examples, so that each program is reached and each option
    drawn whatever the generated examples draw (they favour some: 1000 of them left options undrawn,
    and a new option elsewhere once left `verify {build}` undrawn)."""
    vectors = []
    for program, parser in programs().items():
        for base in BASES.get(program, []):
            given = [a for a in drawable(parser) if set(a.option_strings) & set(base)]
            vectors.append(Vector(program, parser, base if program == "runtime" else [program, *base], [],
                                  given))
        for action in drawable(parser):
            value = None if action.nargs == 0 else edge_value(action)
            argv = [*BASES.get(program, [[]])[0], action.option_strings[-1]] if action.option_strings else []
            argv += [] if value is None else [value]
            given = [a for a in drawable(parser) if set(a.option_strings) & set(argv)]
            vectors.append(Vector(program, parser, argv if program == "runtime" else [program, *argv],
                                  [(action, value)], [*given, action]))
    for refusal in REFUSALS:
        program, *argv = refusal.argv
        parser = programs()[program]
        given = [a for a in drawable(parser) if set(a.option_strings) & set(argv)]
        vectors.append(Vector(program, parser, list(refusal.argv), [], given, refusal=refusal))
    return vectors


def with_the_sweep(test: Callable[..., None]) -> Callable[..., None]:
    for vector in sweep():
        test = example(vector=vector)(test)
    return test


# The programs whose examples reached their work (exit 0), as they ran.
REACHED: set[str] = set()
# The generator's draws that test_the_generator_draws_every_option_and_refusal measures (drawn, not run: a
# few ms each), half of them refusals' examples grown: with check --eager/--stage and plan --host-gb added,
# 1000 of the other half left two of build's options undrawn (2026-12-02); of 1200 refusal draws, the
# least drawn refusal applied beyond its example 10 times (2026-12-07).
GENERATOR_DRAWS = 2400


@settings(max_examples=int(os.environ.get("K3EXPORT_FUZZ_EXAMPLES", 300)), derandomize=True,
          deadline=timedelta(seconds=60), database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@with_the_sweep
@given(vector=commands())
def test_every_option_value_ends_in_exit_0_or_2(paths: dict[str, str], vector: Vector) -> None:
    argv = [paths.get(a, a) for a in vector.argv]
    drawn = [(action, paths.get(value, value) if value else value) for action, value in vector.drawn]
    code, printed = run(vector.program, argv)
    event(f"{vector.program}: exit {code}")
    assert code in (0, 2), (code, printed[-3000:])
    assert "Traceback" not in printed and "internal error" not in printed, printed[-3000:]
    REACHED.update([vector.program] if code == 0 else [])
    if vector.refusal:
        assert code == 2 and vector.refusal.culprit in printed, (code, vector.refusal.argv, printed[-3000:])
    refused = refusals_for(vector, argv)
    assert code == 2 or not refused, ([r.argv for r in refused], printed[-3000:])
    clash = any(len(set(g._group_actions) & set(vector.given)) > 1
                for g in vector.parser._mutually_exclusive_groups)
    assert code == 2 or not clash, printed[-3000:]
    culprits = [a for a, value in drawn if refused_by_its_type(a, value)]
    if culprits:
        assert code == 2, (code, [named(a) for a in culprits], printed[-3000:])
        # argparse names the first value it cannot take: one its type refuses, unless another action
        # of an exclusive group came first. (A value that looks like an option, "-inf", is not taken
        # as a value at all: argparse's message then names what is missing or unrecognized.)
        if not any(value and value.startswith("-") for _, value in drawn):
            error = re.search(r"error: argument (\S+): ", printed)
            assert error and error.group(1) in {named(a) for a in (vector.given if clash else culprits)}, \
                printed[-3000:]


def test_the_fuzz_reaches_every_subcommand(paths: dict[str, str]) -> None:
    """Every program's examples reached its work (exit 0) at least once, and no numeric option parses
    a plain int or float (it would take 0, negatives, nan and inf)."""
    if not REACHED:  # run on its own (-k): the fuzz first, as the suite runs it
        test_every_option_value_ends_in_exit_0_or_2(paths=paths)
    assert set(programs()) == REACHED, f"never past their input checks: {set(programs()) - REACHED}"
    plain = [(name, a.dest) for name, parser in programs().items() for a in parser._actions
             if a.type in (int, float)]
    assert not plain, f"numeric options without a range (use k3export.options' types): {plain}"


def test_the_generator_draws_every_option_and_refusal(paths: dict[str, str]) -> None:
    """Every option and positional of every parser (but those in NOT_DRAWN) is drawn by the generator
    itself within GENERATOR_DRAWS derandomized draws, so that no option is left to the sweep alone; and
    every refusal applies to some drawn command other than its own example (its trigger among other
    options), so that the oracle tries each beyond the one command the table names."""
    drawn: dict[str, set[str]] = collections.defaultdict(set)
    applied: set[tuple[str, ...]] = set()

    @settings(max_examples=GENERATOR_DRAWS, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(vector=commands())
    def record(vector: Vector) -> None:
        drawn[vector.program] |= {named(action) for action, _ in vector.drawn}
        argv = [paths.get(a, a) for a in vector.argv]
        applied.update(r.argv for r in refusals_for(vector, argv) if tuple(vector.argv) != r.argv)

    record()
    missed = {program: sorted({named(a) for a in drawable(parser)} - drawn[program])
              for program, parser in programs().items()}
    assert not any(missed.values()), f"never drawn: {missed}"
    assert not [r.argv for r in REFUSALS if r.argv not in applied], "refusals drawn only as their example"


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: " ".join(r.argv))
def test_each_refusals_example_is_one_it_applies_to(paths: dict[str, str], refusal: Refusal) -> None:
    """A refusal's example is refused by the CLI (the fuzz runs it); here its own predicate must say so
    too, so that the oracle, which reads the predicates, holds the CLI to it."""
    program, *argv = refusal.argv
    assert refusal.applies(program, programs()[program].parse_args([paths.get(a, a) for a in argv]))


# -- the defects found, each pinned ------------------------------------------------------------------

def refused(argv: list[str], *culprits: str) -> str:
    """`k3export ARGV` (run whole, in this process): exit 2 with one message naming every culprit,
    no traceback."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    printed = out.getvalue()
    assert code == 2 and "Traceback" not in printed, (code, printed[-2000:])
    for culprit in culprits:
        assert culprit in printed, (culprit, printed[-2000:])
    return printed


@pytest.mark.parametrize("argv, culprit", [
    (["run", "{build}", "--batch", "0"], "argument --batch: expected an integer >= 1, got 0"),  # was exit 3
    (["check", "--build", "{build}", "--batch", "0"], "argument --batch"),  # was exit 3
    (["check", "--build", "{build}", "--steps", "-3"], "argument --steps: expected an integer >= 0, got -3"),
    (["check", "--build", "{build}", "--prompt-len", "0"], "argument --prompt-len"),  # named input_lengths
    (["run", "{build}", "--temperature", "-1"], "argument --temperature"),  # was accepted
    (["run", "{build}", "--temperature", "nan"], "argument --temperature"),
    (["run", "{build}", "--top-p", "1.5"], "argument --top-p"),  # was exit 3 (numpy's "a and p")
    (["run", "{build}", "--prompt-len", "0"], "argument --prompt-len"),  # was accepted
    (["run", "{build}", "--threads", "1000000000"], "argument --threads: expected an integer <= 1024"),
    (["export", "--preset", "k3-tiny", "--capacity", "0", "--out", "{build}/x"], "argument --capacity"),
    (["run", "{build}/manifest.json"], "is a file; expected a folder"),
    (["info", "--config", "{build}"], "is a folder; expected a file"),
    (["check", "--onnx", "{build}/nothing"], "no such folder"),
    (["plan", "--preset", "k3-tiny", "--stages", "2", "--link-gb-per-s", "inf"], "argument --link-gb-per-s"),
])
def test_option_values_are_refused_by_the_parser(build: Path, argv: list[str], culprit: str) -> None:
    """Refused by argparse itself: before any file is read or model built."""
    argv = [a.format(build=build) for a in argv]
    with pytest.raises(SystemExit) as parsed, contextlib.redirect_stderr(io.StringIO()) as err:
        build_parser().parse_args(argv)
    assert parsed.value.code == 2 and culprit in err.getvalue(), err.getvalue()


def test_documented_meanings_of_zero_stay_valid(build: Path) -> None:
    """--top-k 0 (no cut) and --temperature 0 (greedy) are valid; so are --steps 0 and the edges."""
    args = build_parser().parse_args(["run", str(build), "--top-k", "0", "--temperature", "0",
                                      "--top-p", "0"])
    assert (args.top_k, args.temperature, args.top_p) == (0, 0.0, 0.0)
    assert build_parser().parse_args(["check", "--build", str(build), "--steps", "0"]).steps == 0


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampling_with_top_p_1_keeps_at_most_every_token(temperature: float) -> None:
    """Found by the fuzz: `run --temperature 1` (top-p 1, the default) failed inside numpy whenever
    the rounded probabilities summed to less than 1, as they do for these logits. Drawn over many
    seeds, the tokens follow softmax(logits / temperature): their frequencies lie within
    total-variation distance 0.06 of it (20,000 fair draws over 256 tokens are about 0.04 away; a
    sampler that ignores the logits, or the temperature, is over 0.1 away)."""
    logits = np.random.default_rng(0).standard_normal((1, 256))
    p = np.exp((logits[0] - logits.max()) / temperature)
    p /= p.sum()
    assert np.cumsum(np.sort(p)[::-1])[-1] < 1.0  # the case: short of top_p = 1
    rows = np.repeat(logits, 100, axis=0)
    tokens = np.concatenate([Sampler(temperature=temperature, top_p=1.0, seed=seed)(rows)
                             for seed in range(200)])
    frequencies = np.bincount(tokens, minlength=256) / len(tokens)
    assert len(frequencies) == 256 and 0.5 * np.abs(frequencies - p).sum() < 0.06
    other = np.exp((logits[0] - logits.max()) / (3.0 - temperature))
    for wrong in (np.full(256, 1 / 256), other / other.sum()):  # the bound tells these apart
        assert 0.5 * np.abs(wrong - p).sum() > 0.1


def test_sampling_at_the_smallest_temperature_is_greedy() -> None:
    """Found by the fuzz: `run --temperature 1.1e-308` divided the logits into infinities, whose
    differences made NaN probabilities (an internal error). A temperature that small is greedy."""
    logits = np.random.default_rng(1).standard_normal((4, 256))
    assert (Sampler(temperature=1.1125369292536007e-308, seed=0)(logits) == logits.argmax(-1)).all()


@pytest.mark.parametrize("argv, culprits", [
    # The caches alone of 10^5 rows of k3-tiny at capacity 256 are 35 GB: was killed by the kernel.
    (["run", "{build}", "--batch", "10000000", "--max-new-tokens", "1"],
     ["--batch 10000000 --prompt-len 32", "GB available"]),
    (["check", "--build", "{build}", "--batch", "10000000"], ["--batch 10000000", "GB available"]),
    (["run", "{build}", "--max-new-tokens", "1000"], ["--max-new-tokens 1000", "32 + 999 = 1031",
                                                      "capacity is 256"]),
    (["check", "--onnx", "{build}/stage-0", "--prompt-len", "250", "--steps", "7"],
     ["--prompt-len 250 --steps 7", "250 + 7 = 257"]),
    (["run", "{build}", "--prompt-ids", "1,2,256"], ["--prompt-ids: token id 256", "ids 0..255"]),  # was 3
    (["run", "{build}", "--stop", "300"], ["--stop: token id 300"]),  # was accepted
    (["export", "--preset", "k3-tiny", "--capacity", "2147483647", "--out", "{build}-capacity"],
     ["--capacity 2147483647: needs at least 4,947.8 GB"]),
    # The TensorRT-RTX builder aborted the process on this profile (malloc_consolidate).
    (["build", "--onnx", "{build}/stage-0", "--out", "{build}.engine", "--max-batch", "2147483647"],
     ["--max-batch 2147483647 --max-seq 256", "more than an H200's 141 GB"]),
])
def test_requests_past_the_build_or_this_machine_are_refused_before_any_session(
        build: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], culprits: list[str]) -> None:
    """Refused with the numbers from the build's manifests, before a session or a model exists."""
    import k3export.check.runners.chain
    import k3export.check.runners.eager
    import k3export.runtime
    import k3export.weights.checkpoint

    def never(*_: object, **__: object) -> None:
        raise AssertionError("a session or model was made before the request was refused")

    monkeypatch.setattr(k3export.runtime, "Pipeline", never)
    monkeypatch.setattr(k3export.check.runners.chain, "Pipeline", never)
    monkeypatch.setattr(k3export.check.runners.eager, "build_model", never)
    monkeypatch.setattr(k3export.weights.checkpoint, "build_model", never)
    refused([a.format(build=build) for a in argv], *culprits)
    assert sorted(p.name for p in build.parent.iterdir()) == ["build"]  # nothing written beside it
