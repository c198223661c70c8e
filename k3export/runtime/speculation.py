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
from pathlib import Path

import numpy as np

from k3export.errors import UserError
from k3export.onnx.export import MANIFEST_FILE
from k3export.runtime.drafts import Drafter
from k3export.runtime.generation import Generation, through_stages
from k3export.runtime.pipeline import Pipeline
from k3export.runtime.schedule import StageTimes, round_robin, split_prompts


def require_speculation_fits(args: argparse.Namespace, exports: list[Path], prompt_len: int) -> None:
    """Refuses `run --speculate K`, before any stage loads, unless decoding is greedy, the last stage
    gives every position's logits, and each row's caches hold its prompt (the longest: `prompt_len`),
    its new tokens and K drafts."""
    option = f"--speculate {args.speculate}"
    if args.temperature > 0:
        raise UserError(f"{option}: greedy decoding only (--temperature 0); sampling with drafts is not "
                        "implemented")
    manifests = [json.loads((d / MANIFEST_FILE).read_text()) for d in exports]
    if manifests[-1].get("last_logits"):
        raise UserError(f"{option}: the build's last stage gives each row's last logits only "
                        "(--last-logits); a verify needs every position's")
    capacity = min(m["capacity"] for m in manifests)
    limit = capacity - prompt_len - args.max_new_tokens
    if args.speculate > limit:
        room = f"at most --speculate {limit}" if limit > 0 else "no room for drafts"
        raise UserError(f"{option}: a row's cache holds its prompt, its new tokens and a call's drafts: "
                        f"{prompt_len} + {args.max_new_tokens} + {args.speculate} > the cache capacity "
                        f"{capacity}; {room}")


def accepted(drafts: list[int], choices: np.ndarray) -> int:
    """How many leading drafts are the greedy choices before them (`choices[i]` follows draft i-1)."""
    count = 0
    while count < len(drafts) and drafts[count] == choices[count]:
        count += 1
    return count


def speculate(pipeline: Pipeline, prompts: list[list[int]], max_new_tokens: int, drafters: list[Drafter],
              drafts: int, stop_tokens: frozenset[int] = frozenset(), micro_batches: int = 1,
              waits: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext) -> Generation:
    """Greedy decoding of `prompts` with up to `drafts` tokens a call from each row's drafter, micro-batch
    after micro-batch as `generate` runs them. Each row's caches must hold its prompt, `max_new_tokens`
    and `drafts` more (a call of K+1 writes K+1 latent rows, padding included, at a finished row too)."""
    batches = split_prompts(prompts, micro_batches)
    pipeline.reset_slots([b.size for b in batches])
    texts = [list(p) for p in prompts]
    cached = [0] * len(prompts)  # tokens of each row's text in its caches
    new = [[] for _ in prompts]
    done = [False] * len(prompts)
    times = [StageTimes(s.runner.name) for s in pipeline.stages]
    drafted = accepted_drafts = 0
    start = time.perf_counter()
    prefilled_at = last_at = start
    for batch in round_robin(batches):
        fed, proposals = [], []
        for r in batch.rows:
            pending = texts[r][cached[r]:]
            room = max_new_tokens - len(new[r]) - 1  # tokens a verify may add beyond its own
            proposal = drafters[r].propose(texts[r], min(drafts, room)) if len(pending) == 1 else []
            proposals.append(proposal)
            fed.append([] if done[r] else pending + proposal)
        lengths = np.array([len(f) for f in fed], np.int64)
        batch.input_ids = np.zeros((batch.size, max(lengths.max(), 1)), np.int64)
        for i, row in enumerate(fed):
            batch.input_ids[i, :len(row)] = row
        batch.cache_lengths = np.array([cached[r] for r in batch.rows], np.int64)
        batch.input_lengths = lengths
        logits = through_stages(pipeline, batch, times, waits)["logits"]
        for i, r in enumerate(batch.rows):
            if done[r]:
                continue
            proposal = proposals[i]
            first = len(fed[i]) - len(proposal) - 1  # the last pending token's position
            choices = logits[i, first:len(fed[i])].argmax(-1)
            kept = accepted(proposal, choices)
            drafted, accepted_drafts = drafted + len(proposal), accepted_drafts + kept
            if kept == len(proposal):
                cached[r] += len(fed[i])
            for token in [*proposal[:kept], int(choices[kept])]:
                texts[r].append(token)
                new[r].append(token)
                done[r] = len(new[r]) >= max_new_tokens or token in stop_tokens
                if done[r]:
                    break
        batch.finished = all(done[r] for r in batch.rows)
        batch.calls += 1
        last_at = time.perf_counter()
        if batch.calls == 1:
            prefilled_at = last_at
    return Generation(new, prefilled_at - start, last_at - prefilled_at, max(b.calls for b in batches) - 1,
                      [s.seconds for s in pipeline.stages], len(batches), [t.summary() for t in times],
                      drafts={"drafted": drafted, "accepted": accepted_drafts})
