"""Generation through a pipeline in this process: the sampler, and prefill then decode steps,
micro-batch after micro-batch (k3export.runtime.schedule's order)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3export.errors import UserError
from k3export.runtime.pipeline import Pipeline, passed_on
from k3export.runtime.schedule import MicroBatch, StageTimes, Tokens, nbytes, round_robin, split_prompts


@dataclass
class Sampler:
    """Greedy when temperature is 0; else softmax(logits / temperature) cut to the top_k tokens and
    the smallest set whose probability reaches top_p, drawn from a seeded generator."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """[batch, vocab] -> [batch] token ids."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        tokens = []
        for row in logits:
            kept, p = self.distribution(row)
            tokens.append(kept[self.rng.choice(len(p), p=p)])
        return np.array(tokens)

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What a row's token is drawn from (temperature > 0): the tokens kept, most likely first, and
        their probabilities (float64, summing to 1); speculative sampling draws from the same."""
        row = logits.astype(np.float64)
        order = np.argsort(-row, kind="stable")
        if self.top_k:
            order = order[:self.top_k]
        # Scaled once the maximum is subtracted: a tiny temperature (1e-308) then gives -inf (an
        # intended overflow), not inf - inf (NaN probabilities).
        with np.errstate(over="ignore"):
            p = np.exp((row[order] - row[order[0]]) / self.temperature)
        p /= p.sum()
        # At most every token: the sum can fall short of top_p = 1 by a rounding error.
        keep = min(int(np.searchsorted(np.cumsum(p), self.top_p)) + 1, len(p))
        return order[:keep], p[:keep] / p[:keep].sum()


@dataclass
class Generation:
    tokens: list[list[int]]  # per row, the new tokens (up to and including a stop token)
    prefill_seconds: float  # until the last micro-batch's first tokens
    decode_seconds: float  # from there to the last tokens
    decode_steps: int  # of the micro-batch with the most
    stage_seconds: list[float]  # each stage's time in its graph, prefill included
    micro_batches: int = 1
    stages: list[dict[str, Any]] = field(default_factory=list)  # StageTimes.summary() each
    threads: int | None = None  # ONNX Runtime intra-op threads of each stage (None: engines)
    drafts: dict[str, Any] | None = None  # speculation's counts (Speculation.counts; None: none)

    def summary(self) -> dict[str, Any]:
        new = sum(len(t) for t in self.tokens)
        return {"tokens": self.tokens, "prefill_seconds": self.prefill_seconds, "drafts": self.drafts,
                "decode_seconds": self.decode_seconds, "decode_steps": self.decode_steps,
                "decode_tokens_per_second": (new - len(self.tokens)) / self.decode_seconds
                if self.decode_seconds else None,
                "stage_seconds": self.stage_seconds, "micro_batches": self.micro_batches,
                "threads": self.threads, "stages": self.stages}


def through_stages(pipeline: Pipeline, batch: MicroBatch, times: list[StageTimes],
                   waits: Callable[[], AbstractContextManager[None]]) -> dict[str, np.ndarray]:
    """`batch`'s next call through the pipeline's stages, each with the micro-batch's caches, each
    call's time recorded in `times`; the last stage's outputs."""
    outputs: dict[str, np.ndarray] = {}
    stages = pipeline.stages
    for i, stage in enumerate(stages):
        stage.use(batch.index)
        started = time.perf_counter()
        with waits():
            outputs = stage(stage.feeds(batch.request(), outputs))
        # What would cross to the next stage (the last: the tokens back to the first).
        last = i + 1 == len(stages)
        sent = 8 * batch.size if last else nbytes([outputs[n] for n in passed_on(stages, i)])
        times[i].record(batch, started, stage.runner.inference_time, sent, stage.runner.collective_time)
    return outputs


def generate(pipeline: Pipeline, prompts: list[list[int]], max_new_tokens: int, sampler: Sampler,
             stop_tokens: frozenset[int] = frozenset(), micro_batches: int = 1,
             waits: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext) -> Generation:
    """Prefill of the prompts (right-padded to the longest of each micro-batch), then decode steps
    until every row has `max_new_tokens` or a stop token, micro-batch after micro-batch through the
    pipeline's stages in this process (k3export.runtime.schedule's order); a row that has stopped
    runs on with its micro-batch, its new tokens dropped. Each stage call runs in a `waits()` context
    (under torchrun: a split stage's sums named when they fail, or an engine's under the watchdog)."""
    stages = pipeline.stages
    if "logits" not in {s.name for s in stages[-1].signature.outputs}:  # not the model's last layers
        raise UserError(f"stage {stages[-1].runner.name} (layers {stages[-1].layers.start}.."
                        f"{stages[-1].layers.stop - 1}) gives no logits, so no token can be sampled: the "
                        "pipeline lacks the model's last stage (an incomplete build?)")
    batches = split_prompts(prompts, micro_batches)
    pipeline.reset_slots([b.size for b in batches])
    tokens = Tokens(len(prompts), max_new_tokens, sampler, stop_tokens)
    times = [StageTimes(s.runner.name) for s in stages]
    start = time.perf_counter()
    for batch in round_robin(batches):
        outputs = through_stages(pipeline, batch, times, waits)
        ids = tokens.take(batch, outputs["logits"])
        batch.advance()
        batch.input_ids = ids[:, None].astype(np.int64)
    return Generation(tokens.rows, tokens.prefilled_at - start, tokens.decode_seconds(),
                      max(b.calls for b in batches) - 1, [s.seconds for s in stages], len(batches),
                      [t.summary() for t in times])
