"""Speculative decoding against plain decoding in ONNX Runtime, side by side in one run.

    python tools/bench_speculate.py [--out out/bench-speculate] [--preset k3-small] [--tokens 48]
                                    [--drafts 4] [--threads 1] [--repeats 3] [--calls 20]

The preset is exported once into --out (float32, capacity 512) and run as a one-stage pipeline
(runtime.Pipeline: ONNX Runtime through IO binding), batch 1, greedy, --tokens new tokens from a
64-token prompt that repeats a 16-token phrase four times. Each repeat runs every mode in turn:

    plain    runtime.generate: one call a token
    oracle   run --speculate K with the true continuation as drafts (every draft accepted: the ceiling)
    wrong    the same drafts, each call's first one wrong (nothing accepted: the floor, a wasted verify
             and then a call that feeds the rejected call's token again)
    ngram    prompt lookup (runtime.drafts.NgramDrafter)
    suffix   the suffix automaton (runtime.drafts.SuffixDrafter)

and asserts each mode's tokens are plain's. Times are medians over the repeats, in CPU seconds of this
process (ONNX Runtime's threads included; wall seconds beside them: the machine is shared). Then one
call's cost at a cache of the prompt's length: a decode call (1 token), a verify call (K + 1 tokens,
with the rollback's copy of the KDA states and conv tails before it) and the call after a rejected
verify (1 token, its rows taken back first), medians over --calls calls each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from k3export.cli import main as k3export
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE
from k3export.onnx.runner import BoundOnnxrtRunner, Signature
from k3export.runtime import Pipeline, Sampler, generate
from k3export.runtime.drafts import ContinuationDrafter, NgramDrafter, SuffixDrafter
from k3export.runtime.speculation import Speculation, speculate

CAPACITY = 512


def export(out: Path, preset: str) -> Path:
    folder = out / preset
    if not (folder / MANIFEST_FILE).is_file():
        argv = ["export", "--preset", preset, "--dtype", "float32", "--capacity", str(CAPACITY), "--out",
                str(folder)]
        assert k3export(argv) == 0
    return folder


def prompt_of(vocab: int) -> list[int]:
    phrase = np.random.default_rng(0).integers(0, vocab, 16).tolist()
    return phrase * 4


def timed(run):
    """(result, CPU seconds, wall seconds) of run()."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = run()
    return result, time.process_time() - cpu, time.perf_counter() - wall


def modes(prompt: list[int], truth: list[int], vocab: int) -> dict:
    """Each speculative mode's drafter factory."""
    return {"oracle": lambda: ContinuationDrafter(prompt + truth, vocab),
            "wrong": lambda: ContinuationDrafter(prompt + truth, vocab, lambda n: 0),
            "ngram": NgramDrafter, "suffix": SuffixDrafter}


def generation_table(pipeline: Pipeline, prompt: list[int], tokens: int, drafts: int, vocab: int,
                     repeats: int) -> list[dict]:
    plain, *_ = timed(lambda: generate(pipeline, [prompt], tokens, Sampler()))
    truth = plain.tokens[0]
    samples: dict[str, list] = {}
    for _ in range(repeats):
        result, cpu, wall = timed(lambda: generate(pipeline, [prompt], tokens, Sampler()))
        samples.setdefault("plain", []).append((result, cpu, wall))
        for name, drafter in modes(prompt, truth, vocab).items():
            speculation = Speculation([prompt], tokens, [drafter()], drafts)
            result, cpu, wall = timed(lambda s=speculation: speculate(pipeline, s))
            assert result.tokens == plain.tokens, f"{name}: not plain decoding's tokens"
            samples.setdefault(name, []).append((result, cpu, wall))
    rows = []
    plain_cpu = statistics.median(cpu for _, cpu, _ in samples["plain"])
    for name, runs in samples.items():
        result = runs[0][0]
        cpu = statistics.median(c for _, c, _ in runs)
        calls = result.decode_steps + 1
        rows.append({"mode": name, "calls": calls, "tokens_per_call": tokens / calls,
                     "accepted": result.drafts and f"{result.drafts['accepted']}/{result.drafts['drafted']}",
                     "cpu_seconds": cpu, "wall_seconds": statistics.median(w for _, _, w in runs),
                     "speedup": plain_cpu / cpu})
    return rows


def call_costs(folder: Path, prompt: list[int], drafts: int, threads: int, calls: int) -> dict[str, float]:
    """Median CPU milliseconds of a decode call, a verify call of K + 1 tokens and the call after a
    rejected verify, from a cache of the prompt (one more token each round, so each call is legal)."""
    signature = Signature(json.loads((folder / MANIFEST_FILE).read_text()))
    runner = BoundOnnxrtRunner(folder / GRAPH_FILE, signature, threads=threads)
    runner.activate()
    runner.reset(1)

    def call(ids: list[int], cached: int) -> float:
        feed = {"input_ids": np.array([ids], np.int64), "cache_lengths": np.array([cached], np.int64),
                "input_lengths": np.array([len(ids)], np.int64)}
        return timed(lambda: runner.infer(feed, check_inputs=False))[1] * 1e3

    call(prompt, 0)
    cached, times = len(prompt), {"decode": [], "verify": [], "after a rejected verify": []}
    for _ in range(calls):
        times["verify"].append(call([1] * (drafts + 1), cached))
        times["after a rejected verify"].append(call([1], cached))  # rows taken back, then one token
        times["decode"].append(call([1], cached + 1))
        cached += 2
    runner.deactivate()
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/bench-speculate"))
    parser.add_argument("--preset", default="k3-small")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--drafts", type=int, default=4, help="K")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    folder = export(args.out, args.preset)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompt = prompt_of(vocab)
    pipeline = Pipeline([folder], args.threads)
    try:
        rows = generation_table(pipeline, prompt, args.tokens, args.drafts, vocab, args.repeats)
    finally:
        pipeline.close()
    print(f"{args.preset}, float32, batch 1, K = {args.drafts}, {args.tokens} tokens from a 64-token prompt, "
          f"{args.threads} thread(s), medians of {args.repeats}")
    print("| mode | calls | tokens a call | drafts accepted | CPU s | wall s | vs plain (CPU) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['calls']} | {r['tokens_per_call']:.2f} | {r['accepted'] or '-'} | "
              f"{r['cpu_seconds']:.2f} | {r['wall_seconds']:.2f} | {r['speedup']:.2f}x |")
    costs = call_costs(folder, prompt, args.drafts, args.threads, args.calls)
    print(f"\none call at a cache of {len(prompt)} tokens, CPU ms, median of {args.calls}:")
    print("| call | CPU ms | vs decode |")
    print("|---|---|---|")
    for name, ms in costs.items():
        print(f"| {name} | {ms:.1f} | {ms / costs['decode']:.2f}x |")


if __name__ == "__main__":
    main()
