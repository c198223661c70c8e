"""`check ... --speculate K`: the artifact decodes speculatively, and check's driver compares every call
with the eager model on the same feeds, rollbacks included.

Before the compared pass, the artifact runs twice on its own: plain greedy decoding of the check's
prompts (its `steps` tokens a row), then speculative decoding (runtime.speculation) with drafts made
from that continuation, each row's draft wrong at a place that moves from call to call
(`CYCLE`), so that calls accept none, some and all of K and rows of one call accept different
lengths. The second pass's feeds are the check's requests: verify calls, and calls whose cache
lengths go back to a verify's (a rollback) and feed the accepted tokens again. Both sides' runners
take them back alike (onnx.runner.Rollback), so every compared cache after a rejection is the rolled
back state run on. The driver's top-1 comparison at every position of every call says the eager model
accepts what the artifact accepts; `streams_identical` says the speculative tokens are the artifact's
plain greedy ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3export.errors import UserError
from k3export.onnx.runner import CALL_TOKENS_PER_DRAFT, StatefulRunner
from k3export.runtime.drafts import ContinuationDrafter
from k3export.runtime.schedule import MicroBatch
from k3export.runtime.speculation import Speculation

Arrays = dict[str, np.ndarray]
CYCLE = 7  # row r's wrong draft sits at (its text's length + r) % CYCLE: past K for some calls


def require_speculation_fits(drafts: int, prompt_len: int, steps: int, capacity: int) -> None:
    """Refuses `--speculate K` unless a row's prompt, its steps + 1 tokens and a call's padding fit the
    cache (a call feeds a row up to 3K + 1 tokens, runtime.speculation's, and writes as many latent rows,
    padding included, at a finished row too)."""
    need = prompt_len + steps + 1 + CALL_TOKENS_PER_DRAFT * drafts
    if need > capacity:
        room = max((capacity - prompt_len - steps - 1) // CALL_TOKENS_PER_DRAFT, 0)
        raise UserError(f"--speculate {drafts}: the longest row's prompt, its tokens and a call's padding, "
                        f"{prompt_len} + {steps + 1} + 3 x {drafts} = {need} > the cache capacity "
                        f"{capacity}; at most --speculate {room}")


@dataclass
class SpeculativeRequests:
    """The requests of a speculative check, made by the artifact's runner (`feeds`), and what its two
    passes gave (`summary`)."""

    drafts: int
    vocab: int
    counts: dict[str, int] = field(default_factory=dict)
    streams_identical: bool = False
    calls: int = 0

    def feeds(self, runner: StatefulRunner, prefill: Arrays, steps: int) -> list[Arrays]:
        """Every call's feeds, from the prefill's (token ids, right-padded); the runner is active."""
        if "input_ids" not in prefill:
            raise UserError(f"--speculate {self.drafts}: expected a graph fed token ids (a whole model, or a "
                            "build's first stage on); a layer range starts from AttnRes tensors")
        lengths = prefill["input_lengths"]
        prompts = [row[:n].tolist() for row, n in zip(prefill["input_ids"], lengths, strict=True)]
        plain = self.greedy(runner, prefill, steps)
        drafters = [ContinuationDrafter(p + c, self.vocab, lambda n, r=r: (n + r) % CYCLE)
                    for r, (p, c) in enumerate(zip(prompts, plain, strict=True))]
        speculation = Speculation(prompts, steps + 1, drafters, self.drafts)
        batch = MicroBatch.of(0, range(len(prompts)), prompts)
        runner.reset(len(prompts))
        feeds = []
        while not batch.finished:
            speculation.request(batch)
            feeds.append({name: np.copy(a) for name, a in batch.request().items()})
            speculation.take(batch, runner.infer(feeds[-1], check_inputs=False)["logits"])
            batch.calls += 1
        self.counts, self.calls = speculation.counts, len(feeds)
        self.streams_identical = speculation.rows == plain
        return feeds

    @staticmethod
    def greedy(runner: StatefulRunner, prefill: Arrays, steps: int) -> list[list[int]]:
        """Plain greedy decoding by the artifact: each row's `steps` + 1 tokens."""
        runner.reset(len(prefill["input_lengths"]))
        feed, rows = prefill, []
        for _ in range(steps + 1):
            logits = runner.infer(feed, check_inputs=False).get("logits")
            if logits is None or logits.ndim != 3:
                raise UserError("--speculate: expected a graph that gives every position's logits (the last "
                                "layer, not --last-logits): a verify reads them all")
            tokens = logits[np.arange(len(logits)), feed["input_lengths"] - 1].argmax(-1)
            rows.append(tokens.tolist())
            feed = {"input_ids": tokens[:, None].astype(np.int64),
                    "cache_lengths": feed["cache_lengths"] + feed["input_lengths"],
                    "input_lengths": np.ones(len(tokens), np.int64)}
        return [list(row) for row in zip(*rows, strict=True)]

    def summary(self) -> dict[str, Any]:
        return {"drafts": self.drafts, "calls": self.calls, **self.counts,
                "streams_identical": self.streams_identical}
