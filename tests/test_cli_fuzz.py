"""A fuzz test over the whole command line: argument vectors drawn from the parsers' own tables
(every subcommand of `k3export` and `python -m k3export.runtime`, every option and positional, so a
new option is fuzzed without editing this file), with values of every kind: integers (0,
negatives, huge), floats (nan, inf, negatives), strings, token ids past the vocabulary, paths that
do not exist, a file where a folder is expected and the reverse, a folder of someone else's files,
and options repeated or in conflict. Every run must end with exit 0, 1 or 2 and print neither a
traceback nor "internal error".

Commands run in this process (`k3export.cli.main`) against a k3-tiny build made once (one stage,
whose folder is also an export). Some drawn commands would do real work far longer than a fuzz
example; for those the parser alone runs (it still refuses every bad value, which is what is
fuzzed), see PARSE_ONLY. `K3EXPORT_FUZZ_EXAMPLES=2000 pytest tests/test_cli_fuzz.py` runs longer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from k3export.cli import build_parser, main
from k3export.config import K3Config
from k3export.model import K3ForCausalLM
from k3export.runtime import Sampler
from k3export.runtime.__main__ import build_parser as runtime_parser
from k3export.shards.recipe import load_recipe
from k3export.shards.stages import build_recipe
from k3export.weights.published import write_published

TINY_RECIPE = Path(__file__).resolve().parents[1] / "engines/k3-tiny.toml"

# Drawn commands that only the parser runs, and why.
PARSE_ONLY = {
    "demo": "exports, checks and builds k3-tiny: minutes",
    "export": "a valid export takes 10 s (k3-tiny) to hours (kimi-k3 --no-weights); test_export and "
              "test_bad_input run it, valid and refused",
    "build": "a valid build exports every stage or builds engines (20 s and more); test_shards, "
             "test_engine and test_bad_input run it",
    "runtime": "python -m k3export.runtime needs torchrun's process group; its request checks after "
               "parsing are `run`'s (prompts_of), fuzzed through `run`",
}
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
token_lists = st.lists(integers, min_size=1, max_size=4).map(lambda ids: ",".join(map(str, ids)))


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
    """engines/k3-tiny.toml in one stage (onnx backend): a build whose stage-0 folder is an export
    of the whole model (capacity 256 tokens, vocabulary 256)."""
    build = tmp_path_factory.mktemp("fuzz") / "build"
    build_recipe(dataclasses.replace(load_recipe(TINY_RECIPE), stage_count=1), build, backend="onnx",
                 log=lambda _: None)
    return build


@pytest.fixture(scope="module")
def paths(build: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths a user might give, by name: the tiny build, its export and files of it, a recipe, a
    published checkpoint with a shard missing, and wrong ones: missing, a file, an empty folder, a
    folder of someone else's files, a path below a file."""
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
    return {name: str(path) for name, path in named.items()}


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


def values(action: argparse.Action, paths: list[str]) -> st.SearchStrategy[str]:
    """Values for one option: mostly of the kind its type parses, sometimes of any kind."""
    anything = st.one_of(integers.map(str), floats, texts, st.sampled_from(paths))
    kind = getattr(action.type, "__name__", "")
    if action.choices:
        own = st.sampled_from([str(c) for c in action.choices])
    elif kind.startswith("existing") or action.metavar in ("DIR", "FILE", "PATH", "RECIPE"):
        own = st.sampled_from(paths)
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


@st.composite
def argument_vectors(draw: st.DrawFn, paths: dict[str, str]) -> tuple[str, list[str]]:
    """(program, argv): a subcommand of k3export (or the runtime's parser); two times in three one of its
    BASES with options added, else one member of each required group (sometimes two: a conflict)
    and its positionals; then other options at random, some repeated."""
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    programs = {**subparsers.choices, "runtime": runtime_parser()}
    program = draw(st.sampled_from(sorted(programs)))
    parser = programs[program]
    actions = drawable(parser)
    pool = list(paths.values())
    based = program in BASES and draw(st.integers(0, 2)) > 0
    argv = [a.format(**paths) for a in draw(st.sampled_from(BASES[program]))] if based else []
    chosen: list[argparse.Action] = []
    for group in parser._mutually_exclusive_groups:
        members = [a for a in group._group_actions if a in actions]
        if group.required and members and not based:
            chosen += draw(st.lists(st.sampled_from(members), min_size=1, max_size=2, unique=True))
    if not based:
        chosen += [a for a in actions if a.required and a.option_strings and draw(st.integers(0, 9))]
    optional = [a for a in actions if a.option_strings and not a.required]
    chosen += draw(st.lists(st.sampled_from(optional), max_size=2 if based else 4)) if optional else []
    for action in chosen:
        argv.append(draw(st.sampled_from(action.option_strings)))
        if action.nargs != 0:
            argv.append(draw(values(action, pool)))
    for action in actions:
        if not action.option_strings and not based and (action.nargs != "?" or draw(st.booleans())):
            argv.append(draw(values(action, pool)))
    return program, argv if program == "runtime" else [program, *argv]


def run(program: str, argv: list[str]) -> tuple[int, str]:
    """Exit code and everything printed, in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            if program in PARSE_ONLY:
                (runtime_parser() if program == "runtime" else build_parser()).parse_args(argv)
                code = 0
            else:
                code = main(argv)
        except SystemExit as e:  # the parser alone: 2 for a refused value
            code = e.code
    return code, out.getvalue()


@settings(max_examples=int(os.environ.get("K3EXPORT_FUZZ_EXAMPLES", 250)), derandomize=True,
          deadline=timedelta(seconds=60), database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_every_option_value_ends_in_exit_0_1_or_2(paths: dict[str, str], data: st.DataObject) -> None:
    program, argv = data.draw(argument_vectors(paths))
    code, printed = run(program, argv)
    event(f"{program}: exit {code}")
    assert code in (0, 1, 2), (code, printed[-3000:])
    assert "Traceback" not in printed and "internal error" not in printed, printed[-3000:]


def test_the_fuzz_reaches_every_subcommand_and_option() -> None:
    """The strategy draws from the parsers' tables: each subcommand's options are all drawable but
    those listed in NOT_DRAWN (so a new option is fuzzed without editing this file)."""
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in {**subparsers.choices, "runtime": runtime_parser()}.items():
        every = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
        drawn = {s for a in drawable(parser) for s in a.option_strings}
        assert every - drawn <= set(NOT_DRAWN), name
    plain = [(name, a.dest) for name, parser in subparsers.choices.items() for a in parser._actions
             if a.type in (int, float)]
    assert not plain, f"numeric options without a range (use k3export.options' types): {plain}"


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


def test_sampling_with_top_p_1_keeps_at_most_every_token() -> None:
    """Found by the fuzz: `run --temperature 1` (top-p 1, the default) failed inside numpy whenever
    the rounded probabilities summed to less than 1, as they do for these logits."""
    logits = np.random.default_rng(0).standard_normal((1, 256))
    p = np.exp(logits[0] - logits.max())
    assert np.cumsum(np.sort(p / p.sum())[::-1])[-1] < 1.0  # the case: short of top_p = 1
    tokens = [int(Sampler(temperature=1.0, top_p=1.0, seed=seed)(logits)[0]) for seed in range(50)]
    assert all(0 <= t < 256 for t in tokens) and len(set(tokens)) > 10  # drawn, not greedy


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
    import k3export.check.driver
    import k3export.check.runners.chain
    import k3export.runtime
    import k3export.weights.checkpoint

    def never(*_: object, **__: object) -> None:
        raise AssertionError("a session or model was made before the request was refused")

    monkeypatch.setattr(k3export.runtime, "Pipeline", never)
    monkeypatch.setattr(k3export.check.runners.chain, "Pipeline", never)
    monkeypatch.setattr(k3export.check.driver, "build_model", never)
    monkeypatch.setattr(k3export.weights.checkpoint, "build_model", never)
    refused([a.format(build=build) for a in argv], *culprits)
    assert sorted(p.name for p in build.parent.iterdir()) == ["build"]  # nothing written beside it
