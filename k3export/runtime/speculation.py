"""Speculative greedy decoding through a pipeline in this process: drafts (runtime.drafts) checked by
the model in one call, with the same tokens as plain greedy decoding.

Each call feeds a row the tokens of its text not yet in the caches (`pending`) and, when that is one
token, up to K drafts after it; the logits at the last pending token and at each draft are the greedy
choices there. The drafts that match them are accepted, and the choice after the last accepted one
is a token of its own (the correction, or the bonus when all match): one call gives 1 to K+1 tokens.

The rollback (onnx.runner.Rollback, in every runner) is a re-run from a kept state: when every draft
of a row was accepted its caches hold its text and the next call goes on from there; when some was
rejected, its caches hold rejected tokens, so the next call gives the row its cache length of before
the verify (its runners take back their states kept then) and feeds the accepted tokens again with the
new one, and no drafts (only a row's pending tokens are certain). Every call so gives each running row
at least one token, and no call is ever spent on the rollback alone; a call feeds at most K+1 tokens a
row (a verify: 1 + K; a re-run after j < K accepted: 1 + j + 1).
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
from k3export.runtime.drafts import DRAFTS, Drafter
from k3export.runtime.generation import Generation, through_stages
from k3export.runtime.pipeline import Pipeline
from k3export.runtime.schedule import MicroBatch, StageTimes, round_robin, split_prompts


def speculation_of(args: argparse.Namespace, exports: list[Path],
                   prompts: list[list[int]]) -> Speculation | None:
    """The request's speculation (None without --speculate), refused before any stage loads unless
    decoding is greedy, the last stage gives every position's logits, and each row's caches hold its
    prompt, its new tokens and K drafts."""
    if args.drafts and not args.speculate:
        raise UserError(f"--drafts {args.drafts}: expected --speculate K (drafts are made to be verified)")
    if not args.speculate:
        return None
    option = f"--speculate {args.speculate}"
    if args.temperature > 0:
        raise UserError(f"{option}: greedy decoding only (--temperature 0); sampling with drafts is not "
                        "implemented")
    manifests = [json.loads((d / MANIFEST_FILE).read_text()) for d in exports]
    if manifests[-1].get("last_logits"):
        raise UserError(f"{option}: the build's last stage gives each row's last logits only "
                        "(--last-logits); a verify needs every position's")
    capacity = min(m["capacity"] for m in manifests)
    prompt_len = max(len(p) for p in prompts)
    limit = capacity - prompt_len - args.max_new_tokens
    if args.speculate > limit:
        room = f"at most --speculate {limit}" if limit > 0 else "no room for drafts"
        raise UserError(f"{option}: a row's cache holds its prompt, its new tokens and a call's drafts: "
                        f"{prompt_len} + {args.max_new_tokens} + {args.speculate} > the cache capacity "
                        f"{capacity}; {room}")
    drafters = [DRAFTS[args.drafts or "ngram"]() for _ in prompts]
    return Speculation(prompts, args.max_new_tokens, drafters, args.speculate, frozenset(args.stop))


def require_verify_profiles(speculation: Speculation, engines: list[Path], exports: list[Path],
                            rows: int) -> None:
    """Refuses `--speculate K` on engines, before any loads, unless each stage's engine has a profile
    that takes a verify call of `rows` (the largest micro-batch) x K + 1 tokens (a verify profile, or a
    prefill profile that happens to)."""
    from k3export.engine.runner import binding_plan, engine_record

    tokens = speculation.drafts + 1
    for stage, (engine, export) in enumerate(zip(engines, exports, strict=True)):
        plan = binding_plan(export, engine_record(engine)["profiles"])
        capacity = json.loads((export / MANIFEST_FILE).read_text())["capacity"]
        try:
            plan.profile({"batch": rows, "seq": tokens, "capacity": capacity})
        except UserError:
            raise UserError(f"--speculate {speculation.drafts}: a verify call of {rows} rows x {tokens} "
                            f"tokens fits none of stage {stage}'s engine profiles ({engine}); build it with "
                            f"[profiles] verify = {{seq = {tokens}}} (build --onnx: --verify-seq {tokens})") \
                from None


def accepted(drafts: list[int], choices: np.ndarray) -> int:
    """How many leading drafts are the greedy choices before them (`choices[i]` follows draft i-1)."""
    count = 0
    while count < len(drafts) and drafts[count] == choices[count]:
        count += 1
    return count


@dataclass
class Speculation:
    """Each row's text (prompt and new tokens), its tokens in the caches and its drafts, on the process
    that sees the logits: what a micro-batch's next call feeds (`request`) and what its logits accept
    (`take`). Its `rows`, `prefilled_at` and `decode_seconds` are schedule.Tokens' (what a run reports)."""

    prompts: list[list[int]]
    max_new_tokens: int
    drafters: list[Drafter]
    drafts: int  # K: drafts a row proposes at most a call
    stop_tokens: frozenset[int] = frozenset()
    prefilled_at: float | None = None  # when the last prefill's tokens were taken
    last_at: float | None = None

    def __post_init__(self) -> None:
        self.texts = [list(p) for p in self.prompts]
        self.cached = [0] * len(self.prompts)  # tokens of each row's text in its caches
        self.rows: list[list[int]] = [[] for _ in self.prompts]  # new tokens
        self.done = [False] * len(self.prompts)
        self.proposals: list[list[int]] = [[] for _ in self.prompts]  # the drafts of each row's last call
        self.counts = {"drafted": 0, "accepted": 0}

    def fed(self, r: int) -> list[int]:
        """What row r's call feeds: its pending tokens and its drafts (nothing once it is done)."""
        return [] if self.done[r] else self.texts[r][self.cached[r]:] + self.proposals[r]

    def request(self, batch: MicroBatch) -> None:
        """Sets `batch`'s next call: each row's pending tokens and, when that is one, its drafts."""
        for r in batch.rows:
            pending = len(self.texts[r]) - self.cached[r]
            room = self.max_new_tokens - len(self.rows[r]) - 1  # tokens a verify may add beyond its own
            self.proposals[r] = self.drafters[r].propose(self.texts[r], min(self.drafts, room)) \
                if pending == 1 and not self.done[r] else []
        fed = [self.fed(r) for r in batch.rows]
        lengths = np.array([len(f) for f in fed], np.int64)
        batch.input_ids = np.zeros((batch.size, max(lengths.max(), 1)), np.int64)
        for i, row in enumerate(fed):
            batch.input_ids[i, :len(row)] = row
        batch.cache_lengths = np.array([self.cached[r] for r in batch.rows], np.int64)
        batch.input_lengths = lengths

    def take(self, batch: MicroBatch, logits: np.ndarray) -> None:
        """Accepts each row's drafts that its call's greedy choices confirm, then one token of those
        choices; marks the micro-batch finished when every row is."""
        for i, r in enumerate(batch.rows):
            fed, proposal = self.fed(r), self.proposals[r]
            if not fed:
                continue
            first = len(fed) - len(proposal) - 1  # the last pending token's position
            choices = logits[i, first:len(fed)].argmax(-1)
            kept = accepted(proposal, choices)
            self.counts["drafted"] += len(proposal)
            self.counts["accepted"] += kept
            if kept == len(proposal):  # else the caches hold rejected drafts: the next call goes back
                self.cached[r] += len(fed)
            for token in [*proposal[:kept], int(choices[kept])]:
                self.texts[r].append(token)
                self.rows[r].append(token)
                self.done[r] = len(self.rows[r]) >= self.max_new_tokens or token in self.stop_tokens
                if self.done[r]:
                    break
        batch.finished = all(self.done[r] for r in batch.rows)
        self.last_at = time.perf_counter()
        if batch.calls == 0:
            self.prefilled_at = self.last_at

    def decode_seconds(self) -> float:
        return self.last_at - self.prefilled_at


def speculate(pipeline: Pipeline, speculation: Speculation, micro_batches: int = 1,
              waits: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext) -> Generation:
    """Greedy decoding of `speculation`'s prompts with its drafts, micro-batch after micro-batch as
    `generate` runs them. Each row's caches must hold its prompt, its new tokens and K more (a call of
    K+1 writes K+1 latent rows, padding included, at a finished row too)."""
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
