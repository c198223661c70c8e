"""Speculative decoding through a pipeline in this process: drafts (runtime.drafts) checked by the
model in one call, with the same tokens as plain greedy decoding, or, sampled, each token from the
distribution plain sampling draws from (`sampled`).

Each call feeds a row the tokens of its text not yet in the caches (`pending`) and then up to K drafts;
the logits at the last pending token and at each draft are the choices there. The drafts that match
them are accepted, and the choice after the last accepted one is a token of its own (the correction,
or the bonus when all match): one call gives 1 to K+1 tokens.

The rollback (onnx.runner.Rollback, in every runner) is a re-run from a kept state: when every draft
of a row was accepted its caches hold its text and the next call goes on from there; when some was
rejected, its caches hold rejected tokens, so the next call gives the row its cache length of before
the verify (its runners take back their states kept then) and feeds the accepted tokens again with the
correction, and new drafts after them. A row so drafts on every call after its prefill, and no call is
ever spent on the rollback alone. The kept state is the one before the call, so a re-run whose own
drafts are rejected goes back there again and its pending tokens grow; a row's call feeds at most
`longest` tokens (3K + 1, what a verify profile takes: `CALL_TOKENS_PER_DRAFT`), its drafts cut to fit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3export.errors import UserError
from k3export.onnx.export import MANIFEST_FILE
from k3export.onnx.runner import CALL_TOKENS_PER_DRAFT
from k3export.runtime.drafts import DEFAULT_DRAFTS, DEFAULT_MIN_MATCH, DRAFTS, Drafter
from k3export.runtime.generation import Generation, Sampler, through_stages
from k3export.runtime.pipeline import Pipeline
from k3export.runtime.schedule import MicroBatch, StageTimes, round_robin, split_prompts


def speculation_of(args: argparse.Namespace, exports: list[Path], prompts: list[list[int]],
                   sampler: Sampler) -> Speculation | None:
    """The request's speculation (None without --speculate) with the request's `sampler`, refused before
    any stage loads unless the sampler keeps more than one token (or is greedy), the last stage gives every
    position's logits, and each row's caches hold its prompt, its new tokens and a call's padding."""
    for name, value in (("--drafts", args.drafts), ("--draft-min-match", args.draft_min_match)):
        if value and not args.speculate:
            raise UserError(f"{name} {value}: expected --speculate K (drafts are made to be verified)")
    if not args.speculate:
        return None
    option = f"--speculate {args.speculate}"
    if (args.draft_min_match or 0) > args.speculate:
        raise UserError(f"--draft-min-match {args.draft_min_match}: expected 1 up to K = --speculate "
                        f"{args.speculate}")
    min_match = args.draft_min_match or min(DEFAULT_MIN_MATCH, args.speculate)
    if args.temperature > 0 and (args.top_k == 1 or args.top_p == 0):
        cut = "--top-k 1" if args.top_k == 1 else "--top-p 0"
        raise UserError(f"{option}: {cut} keeps one token a position, which is greedy decoding; expected "
                        "--temperature 0 for it (or a sampler that keeps more)")
    manifests = [json.loads((d / MANIFEST_FILE).read_text()) for d in exports]
    if manifests[-1].get("last_logits"):
        raise UserError(f"{option}: the build's last stage gives each row's last logits only "
                        "(--last-logits); a verify needs every position's")
    capacity = min(m["capacity"] for m in manifests)
    prompt_len = max(len(p) for p in prompts)
    limit = (capacity - prompt_len - args.max_new_tokens) // CALL_TOKENS_PER_DRAFT
    if args.speculate > limit:
        room = f"at most --speculate {limit}" if limit > 0 else "no room for drafts"
        raise UserError(f"{option}: a row's cache holds its prompt, its new tokens and a call's padding "
                        f"up to 3K + 1 tokens: {prompt_len} + {args.max_new_tokens} + 3 x {args.speculate} > "
                        f"the cache capacity {capacity}; {room}")
    drafters = [DRAFTS[args.drafts or DEFAULT_DRAFTS](min_match) for _ in prompts]
    return Speculation(prompts, args.max_new_tokens, drafters, args.speculate, frozenset(args.stop),
                       sampler if args.temperature > 0 else None)


def require_verify_profiles(speculation: Speculation, engines: list[Path], exports: list[Path],
                            rows: int) -> None:
    """Refuses `--speculate K` on engines, before any loads, unless each stage's engine has a profile
    that takes a call of `rows` (the largest micro-batch) x 3K + 1 tokens (a verify profile, or a
    prefill profile that happens to): a call after rejections re-feeds the tokens since the kept
    state with up to K drafts, cut to fit 3K + 1 (`CALL_TOKENS_PER_DRAFT`). (Capping that call's
    drafts to a shorter profile would cost tokens a call on every rejection, quietly; a build names its
    verify length once.)"""
    from k3export.engine.runner import binding_plan, engine_record

    tokens = speculation.longest
    for stage, (engine, export) in enumerate(zip(engines, exports, strict=True)):
        plan = binding_plan(export, engine_record(engine)["profiles"])
        capacity = json.loads((export / MANIFEST_FILE).read_text())["capacity"]
        try:
            plan.profile({"batch": rows, "seq": tokens, "capacity": capacity})
        except UserError:
            raise UserError(f"--speculate {speculation.drafts}: a call of {rows} rows x {tokens} tokens "
                            f"(3K + 1: tokens re-fed after rejections and up to K drafts) fits none of stage "
                            f"{stage}'s engine profiles ({engine}); build it with [profiles] verify = "
                            f"{{seq = {tokens}}} (build --onnx: --verify-seq {tokens})") from None


def accepted(drafts: list[int], choices: np.ndarray) -> int:
    """How many leading drafts are the greedy choices before them (`choices[i]` follows draft i-1)."""
    count = 0
    while count < len(drafts) and drafts[count] == choices[count]:
        count += 1
    return count


def sampled(drafts: list[int], logits: np.ndarray, sampler: Sampler,
            rng: np.random.Generator) -> tuple[int, int]:
    """Speculative sampling's rule (Leviathan et al. 2023; Chen et al. 2023) for point-mass drafts:
    draft x at a position is accepted with probability p(x), p the distribution plain sampling draws
    from there (`sampler.distribution` of `logits[i]`, the logits before draft i); at the first
    rejection the token is drawn from p with x removed, renormalised (max(p - q, 0) for q all on x);
    after the last accepted draft, from p. Each token so has plain sampling's distribution. Returns
    (drafts accepted, the token after them)."""
    for i, draft in enumerate(drafts):
        tokens, p = sampler.distribution(logits[i])
        if rng.random() < p[tokens == draft].sum():
            continue
        p = np.where(tokens == draft, 0.0, p)
        return i, int(tokens[rng.choice(len(p), p=p / p.sum())])
    tokens, p = sampler.distribution(logits[len(drafts)])
    return len(drafts), int(tokens[rng.choice(len(p), p=p)])


@dataclass
class Speculation:
    """Each row's text (prompt and new tokens), its tokens in the caches and its drafts, on the process
    that sees the logits: what a micro-batch's next call feeds (`request`) and what its logits accept
    (`take`). Its `rows`, `prefilled_at` and `decode_seconds` are schedule.Tokens' (what a run reports).
    `sampler`: None decodes greedily; else its distribution is sampled with the speculative rule
    (`sampled`), each row from its own generator seeded by (the sampler's seed, the row)."""

    prompts: list[list[int]]
    max_new_tokens: int
    drafters: list[Drafter]
    drafts: int  # K: drafts a row proposes at most a call
    stop_tokens: frozenset[int] = frozenset()
    sampler: Sampler | None = None
    longest: int = 0  # tokens a row a call at most (0: 3K + 1, what `run` takes; the benchmark tries others)
    prefilled_at: float | None = None  # when the last prefill's tokens were taken
    last_at: float | None = None

    def __post_init__(self) -> None:
        self.longest = self.longest or CALL_TOKENS_PER_DRAFT * self.drafts + 1
        self.texts = [list(p) for p in self.prompts]
        self.cached = [0] * len(self.prompts)  # tokens of each row's text in its caches
        self.rows: list[list[int]] = [[] for _ in self.prompts]  # new tokens
        self.done = [False] * len(self.prompts)
        self.proposals: list[list[int]] = [[] for _ in self.prompts]  # the drafts of each row's last call
        seed = self.sampler.seed if self.sampler else 0
        self.rngs = [np.random.default_rng([seed, r]) for r in range(len(self.prompts))]
        self.counts = {"drafted": 0, "accepted": 0, "drafted_per_position": [0] * self.drafts,
                       "accepted_per_position": [0] * self.drafts, "row_calls": 0, "tokens": 0,
                       "tokens_per_call": None, "decode_calls": 0, "refeeding_calls": 0}

    def fed(self, r: int) -> list[int]:
        """What row r's call feeds: its pending tokens and its drafts (nothing once it is done)."""
        return [] if self.done[r] else self.texts[r][self.cached[r]:] + self.proposals[r]

    def request(self, batch: MicroBatch) -> None:
        """Sets `batch`'s next call: each row's pending tokens and, after its prefill, its drafts (as many
        as K, the tokens it may still add beyond the call's own, and `longest` allow)."""
        for r in batch.rows:
            pending = len(self.texts[r]) - self.cached[r]
            count = min(self.drafts, self.max_new_tokens - len(self.rows[r]) - 1, self.longest - pending)
            drafting = self.cached[r] > 0 and not self.done[r] and count > 0
            self.proposals[r] = self.drafters[r].propose(self.texts[r], count) if drafting else []
        fed = [self.fed(r) for r in batch.rows]
        lengths = np.array([len(f) for f in fed], np.int64)
        batch.input_ids = np.zeros((batch.size, max(lengths.max(), 1)), np.int64)
        for i, row in enumerate(fed):
            batch.input_ids[i, :len(row)] = row
        batch.cache_lengths = np.array([self.cached[r] for r in batch.rows], np.int64)
        batch.input_lengths = lengths
        batch.draft_lengths = np.array([len(self.proposals[r]) for r in batch.rows], np.int64)

    def take(self, batch: MicroBatch, logits: np.ndarray) -> None:
        """Accepts each row's drafts by its call's logits (greedy choices, or the sampling rule), then
        one token of its own; marks the micro-batch finished when every row is."""
        refeeding = False
        for i, r in enumerate(batch.rows):
            fed, proposal = self.fed(r), self.proposals[r]
            if not fed:
                continue
            first = len(fed) - len(proposal) - 1  # the last pending token's position
            if self.sampler is None:
                choices = logits[i, first:len(fed)].argmax(-1)
                kept = accepted(proposal, choices)
                last = int(choices[kept])
            else:
                kept, last = sampled(proposal, logits[i, first:len(fed)], self.sampler, self.rngs[r])
            if kept == len(proposal):  # else the caches hold rejected drafts: the next call goes back
                self.cached[r] += len(fed)
            taken = 0
            for token in [*proposal[:kept], last]:
                self.texts[r].append(token)
                self.rows[r].append(token)
                taken += 1
                self.done[r] = len(self.rows[r]) >= self.max_new_tokens or token in self.stop_tokens
                if self.done[r]:
                    break
            if batch.calls:
                self.count(len(proposal), min(kept, taken), taken)
                refeeding |= first > 0
        if batch.calls:
            self.counts["decode_calls"] += 1
            self.counts["refeeding_calls"] += refeeding
        batch.finished = all(self.done[r] for r in batch.rows)
        self.last_at = time.perf_counter()
        if batch.calls == 0:
            self.prefilled_at = self.last_at

    def count(self, drafted: int, accepted: int, taken: int) -> None:
        """A row's decode call: its drafts, those accepted up to a stop token, and the tokens it gave."""
        counts = self.counts
        counts["drafted"] += drafted
        counts["accepted"] += accepted
        for position in range(drafted):
            counts["drafted_per_position"][position] += 1
            counts["accepted_per_position"][position] += position < accepted
        counts["row_calls"] += 1
        counts["tokens"] += taken
        counts["tokens_per_call"] = counts["tokens"] / counts["row_calls"]

    def decode_seconds(self) -> float:
        return self.last_at - self.prefilled_at


def truth_logits(batch: MicroBatch, texts: list[list[int]], vocab: int) -> np.ndarray:
    """`batch`'s next call's logits from a model that always gives the next token of each row's text
    (one-hot, no graph run): the stand-in that the tests and tools/bench_speculate.py drive Speculation
    with, so that only the drafts decide what a call gives."""
    logits = np.zeros((*batch.input_ids.shape, vocab), np.float32)
    for i, r in enumerate(batch.rows):
        for j in range(batch.input_lengths[i]):
            logits[i, j, texts[r][min(batch.cache_lengths[i] + j + 1, len(texts[r]) - 1)]] = 1
    return logits


def speculate(pipeline: Pipeline, speculation: Speculation, micro_batches: int = 1,
              waits: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext) -> Generation:
    """Decoding of `speculation`'s prompts with its drafts (greedy, or sampled by its rule), micro-batch
    after micro-batch as `generate` runs them. Each row's caches must hold its prompt, its new tokens
    and a call's padding (3K + 1 tokens a row at most, written at a finished row too)."""
    batches = split_prompts(speculation.prompts, micro_batches)
    pipeline.reset_slots([b.size for b in batches])
    times = [StageTimes(s.runner.name) for s in pipeline.stages]
    start = time.perf_counter()
    for batch in round_robin(batches):
        speculation.request(batch)
        speculation.take(batch, through_stages(pipeline, batch, times, waits)["logits"])
        batch.calls += 1
    return Generation(speculation.rows, speculation.prefilled_at - start, speculation.decode_seconds(),
                      max(b.calls for b in batches) - 1, [s.seconds for s in pipeline.stages], len(batches),
                      [t.summary() for t in times], drafts=speculation.counts)
