"""The combinations of options (and of options with the inputs they name) that the command line must
refuse with exit 2 and a message naming the option: one table, read by the fuzz's oracle
(tests/test_cli_fuzz.py: a drawn command to which a refusal applies must end in exit 2, and each example
here, run as it is, must name its culprit) and by tests/test_bad_input.py (each example whose paths it
has, run alone). A refusal removed from the CLI fails both. Values an option's own type refuses are
not listed: the fuzz reads those from the parsers.

Paths are the fuzz's placeholders ("{export}", "{build}", ...: test_cli_fuzz.PATHS). The inputs they
name have what the predicates assume: no build holds an engine, no export has taps, every recipe is
engines/k3-tiny.toml (2 stages, not split over ranks), the preset is k3-tiny (9 layers, 2 KDA and 2
MLA heads, a vocabulary of 256 ids), {build} and {export} hold its 3-layer cut (one stage; the same
heads, experts and vocabulary) and every cache holds 256 tokens a sequence ({build}'s).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass

TINY_LAYERS, TINY_VOCABULARY, CAPACITY = 9, 256, 256
RECIPE_STAGES = 2  # engines/k3-tiny.toml
TINY_RANKS = (1, 2)  # the rank counts that divide k3-tiny's 2 KDA heads, 2 MLA heads and 8 experts
RUN_PROMPT_LEN = 32  # run's longest random prompt unless --prompt-len


@dataclass(frozen=True)
class Refusal:
    argv: tuple[str, ...]  # an example: `k3export ARGV` refused for this reason alone
    culprit: str  # what the example's message says, naming the option
    applies: Callable[[str, argparse.Namespace], bool]  # must (program, parsed args) be refused?


def given(args: argparse.Namespace, name: str) -> object:
    return getattr(args, name, None)


def layers_out_of_range(text: str | None) -> bool:
    """Whether `export --layers TEXT` names no layer range A:B with 0 <= A < B <= 9 (either side may be
    empty)."""
    if text is None:
        return False
    match = re.fullmatch(r"\s*([+-]?\d*)\s*:\s*([+-]?\d*)\s*", text)
    if not match:
        return True
    start, stop = (int(p) if p.strip() else d for p, d in zip(match.groups(), (0, TINY_LAYERS), strict=True))
    return not 0 <= start < stop <= TINY_LAYERS


def past_capacity(args: argparse.Namespace, program: str) -> bool:
    """Whether the longest row's prompt and decoded tokens overflow a 256-token cache."""
    if program == "check":
        return args.prompt_len + args.steps > CAPACITY
    return run_prompt_len(args) + args.max_new_tokens - 1 > CAPACITY


def drafts_past_capacity(args: argparse.Namespace) -> bool:
    """Whether `run --speculate K`'s longest prompt, new tokens and a call's padding (3K + 1 tokens, the
    last of them the row's last token) overflow a 256-token cache."""
    if not given(args, "speculate"):
        return False
    return run_prompt_len(args) + args.max_new_tokens + 3 * args.speculate > CAPACITY


def run_prompt_len(args: argparse.Namespace) -> int:
    """The longest prompt of a `run` request."""
    return len(args.prompt_ids) if args.prompt_ids else args.prompt_len or RUN_PROMPT_LEN


def stage_without_build(program: str, args: argparse.Namespace) -> bool:
    """`check --stage I` with an artifact other than --build DIR (--onnx, --network or --engine)."""
    return program == "check" and args.stage is not None and not args.build


def onnx_build(args: argparse.Namespace) -> bool:
    """`build --onnx DIR` (an engine from one export), not `build RECIPE`."""
    return bool(args.onnx) and not args.recipe


REFUSALS = [
    # check
    Refusal(("check", "--onnx", "{export}", "--runner", "onnx"), "--runner: expected --build DIR",
            lambda p, a: p == "check" and bool(a.runner) and not a.build),
    # (each artifact option once: a refusal dropped for one of them fails its example)
    Refusal(("check", "--onnx", "{export}", "--stage", "0"), "--stage: expected --build DIR",
            stage_without_build),
    Refusal(("check", "--network", "{export}", "--stage", "0"), "--stage: expected --build DIR",
            stage_without_build),
    Refusal(("check", "--engine", "{build}", "--stage", "0"), "--stage: expected --build DIR",
            stage_without_build),
    Refusal(("check", "--onnx", "{export}", "--kernels"), "--kernels: expected --network DIR",
            lambda p, a: p == "check" and a.kernels and not a.network),
    Refusal(("check", "--onnx", "{export}", "--taps"), "--taps: ",
            lambda p, a: p == "check" and a.taps),
    Refusal(("check", "--build", "{build}", "--runner", "engine"), "--runner engine: ",
            lambda p, a: p == "check" and bool(a.build) and a.runner == "engine"),
    Refusal(("check", "--build", "{build}", "--prompt-len", "250", "--steps", "7"),
            "--prompt-len 250 --steps 7: the longest row holds 250 + 7 = 257 tokens",
            lambda p, a: p == "check" and past_capacity(a, p)),
    Refusal(("check", "--build", "{build}", "--prompt-len", "16", "--steps", "234", "--speculate", "2"),
            "--speculate 2: the longest row's prompt, its tokens and a call's padding, 16 + 235 + 3 x 2 = "
            "257",
            lambda p, a: p == "check" and bool(given(a, "speculate"))
            and a.prompt_len + a.steps + 1 + 3 * a.speculate > CAPACITY),
    # build
    Refusal(("build", "--out", "{missing}"), "build: expected --onnx DIR (one export) or a RECIPE",
            lambda p, a: p == "build" and not a.onnx and not a.recipe),
    Refusal(("build", "{recipe}", "--onnx", "{export}", "--out", "{missing}"),
            "expected --onnx DIR (one export) or a RECIPE (every pipeline stage), not both",
            lambda p, a: p == "build" and bool(a.onnx) and bool(a.recipe)),
    Refusal(("build", "--onnx", "{export}", "--no-weights", "--out", "{missing}"),
            "build --no-weights: expected a RECIPE",
            lambda p, a: p == "build" and onnx_build(a) and a.no_weights),
    Refusal(("build", "--onnx", "{export}", "--stage", "0", "--out", "{missing}"),
            "build --stage: expected a RECIPE",
            lambda p, a: p == "build" and onnx_build(a) and a.stage is not None),
    Refusal(("build", "--onnx", "{export}", "--rank", "0", "--out", "{missing}"),
            "build --rank: expected a RECIPE",
            lambda p, a: p == "build" and onnx_build(a) and a.rank is not None),
    Refusal(("build", "--onnx", "{export}", "--taps", "--out", "{missing}"),
            "build --taps: expected a RECIPE",
            lambda p, a: p == "build" and onnx_build(a) and a.taps),
    Refusal(("build", "--onnx", "{export}", "--routing-outputs", "--out", "{missing}"),
            "build --routing-outputs: expected a RECIPE",
            lambda p, a: p == "build" and onnx_build(a) and a.routing_outputs),
    Refusal(("build", "--onnx", "{export}", "--backend", "onnx", "--out", "{missing}"),
            "build --onnx DIR --backend onnx: an export is already ONNX",
            lambda p, a: p == "build" and onnx_build(a) and a.backend == "onnx"),
    Refusal(("build", "--onnx", "{export}", "--backend", "tensorrt", "--out", "{missing}"),
            "build --backend tensorrt: expected --target",
            lambda p, a: p == "build" and onnx_build(a) and a.backend == "tensorrt" and not a.target),
    Refusal(("build", "--onnx", "{export}", "--target", "sm90", "--out", "{missing}"),
            "build --backend tensorrt-rtx --target sm90: expected one of",
            lambda p, a: p == "build" and onnx_build(a) and a.backend in (None, "tensorrt-rtx")
            and a.target is not None and a.target not in ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")),
    Refusal(("build", "--onnx", "{export}", "--target", "", "--out", "{missing}"),  # was the default
            "--target '': expected one of", lambda p, a: p == "build" and onnx_build(a) and a.target == ""
            and a.backend in (None, "tensorrt-rtx")),
    Refusal(("build", "{recipe}", "--max-seq", "64", "--out", "{missing}"),  # was ignored
            "--max-seq: expected --onnx DIR with it", lambda p, a: p == "build" and bool(a.recipe)
            and any(v is not None for v in (a.max_batch, a.max_seq, a.decode_batch, a.verify_seq))),
    Refusal(("build", "--onnx", "{export}", "--verify-seq", "1", "--out", "{missing}"),
            "--verify-seq 1: expected 2 <= seq <= the export's capacity", lambda p, a: p == "build"
            and onnx_build(a) and a.verify_seq is not None and not 2 <= a.verify_seq <= CAPACITY),
    Refusal(("build", "{recipe}", "--rank", "0", "--stage", "0", "--out", "{missing}"),
            "--rank 0: ", lambda p, a: p == "build" and bool(a.recipe) and a.rank is not None),
    Refusal(("build", "{recipe}", "--stage", "2", "--out", "{missing}"), "--stage 2: expected a stage of",
            lambda p, a: p == "build" and bool(a.recipe) and any(i >= RECIPE_STAGES for i in a.stage or [])),
    Refusal(("build", "{recipe}", "--backend", "onnx", "--strip", "--out", "{missing}"),
            "build --backend onnx --strip: ", lambda p, a: p == "build" and bool(a.recipe)
            and a.backend == "onnx" and a.strip),
    Refusal(("build", "{recipe}", "--backend", "onnx", "--target", "sm89", "--out", "{missing}"),
            "build --backend onnx --target: ", lambda p, a: p == "build" and bool(a.recipe)
            and a.backend == "onnx" and a.target is not None),
    # plan
    Refusal(("plan",), "plan: expected a RECIPE file or --preset NAME --stages N",
            lambda p, a: p == "plan" and (a.recipe is None) == (a.preset is None)),
    Refusal(("plan", "{recipe}", "--preset", "k3-tiny"), "plan: expected a RECIPE file or --preset NAME",
            lambda p, a: p == "plan" and (a.recipe is None) == (a.preset is None)),
    # was ignored:
    Refusal(("plan", "{recipe}", "--context", "4096"), "--context: expected --preset NAME with it",
            lambda p, a: p == "plan" and bool(a.recipe) and any(
                getattr(a, d) not in (None, False)
                for d in ("stages", "packed_experts", "dtype", "context", "batch", "prefill_tokens"))),
    Refusal(("plan", "--preset", "k3-tiny"), "plan --preset: expected --stages N",
            lambda p, a: p == "plan" and a.preset and not a.recipe and a.stages is None),
    Refusal(("plan", "--preset", "k3-tiny", "--stages", "10"), "10 stages for 9 layers: expected 1..9 stages",
            lambda p, a: p == "plan" and a.preset == "k3-tiny" and not a.recipe
            and (a.stages or 0) > TINY_LAYERS),
    Refusal(("plan", "--preset", "k3-tiny", "--stages", "2", "--host-gb", "100"),
            "plan --host-gb: expected --ranks N > 1", lambda p, a: p == "plan" and (a.ranks or 1) == 1
            and (a.host_gb is not None or a.collective_gb_per_s is not None)),
    # export
    Refusal(("export", "--preset", "k3-tiny", "--packed-experts", "--out", "{missing}"),
            "--packed-experts: expected --checkpoint DIR",
            lambda p, a: p == "export" and a.packed_experts and not (a.checkpoint or a.no_weights)),
    Refusal(("export", "--preset", "k3-tiny", "--rank", "1", "--out", "{missing}"),
            "rank = 1: expected 0 <= rank < ranks = 1", lambda p, a: p == "export" and a.rank >= a.ranks),
    Refusal(("export", "--preset", "k3-tiny", "--ranks", "4", "--out", "{missing}"),
            "ranks = 4 does not divide", lambda p, a: p == "export" and a.preset == "k3-tiny"
            and a.ranks not in TINY_RANKS),
    Refusal(("export", "--preset", "k3-tiny", "--layers", "3:1", "--out", "{missing}"),
            "--layers '3:1': expected A:B with 0 <= A < B <= 9",
            lambda p, a: p == "export" and a.preset == "k3-tiny" and layers_out_of_range(a.layers)),
    Refusal(("export", "--preset", "k3-tiny", "--no-weights", "--seed", "1", "--out", "{missing}"),
            "--seed with --no-weights: ", lambda p, a: p == "export" and a.seed is not None
            and bool(a.no_weights or a.checkpoint)),
    # run
    Refusal(("run", "{build}", "--prompt-ids", "1,2,3", "--batch", "2"), "--prompt-ids with --batch: ",
            lambda p, a: p == "run" and bool(a.prompt_ids) and a.batch is not None),
    Refusal(("run", "{build}", "--prompt-ids", "1,2,3", "--prompt-len", "32"),
            "--prompt-ids with --prompt-len: ",
            lambda p, a: p == "run" and bool(a.prompt_ids) and a.prompt_len is not None),
    Refusal(("run", "{build}", "--prompt-ids", "1,2,256"), "--prompt-ids: token id 256",
            lambda p, a: p == "run" and any(t >= TINY_VOCABULARY for t in a.prompt_ids or [])),
    Refusal(("run", "{build}", "--stop", "300"), "--stop: token id 300",
            lambda p, a: p == "run" and any(t >= TINY_VOCABULARY for t in a.stop)),
    Refusal(("run", "{build}", "--runner", "engine"), "--runner engine: ",
            lambda p, a: p == "run" and a.runner == "engine"),
    Refusal(("run", "{build}", "--max-new-tokens", "1000"), "--max-new-tokens 1000: the longest row holds "
            "32 + 999 = 1031 tokens", lambda p, a: p == "run" and past_capacity(a, p)),
    Refusal(("run", "{build}", "--speculate", "1000000000"), "--speculate 1000000000: a row's cache holds "
            "its prompt, its new tokens and a call's padding up to 3K + 1 tokens: 32 + 16 + 3 x 1000000000 > "
            "the cache capacity 256; at most --speculate 69",
            lambda p, a: p == "run" and drafts_past_capacity(a)),
    Refusal(("run", "{build}", "--speculate", "2", "--temperature", "0.5", "--top-k", "1"),
            "--speculate 2: --top-k 1 keeps one token a position", lambda p, a: p == "run"
            and bool(given(a, "speculate")) and a.temperature > 0 and (a.top_k == 1 or a.top_p == 0)),
    Refusal(("run", "{build}", "--top-k", "5"), "--top-k 5 with --temperature 0: ",
            lambda p, a: p == "run" and a.temperature == 0 and (a.top_k > 0 or a.top_p < 1)),
    Refusal(("run", "{build}", "--top-p", "0.9"), "--top-p 0.9 with --temperature 0: ",
            lambda p, a: p == "run" and a.temperature == 0 and (a.top_k > 0 or a.top_p < 1)),
    Refusal(("run", "{build}", "--drafts", "suffix"), "--drafts suffix: expected --speculate K",
            lambda p, a: p == "run" and bool(given(a, "drafts")) and not given(a, "speculate")),
    Refusal(("run", "{build}", "--draft-min-match", "2"), "--draft-min-match 2: expected --speculate K",
            lambda p, a: p == "run" and bool(given(a, "draft_min_match")) and not given(a, "speculate")),
    Refusal(("run", "{build}", "--speculate", "2", "--draft-min-match", "3"),
            "--draft-min-match 3: expected 1 up to K = --speculate 2", lambda p, a: p == "run"
            and bool(given(a, "speculate")) and (given(a, "draft_min_match") or 0) > a.speculate),
]
