"""The sharded runtime: a built recipe's stages run in order, each holding its own caches.

    k3export run DIR --prompt-len 32 --seed 0 --max-new-tokens 16        # in-process, one session a stage
    torchrun --nproc-per-node N -m k3export.runtime DIR --prompt-len 32   # one process a stage (gloo)

A stage takes named tensors and gives named tensors; what backs it is its own business. Here it is
ONNX Runtime through IO binding (check's BoundOnnxrtRunner: the MLA cache written in place), driven
by the stage's export.json, so no tensor name is written here: a stage's feeds are the previous
stage's outputs of the same name, or the request's own (token ids, cache and input lengths). A
TensorRT engine per stage would be another runner of the same shape; none can run here (no GPU).
A build with taps (`build RECIPE --taps`) has more outputs per stage; nothing here reads them.
`check --build` runs this same chain as one check runner (k3export.runtime.check.ChainRunner).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3export.artifacts import require, verify
from k3export.errors import UserError
from k3export.onnx.check import BoundOnnxrtRunner, Signature
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE

BUILD_MANIFEST = "manifest.json"


def stage_exports(build_dir: str | Path) -> list[Path]:
    """The export folders of a `k3export build RECIPE` folder, in stage order, its files verified."""
    build_dir = Path(build_dir)
    manifest = verify(build_dir, BUILD_MANIFEST)
    require(manifest, build_dir / BUILD_MANIFEST, "stages")
    missing = [s["index"] for s in manifest["stages"] if not s.get("files")]
    if missing:
        raise UserError(f"{build_dir}: stage {missing[0]} is not built (built with --stage?); build it first")
    if manifest.get("settings", {}).get("no_weights"):
        raise UserError(f"{build_dir}: built with --no-weights; there are no numbers to run")
    split = next((s for s in manifest["stages"] if s.get("ranks")), None)
    if split:
        ranks = len(split["ranks"])
        raise UserError(f"{build_dir}: every stage is split over {ranks} ranks ([parallel] ranks); run it "
                        f"with torchrun --nproc-per-node {ranks * len(manifest['stages'])} "
                        "-m k3export.runtime.grid DIR")
    return [build_dir / s["folder"] for s in manifest["stages"]]


class Stage:
    """One stage: an ONNX Runtime session over its export folder, holding its caches.
    `extra_outputs`: intermediate tensors of its graph returned too (check's routing choices)."""

    def __init__(self, export_dir: Path, name: str, threads: int | None = None,
                 extra_outputs: list[str] | None = None) -> None:
        manifest = json.loads((export_dir / MANIFEST_FILE).read_text())
        self.signature = Signature(manifest)
        self.layers = range(*manifest["layers"])
        self.dtype = manifest["dtype"]
        self.runner = BoundOnnxrtRunner(export_dir / GRAPH_FILE, self.signature, name=name, threads=threads,
                                        extra_outputs=extra_outputs)
        self.seconds = 0.0

    def feeds(self, request: dict[str, np.ndarray], previous: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This stage's feeds: the previous stage's outputs of the same names, else the request's."""
        feed = {}
        for spec in self.signature.feeds:
            source = previous if spec.name in previous else request
            if spec.name not in source:
                raise UserError(f"stage {self.runner.name}: input {spec.name!r} is neither an output of the "
                                "stage before nor a request input; the stages do not chain")
            feed[spec.name] = source[spec.name]
        return feed

    def __call__(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.runner.infer(feed, check_inputs=False)
        self.seconds += self.runner.inference_time
        return outputs


class Pipeline:
    """The stages in order, in this process."""

    def __init__(self, export_dirs: list[Path], threads: int | None = None,
                 extra_outputs: list[list[str]] | None = None) -> None:
        extra_outputs = extra_outputs or [[] for _ in export_dirs]
        self.stages = [Stage(d, f"stage{i}", threads, extra) for i, (d, extra)
                       in enumerate(zip(export_dirs, extra_outputs, strict=True))]
        for stage in self.stages:
            stage.runner.activate()

    def reset(self, batch: int) -> None:
        for stage in self.stages:
            stage.runner.reset(batch)

    def close(self) -> None:
        for stage in self.stages:
            stage.runner.deactivate()

    def calls(self, request: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """Runs the request through the stages in order, each fed the one before's outputs of its
        input names; yields each stage's outputs (its present caches are the runner's buffers, valid
        until its next call)."""
        outputs: dict[str, np.ndarray] = {}
        for stage in self.stages:
            outputs = stage(stage.feeds(request, outputs))
            yield outputs

    def __call__(self, request: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Runs the request through every stage; the last stage's outputs."""
        *_, last = self.calls(request)
        return last


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
        for row in logits.astype(np.float64) / self.temperature:
            order = np.argsort(-row, kind="stable")
            if self.top_k:
                order = order[:self.top_k]
            p = np.exp(row[order] - row[order[0]])
            p /= p.sum()
            keep = int(np.searchsorted(np.cumsum(p), self.top_p)) + 1
            p = p[:keep] / p[:keep].sum()
            tokens.append(order[self.rng.choice(keep, p=p)])
        return np.array(tokens)


def last_positions(logits: np.ndarray, input_lengths: np.ndarray) -> np.ndarray:
    """Each row's logits at its last valid position: [batch, vocab]."""
    if logits.ndim == 2:  # exported with --last-logits
        return logits
    return logits[np.arange(len(input_lengths)), input_lengths - 1]


@dataclass
class Generation:
    tokens: list[list[int]]  # per row, the new tokens (up to and including a stop token)
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    stage_seconds: list[float]

    def summary(self) -> dict[str, Any]:
        new = sum(len(t) for t in self.tokens)
        return {"tokens": self.tokens, "prefill_seconds": self.prefill_seconds,
                "decode_seconds": self.decode_seconds, "decode_steps": self.decode_steps,
                "decode_tokens_per_second": (new - len(self.tokens)) / self.decode_seconds
                if self.decode_seconds else None,
                "stage_seconds": self.stage_seconds}


def generate(run: Any, prompts: list[list[int]], max_new_tokens: int, sampler: Sampler,
             stop_tokens: frozenset[int] = frozenset(), stage_seconds: Any = None) -> Generation:
    """Prefill of the prompts (right-padded to the longest), then decode steps until every row has
    `max_new_tokens` or a stop token. `run(request) -> outputs` is a Pipeline (or the distributed
    driver); a row that has stopped still runs with the others, its new tokens dropped."""
    batch = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int64)
    ids = np.zeros((batch, int(lengths.max())), np.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    request = {"input_ids": ids, "cache_lengths": np.zeros(batch, np.int64), "input_lengths": lengths}
    tokens: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(batch, bool)
    prefill = decode = 0.0
    steps = 0
    while True:
        start = time.perf_counter()
        logits = last_positions(run(request)["logits"], request["input_lengths"])
        next_ids = sampler(logits)
        elapsed = time.perf_counter() - start
        if steps == 0:
            prefill = elapsed
        else:
            decode += elapsed
        for b in np.flatnonzero(~done):
            tokens[b].append(int(next_ids[b]))
            done[b] = len(tokens[b]) >= max_new_tokens or int(next_ids[b]) in stop_tokens
        if done.all():
            break
        steps += 1
        request = {"input_ids": next_ids[:, None].astype(np.int64),
                   "cache_lengths": request["cache_lengths"] + request["input_lengths"],
                   "input_lengths": np.ones(batch, np.int64)}
    return Generation(tokens, prefill, decode, steps, stage_seconds() if stage_seconds else [])


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """`batch` prompts of different lengths, the first `prompt_len` tokens long."""
    rng = np.random.default_rng(seed)
    lengths = [max(1, prompt_len * (batch - b) // batch) for b in range(batch)]
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def vocab_size(export_dir: Path) -> int:
    return json.loads((export_dir / "config.json").read_text())["vocab_size"]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("build", metavar="DIR", help="a `k3export build RECIPE` folder")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens of the longest prompt")
    parser.add_argument("--prompt-ids", metavar="IDS", help="one prompt, comma-separated token ids")
    parser.add_argument("--batch", type=int, default=1, help="random prompts of different lengths")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and the sampler")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--stop", type=int, action="append", default=[], metavar="ID", help="stop token")
    parser.add_argument("--json", action="store_true")


def prompts_of(args: argparse.Namespace, first_stage: Path) -> list[list[int]]:
    if args.prompt_ids:
        try:
            return [[int(t) for t in args.prompt_ids.split(",")]]
        except ValueError:
            raise UserError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers") from None
    return random_prompts(args.batch, args.prompt_len, vocab_size(first_stage), args.seed)


def report(args: argparse.Namespace, result: Generation, stages: list[Stage] | list[str]) -> None:
    summary = result.summary()
    if args.json:
        print(json.dumps(summary))
        return
    for b, row in enumerate(result.tokens):
        print(f"row {b}: {row}")
    rate = summary["decode_tokens_per_second"]
    print(f"prefill {result.prefill_seconds * 1e3:.1f} ms; {result.decode_steps} decode steps in "
          f"{result.decode_seconds:.2f} s" + (f" ({rate:.1f} tokens/s)" if rate else ""))
    names = [s if isinstance(s, str) else f"{s.runner.name} (layers {s.layers.start}..{s.layers.stop - 1})"
             for s in stages]
    for name, seconds in zip(names, result.stage_seconds, strict=True):
        print(f"  {name}: {seconds:.3f} s")


def cmd_run(args: argparse.Namespace) -> int:
    exports = stage_exports(args.build)
    pipeline = Pipeline(exports)
    prompts = prompts_of(args, exports[0])
    pipeline.reset(len(prompts))
    try:
        result = generate(pipeline, prompts, args.max_new_tokens,
                          Sampler(args.temperature, args.top_k, args.top_p, args.seed), frozenset(args.stop),
                          lambda: [s.seconds for s in pipeline.stages])
    finally:
        pipeline.close()
    report(args, result, pipeline.stages)
    return 0


def add_parser(sub: Any) -> None:
    """Registers `k3export run` on the CLI's subparsers."""
    run = sub.add_parser("run", help="generate with a sharded build: its stages in order, in this process "
                                     "(torchrun -m k3export.runtime: one process a stage)")
    add_run_arguments(run)
    run.set_defaults(run=cmd_run)
