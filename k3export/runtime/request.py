"""A run's request, as `k3export run` and the torchrun process take it: their shared arguments, the
prompts (refused before any session unless they fit the build), each stage's ONNX Runtime threads,
and the report of what was generated."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from k3export.errors import UserError
from k3export.onnx.export import MANIFEST_FILE
from k3export.options import (
    BUILD_DIR,
    integer,
    non_negative_int,
    non_negative_real,
    positive_int,
    probability,
    require_request_fits,
    seed,
    token_ids,
)
from k3export.runtime.drafts import DEFAULT_MIN_MATCH, DRAFTS, NGRAM_LONGEST
from k3export.runtime.engines import RUNNERS
from k3export.runtime.generation import Generation, Sampler
from k3export.runtime.pipeline import Stage
from k3export.runtime.schedule import MicroBatch, default_micro_batches, split_prompts


def intra_op_threads(args: argparse.Namespace, processes: int) -> int:
    """ONNX Runtime's intra-op threads for one of `processes` stage processes on this host: --threads,
    or its share of the cores this process may run on (at least one), so the stages do not fight."""
    if args.threads is None:
        return max(1, len(os.sched_getaffinity(0)) // processes)
    return args.threads


# ONNX Runtime cannot start 10^9 threads (an internal error, found by the CLI fuzz): 1024 is beyond
# any host here.
THREADS = integer(1, 1024)


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """`batch` prompts of different lengths, the first `prompt_len` tokens long."""
    rng = np.random.default_rng(seed)
    lengths = [max(1, prompt_len * (batch - b) // batch) for b in range(batch)]
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


# A request's random prompts unless --batch and --prompt-len say otherwise.
BATCH, PROMPT_LEN = 1, 32


def vocab_size(export_dir: Path) -> int:
    return json.loads((export_dir / "config.json").read_text())["vocab_size"]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("build", metavar="DIR", type=BUILD_DIR, help="a `k3export build RECIPE` folder")
    parser.add_argument("--prompt-len", type=positive_int,
                        help=f"tokens of the longest random prompt (default {PROMPT_LEN})")
    parser.add_argument("--prompt-ids", metavar="IDS", type=token_ids,
                        help="one prompt, comma-separated token ids (instead of --batch and --prompt-len)")
    parser.add_argument("--batch", type=positive_int,
                        help=f"random prompts of different lengths (default {BATCH})")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the prompts and the sampler")
    parser.add_argument("--max-new-tokens", type=positive_int, default=16)
    parser.add_argument("--temperature", type=non_negative_real, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="0: no cut")
    parser.add_argument("--top-p", type=probability, default=1.0)
    parser.add_argument("--stop", type=non_negative_int, action="append", default=[], metavar="ID",
                        help="stop token")
    parser.add_argument("--micro-batches", type=positive_int, metavar="M",
                        help="the batch's rows in M groups of consecutive rows, sizes differing by at most "
                        "one, in flight together under torchrun (default: as many as stages, at most the "
                        "batch); in one process only the grouping changes")
    parser.add_argument("--threads", type=THREADS, metavar="N",
                        help="ONNX Runtime intra-op threads of each stage process (default: this host's "
                        "cores / the stage processes on it)")
    parser.add_argument("--runner", choices=RUNNERS,
                        help="engine: the stages' TensorRT engines on GPUs (a GPU a process, LOCAL_RANK); "
                        "onnx: their ONNX graphs in ONNX Runtime on CPU (default: engine when the build "
                        "holds engines for every stage, else onnx)")
    parser.add_argument("--speculate", type=positive_int, metavar="K",
                        help="speculative decoding: up to K drafted tokens a row checked in each call, the "
                        "call after rejections re-feeding tokens too, 3K + 1 at most (engines need a verify "
                        "profile of 3K + 1 tokens); greedy: the same tokens as without; sampled: each token "
                        "from the same distribution, a generator a row")
    parser.add_argument("--drafts", choices=DRAFTS,
                        help="with --speculate: suffix (a suffix automaton of the text, the default) or "
                        f"ngram (prompt lookup, n-grams of up to {NGRAM_LONGEST} tokens)")
    parser.add_argument("--draft-min-match", type=positive_int, metavar="N",
                        help="with --speculate: draft only after a match of at least N tokens of the text's "
                        f"end, 1 up to K (default {DEFAULT_MIN_MATCH})")
    parser.add_argument("--json", action="store_true")


def prompts_of(args: argparse.Namespace, exports: list[Path]) -> list[list[int]]:
    """The request's prompts (--prompt-ids, or --batch random ones of up to --prompt-len tokens),
    refused before any session is made unless its token ids (and --stop's) are in the vocabulary
    and its longest row fits the stages' cache capacity and this machine's memory."""
    vocab = vocab_size(exports[0])
    for option, ids in (("--prompt-ids", args.prompt_ids or []), ("--stop", args.stop)):
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise UserError(f"{option}: token id {outside[0]} is outside the vocabulary of {args.build} "
                            f"(ids 0..{vocab - 1})")
    if args.prompt_ids:
        # One prompt of its own length: a --batch or --prompt-len beside it would be ignored.
        given = (("--batch", args.batch), ("--prompt-len", args.prompt_len))
        ignored = [option for option, value in given if value is not None]
        if ignored:
            raise UserError(f"--prompt-ids with {ignored[0]}: --prompt-ids is one prompt of its own length; "
                            "expected --prompt-ids IDS alone, or --batch N --prompt-len L (random prompts)")
        batch, prompt_len = 1, len(args.prompt_ids)
        request = f"--prompt-ids ({prompt_len} tokens)"
    else:
        batch, prompt_len = args.batch or BATCH, args.prompt_len or PROMPT_LEN
        request = f"--batch {batch} --prompt-len {prompt_len}"
    manifests = [json.loads((d / MANIFEST_FILE).read_text()) for d in exports]
    require_request_fits(f"{request} --max-new-tokens {args.max_new_tokens}", manifests, batch, prompt_len,
                         args.max_new_tokens - 1)
    return [args.prompt_ids] if args.prompt_ids else random_prompts(batch, prompt_len, vocab, args.seed)


def sampler_of(args: argparse.Namespace) -> Sampler:
    """The request's sampler. --top-k and --top-p cut a sampled distribution; greedy decoding
    (--temperature 0) takes the most likely token whatever they say, so a cut beside it is refused."""
    cuts = [f"--top-k {args.top_k}"] if args.top_k else []
    cuts += [f"--top-p {args.top_p}"] if args.top_p < 1 else []
    if args.temperature == 0 and cuts:
        raise UserError(f"{cuts[0]} with --temperature 0: greedy decoding ignores the cut; expected "
                        "--temperature T > 0 to sample with it, or no cut")
    return Sampler(args.temperature, args.top_k, args.top_p, args.seed)


def micro_batches_of(args: argparse.Namespace, prompts: list[list[int]], stages: int) -> list[MicroBatch]:
    """The prompts in --micro-batches groups (default: as many as `stages`, at most the batch), refused
    before any session is made unless there are 1 up to the batch."""
    return split_prompts(prompts, args.micro_batches or default_micro_batches(len(prompts), stages))


def report(args: argparse.Namespace, result: Generation, names: list[str]) -> None:
    summary = result.summary()
    if args.json:
        print(json.dumps(summary))
        return
    for b, row in enumerate(result.tokens):
        print(f"row {b}: {row}")
    rate = summary["decode_tokens_per_second"]
    print(f"prefill {result.prefill_seconds * 1e3:.1f} ms; {result.decode_steps} decode steps in "
          f"{result.decode_seconds:.2f} s" + (f" ({rate:.1f} tokens/s)" if rate else "")
          + f"; {result.micro_batches} micro-batch{'es' if result.micro_batches > 1 else ''}"
          + (f", {result.threads} thread{'s' if result.threads != 1 else ''} a stage" if result.threads
             else ", engines"))
    for name, seconds, times in zip(names, result.stage_seconds, result.stages, strict=True):
        line = f"  {name}: {seconds:.3f} s in its graph"
        if times["busy_fraction"] is not None:
            sums = f" (sums {times['sums_seconds']:.3f} s)" if times["sums_seconds"] else ""
            line += (f"; decode: busy {times['busy_seconds']:.3f} s{sums}, waiting "
                     f"{times['waiting_seconds']:.3f} s ({times['busy_fraction']:.0%} busy), sends "
                     f"{times['sent_bytes_per_token']:.0f} B a token")
        print(line)
    if result.drafts is not None:
        print(drafts_line(result.drafts))


def drafts_line(counts: dict[str, Any]) -> str:
    """A speculative run's last line: runtime.speculation.Speculation's counts."""
    positions = ", ".join(f"{a}/{n}" for a, n in zip(counts["accepted_per_position"],
                                                     counts["drafted_per_position"], strict=True))
    rate = counts["tokens_per_call"]
    return (f"drafts: {counts['accepted']} of {counts['drafted']} accepted (by position: {positions}); "
            f"{'-' if rate is None else f'{rate:.2f}'} tokens a call a row; {counts['refeeding_calls']} of "
            f"{counts['decode_calls']} decode calls re-fed tokens after a rejection")


def stage_name(stage: Stage) -> str:
    return f"{stage.runner.name} (layers {stage.layers.start}..{stage.layers.stop - 1})"
