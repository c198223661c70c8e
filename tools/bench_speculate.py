"""Speculative decoding against plain decoding in ONNX Runtime, side by side in one run.

    python tools/bench_speculate.py [--out out/bench-speculate] [--preset k3-small] [--tokens 48]
                                    [--drafts 4] [--threads 1] [--repeats 3] [--calls 20]

The preset is exported once into --out (float32, capacity 512) and run as a one-stage pipeline
(runtime.Pipeline: ONNX Runtime through IO binding), batch 1, greedy, --tokens new tokens from a
64-token prompt that repeats a 16-token phrase four times. Each repeat runs every mode in turn:

    plain    runtime.generate: one call a token
    oracle   run --speculate K with the true continuation as drafts (every draft accepted: the ceiling)
    wrong    the same drafts, each call's first one wrong (nothing accepted: the floor)
    a=0.5..  the true continuation, each draft kept with probability a (seeded; `rate_drafter`)
    suffix   the suffix automaton (runtime.drafts.SuffixDrafter), at the default minimum match
    ngram    prompt lookup (runtime.drafts.NgramDrafter), the same

and asserts each mode's tokens are plain's. Times are medians over the repeats, in CPU seconds of this
process (ONNX Runtime's threads included; wall seconds beside them: the machine is shared). Then:

- one call's cost at a cache of the prompt's length, as the runtime makes it (onnx.runner.Rollback
  with the call's draft_lengths): a decode call; a verify (1 + K tokens, the row's KDA caches copied
  first); the call after a verify rejected at its first draft (the row taken back, 2 tokens re-fed
  and K new drafts, no copy: the kept one is its state), at its last (K + 1 re-fed, K drafts) and
  after consecutive rejections, at the cap of 3K + 1 tokens (2K + 1 re-fed, K drafts);
- tokens a call of runtime.speculation.Speculation driven by a model that always gives the true
  continuation (no graph: every token is the truth's, so only the drafts decide), 4 rows x 2000
  tokens of random text, each draft the true token with probability a: measured beside the formula
  for per-draft state slots (1 - a^(K+1)) / (1 - a), at the runtime's 3K + 1 tokens a call, 2K + 1 and
  any;
- the drafters' cost a call a row at 4K and 32K tokens of random text (no match: the case where they
  cannot help): the suffix automaton, the n-gram index, and the naive rescan they replaced;
- the minimum match length: tokens a call and drafted tokens a call of the suffix drafter at minimum
  1 to 4 on text that repeats itself (each token copied from an earlier place with probability 0.8,
  else random) and on random text over 256 ids (matches by coincidence only), and what a call then
  costs on this CPU (a drafted token costs (verify - decode) / K of a decode call, measured above).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from k3export.cli import main as k3export
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE
from k3export.onnx.runner import CALL_TOKENS_PER_DRAFT, DRAFT_LENGTHS, BoundOnnxrtRunner, Signature
from k3export.runtime import Pipeline, Sampler, generate
from k3export.runtime.drafts import (
    DEFAULT_MIN_MATCH,
    DRAFTS,
    NGRAM_LONGEST,
    ContinuationDrafter,
    Drafter,
    SuffixDrafter,
    earlier_match,
)
from k3export.runtime.schedule import MicroBatch
from k3export.runtime.speculation import Speculation, speculate, truth_logits

CAPACITY = 512
RATES = (0.5, 0.7, 0.9)


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


def rate_drafter(truth: list[int], vocab: int, rate: float, seed: int) -> ContinuationDrafter:
    """The true continuation with each draft kept with probability `rate` (seeded): its first wrong
    draft sits after a geometric number of right ones (none within a call's K: all right)."""
    rng = np.random.default_rng(seed)

    def first_wrong(_: int) -> int:
        right = 0
        while rng.random() < rate:
            right += 1
        return right

    return ContinuationDrafter(truth, vocab, first_wrong)


def slots_formula(rate: float, drafts: int) -> float:
    """Tokens a call with per-draft state slots: 1 + a + ... + a^K."""
    return (1 - rate ** (drafts + 1)) / (1 - rate)


def modes(prompt: list[int], truth: list[int], vocab: int) -> dict[str, Callable[[], Drafter]]:
    """Each speculative mode's drafter factory."""
    text = prompt + truth
    return {"oracle": lambda: ContinuationDrafter(text, vocab),
            "wrong": lambda: ContinuationDrafter(text, vocab, lambda n: 0),
            **{f"a={a}": lambda a=a: rate_drafter(text, vocab, a, 0) for a in RATES},
            **{name: lambda make=make: make(DEFAULT_MIN_MATCH) for name, make in DRAFTS.items()}}


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


def call_costs(folder: Path, prompt: list[int], drafts: int, threads: int,
               calls: int) -> dict[str, tuple[int, float]]:
    """Each kind of call the runtime makes: its tokens and median CPU milliseconds, from a cache of the
    prompt (one more token each round, so each call is legal), with its rollback as the runner does it."""
    signature = Signature(json.loads((folder / MANIFEST_FILE).read_text()))
    runner = BoundOnnxrtRunner(folder / GRAPH_FILE, signature, threads=threads)
    runner.activate()
    runner.reset(1)

    def call(fed: int, cached: int, drafted: int) -> float:
        feed = {"input_ids": np.ones((1, fed), np.int64), "cache_lengths": np.array([cached], np.int64),
                "input_lengths": np.array([fed], np.int64), DRAFT_LENGTHS: np.array([drafted], np.int64)}
        return timed(lambda: runner.infer(feed, check_inputs=False))[1] * 1e3

    call(len(prompt), 0, 0)
    # The kinds by the tokens a row feeds: a verify feeds its last token and K drafts; after a rejection the
    # call re-feeds the tokens from the rollback's point and K new drafts, up to the cap of 3K + 1
    # (onnx.runner.CALL_TOKENS_PER_DRAFT) after consecutive rejections.
    fed = {"decode": 1, "verify (copies)": 1 + drafts,
           "after a verify rejected at its first draft": 2 + drafts,
           "after a verify rejected at its last": 2 * drafts + 1,
           "after consecutive rejections (the cap)": CALL_TOKENS_PER_DRAFT * drafts + 1}
    times: dict[str, list[float]] = {name: [] for name in fed}
    longest = max(fed.values())
    cached = len(prompt)
    for _ in range(calls):
        # Each drafting call taken back to the verify's cache length (the kept state is the row's own then);
        # the decode follows the longest with all of it accepted.
        for name, tokens in fed.items():
            if name != "decode":
                times[name].append(call(tokens, cached, drafts))
        times["decode"].append(call(1, cached + longest, 0))
        cached += longest + 1
    runner.deactivate()
    return {name: (fed[name], statistics.median(t)) for name, t in times.items()}


def replay(texts: list[list[int]], prompt_len: int, drafters: list[Drafter], drafts: int,
           longest: int = 0) -> dict:
    """Speculation's counts for `texts` (each a prompt of `prompt_len` and its continuation) with a
    model that always gives the text's next token (one-hot logits): no graph runs."""
    prompts = [t[:prompt_len] for t in texts]
    vocab = max(max(t) for t in texts) + 1
    speculation = Speculation(prompts, len(texts[0]) - prompt_len, drafters, drafts, longest=longest)
    batch = MicroBatch.of(0, range(len(prompts)), prompts)
    while not batch.finished:
        speculation.request(batch)
        speculation.take(batch, truth_logits(batch, texts, vocab))
        batch.calls += 1
    return speculation.counts


def tokens_a_call_table(drafts: int) -> list[dict]:
    """Tokens a call at each rate, at the runtime's 3K + 1 (Speculation's default), 2K + 1 and any number
    of tokens a call (a row's caches permitting), beside the slots' formula: 4 rows x 2000 tokens of
    random text."""
    rng = np.random.default_rng(1)
    texts = [rng.integers(0, 1000, 2016).tolist() for _ in range(4)]
    rows = []
    for rate in RATES:
        measured = {}
        for name, longest in (("run", 0), ("2K+1", 2 * drafts + 1), ("any", 10 ** 6)):
            drafters = [rate_drafter(t, 1000, rate, seed) for seed, t in enumerate(texts)]
            counts = replay(texts, 16, drafters, drafts, longest)
            measured[name] = counts["tokens_per_call"]
        rows.append({"a": rate, "formula": slots_formula(rate, drafts), **measured,
                     "row_calls": counts["row_calls"]})
    return rows


def naive_ngram(shortest: int) -> Drafter:
    """The prompt lookup before the index: earlier_match rescanning the whole text each call."""
    class Rescan:
        def propose(self, text: list[int], count: int) -> list[int]:
            length, end = earlier_match(text, NGRAM_LONGEST)
            return list(text[end + 1:end + 1 + count]) if length >= shortest else []
    return Rescan()


def drafter_costs(lengths: tuple[int, ...] = (4096, 32768), calls: int = 50) -> list[dict]:
    """Microseconds a propose a row, at each text length: the drafter extended to the length first
    (untimed), then `calls` calls, 3 new tokens each; random tokens of a 163840-token vocabulary
    (kimi-k3's), so no suffix of the text occurred before."""
    rng = np.random.default_rng(2)
    rows = []
    for length in lengths:
        tokens = rng.integers(0, 163840, length + 3 * calls).tolist()
        row = {"tokens": length}
        for name, make in (("suffix", DRAFTS["suffix"]), ("ngram", DRAFTS["ngram"]),
                           ("rescan (before)", naive_ngram)):
            drafter, text = make(1), tokens[:length]  # a row's text: a list that grows, as the runtime's
            drafter.propose(text, 4)
            start = time.process_time()
            for _ in range(calls):
                text += tokens[len(text):len(text) + 3]
                drafter.propose(text, 4)
            row[name] = (time.process_time() - start) / calls * 1e6
        rows.append(row)
    return rows


def repeating_text(rng: np.random.Generator, length: int, vocab: int, copy: float) -> list[int]:
    """Tokens each copied, with probability `copy`, from where the text's last copy left off (a run
    from a random earlier place, started afresh with probability 0.1), else random."""
    text, source = rng.integers(0, vocab, 8).tolist(), 0
    while len(text) < length:
        if rng.random() < copy:
            if rng.random() < 0.1 or source >= len(text) - 1:
                source = int(rng.integers(0, len(text) - 1))
            text.append(text[source])
            source += 1
        else:
            text.append(int(rng.integers(0, vocab)))
    return text


def min_match_table(drafts: int, drafted_cost: float) -> list[dict]:
    """Per minimum match 1..4: tokens a call and drafts a call of the suffix drafter, 4 rows x 1000
    tokens after 32, on text that repeats itself (a 32768-token vocabulary) and on random text over 256
    ids (k3-tiny's vocabulary: short matches by coincidence, nothing to gain); `efficiency` is tokens a
    call over a call's cost in decode calls."""
    rng = np.random.default_rng(3)
    texts = {"repeating": [repeating_text(rng, 1032, 32768, 0.8) for _ in range(4)],
             "random over 256": [rng.integers(0, 256, 1032).tolist() for _ in range(4)]}
    rows = []
    for shortest in range(1, 5):
        row = {"min_match": shortest}
        for name, rows_text in texts.items():
            counts = replay(rows_text, 32, [SuffixDrafter(shortest) for _ in rows_text], drafts)
            tokens, drafted = counts["tokens_per_call"], counts["drafted"] / counts["row_calls"]
            row[name] = {"tokens_per_call": tokens, "drafted_per_call": drafted,
                         "efficiency": tokens / (1 + drafted_cost * drafted)}
        rows.append(row)
    return rows


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
    k = args.drafts
    pipeline = Pipeline([folder], args.threads)
    try:
        rows = generation_table(pipeline, prompt, args.tokens, k, vocab, args.repeats)
        costs = call_costs(folder, prompt, k, args.threads, args.calls)
        drafted_cost = (costs["verify (copies)"][1] / costs["decode"][1] - 1) / k
    finally:
        pipeline.close()
    print(f"{args.preset}, float32, batch 1, K = {k}, {args.tokens} tokens from a 64-token prompt, "
          f"{args.threads} thread(s), medians of {args.repeats}")
    print("| mode | calls | tokens a call | drafts accepted | CPU s | wall s | vs plain (CPU) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['calls']} | {r['tokens_per_call']:.2f} | {r['accepted'] or '-'} | "
              f"{r['cpu_seconds']:.2f} | {r['wall_seconds']:.2f} | {r['speedup']:.2f}x |")
    print(f"\none call at a cache of {len(prompt)}+ tokens as the runtime makes it, CPU ms, median of "
          f"{args.calls}:")
    print("| call | tokens | CPU ms | vs decode |")
    print("|---|---|---|---|")
    for name, (tokens, ms) in costs.items():
        print(f"| {name} | {tokens} | {ms:.1f} | {ms / costs['decode'][1]:.2f}x |")
    table = tokens_a_call_table(k)
    print(f"\ntokens a call, Speculation with a model giving the truth, K = {k}, 4 rows x 2000 tokens "
          f"({table[0]['row_calls']}+ row calls each):")
    print("| a | slots' (1 - a^(K+1)) / (1 - a) | 3K + 1 a call (run's) | 2K + 1 | any |")
    print("|---|---|---|---|---|")
    for r in table:
        print(f"| {r['a']} | {r['formula']:.2f} | {r['run']:.2f} ({r['run'] / r['formula'] - 1:+.1%}) | "
              f"{r['2K+1']:.2f} ({r['2K+1'] / r['formula'] - 1:+.1%}) | {r['any']:.2f} |")
    print("\nthe drafters a call a row, CPU us (random text: no match), 3 new tokens a call:")
    costs_rows = drafter_costs()
    print("| text tokens | suffix | ngram | rescan (before) |")
    print("|---|---|---|---|")
    for r in costs_rows:
        print(f"| {r['tokens']} | {r['suffix']:.1f} | {r['ngram']:.1f} | {r['rescan (before)']:.1f} |")
    print(f"\nminimum match length (suffix drafter, K = {k}); a drafted token costs {drafted_cost:.3f} of a "
          "decode call here; efficiency = tokens a call / a call's cost in decode calls:")
    print("| min match | repeating: tokens a call | drafts a call | efficiency | random over 256: tokens a "
          "call | drafts a call | efficiency |")
    print("|---|---|---|---|---|---|---|")
    for r in min_match_table(k, drafted_cost):
        a, b = r["repeating"], r["random over 256"]
        print(f"| {r['min_match']} | {a['tokens_per_call']:.2f} | {a['drafted_per_call']:.2f} | "
              f"{a['efficiency']:.2f} | {b['tokens_per_call']:.2f} | {b['drafted_per_call']:.2f} | "
              f"{b['efficiency']:.2f} |")


if __name__ == "__main__":
    main()
