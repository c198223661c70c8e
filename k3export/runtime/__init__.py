"""The sharded runtime: a built recipe's stages run in order, each holding its own caches.

    k3export run DIR --prompt-len 32 --seed 0 --max-new-tokens 16        # in-process, one session a stage
    torchrun --nproc-per-node S -m k3export.runtime DIR --prompt-len 32   # one process a stage (gloo)
    torchrun --nproc-per-node S*N -m k3export.runtime DIR                 # stages split over N ranks

The batch's rows go through in micro-batches (`--micro-batches M`, k3export.runtime.schedule), each
with its own rows of every stage's caches; under torchrun they are in flight together, one stage
computing a micro-batch while the next computes the one before. In one process M changes nothing
but the grouping.

A stage takes named tensors and gives named tensors; what backs it is its own business: ONNX Runtime
through IO binding on CPU (onnx.runner.BoundOnnxrtRunner: the MLA cache written in place; a rank of a
split stage: runtime.segments.SegmentedRunner, the same caches, its graph in pieces between the sums
of the stage's ranks), or the stage's TensorRT engine on a GPU (engine.runner.EngineRunner: its
caches on the GPU, boundaries kept there as CUDA tensors, only the logits read back), chosen by
`--runner` (runtime.engines). Each is driven by the stage's export.json, so no tensor name is written
here: a stage's feeds are the previous stage's outputs of the same name, or the request's own (token
ids, cache and input lengths).
A build with taps (`build RECIPE --taps`) has more outputs per stage; nothing here reads them.
`check --build` runs this same chain as one check runner (k3export.check.runners.chain.ChainRunner).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed import ProcessGroup

from k3export.artifacts import BUILD_MANIFEST, read_manifest, require, verify
from k3export.errors import UserError
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE
from k3export.onnx.runner import BoundOnnxrtRunner, Signature
from k3export.options import (
    existing_dir,
    integer,
    non_negative_int,
    non_negative_real,
    positive_int,
    probability,
    require_request_fits,
    seed,
    token_ids,
)
from k3export.runtime.engines import ENGINE, RUNNERS, EnginePlace, choose_runner, device_of
from k3export.runtime.schedule import (
    StageTimes,
    Tokens,
    default_micro_batches,
    nbytes,
    round_robin,
    split_prompts,
)
from k3export.runtime.segments import SegmentedRunner


def _check_rank(build_dir: Path, stage: dict[str, Any], rank: dict[str, Any], ranks: int) -> None:
    """Refuses, naming the stage and rank, a rank folder that is missing or whose export.json is
    another rank's (another rank, rank count or layers: a folder moved or copied in)."""
    where = f"{build_dir / BUILD_MANIFEST}: stage {stage['index']} rank {rank['rank']}"
    export_json = build_dir / rank["folder"] / MANIFEST_FILE
    if not export_json.parent.is_dir():
        raise UserError(f"{where}: its folder {export_json.parent} is missing; build the stage again "
                        f"(k3export build RECIPE --stage {stage['index']})")
    try:
        export = json.loads(export_json.read_text())
        held = (export["parallel"]["rank"], export["parallel"]["ranks"], export["layers"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{where}: {export_json} is missing or not a rank's export.json (no 'parallel' "
                        "rank and ranks); build the stage again") from None
    expected = (rank["rank"], ranks, stage["layers"])
    if held != expected:
        raise UserError(f"{where}: {export_json} is rank {held[0]} of {held[1]} over layers {held[2]}, "
                        f"expected rank {expected[0]} of {expected[1]} over layers {expected[2]}: ranks of "
                        "different builds are mixed; build the stage again")


def verify_build(build_dir: str | Path, full: bool = False) -> dict[str, Any]:
    """Holds a `k3export build RECIPE` folder to its manifest (artifacts.verify, `full`: every file
    hashed), each rank folder of a split stage first checked to be there and to be that rank's;
    a problem names the stage and rank. Returns the manifest."""
    build_dir = Path(build_dir)
    manifest = read_manifest(build_dir, BUILD_MANIFEST)
    require(manifest, build_dir / BUILD_MANIFEST, "stages")
    parts = {}
    try:
        for stage in manifest["stages"]:
            if not stage.get("files"):
                continue
            for rank in stage.get("ranks", []):
                _check_rank(build_dir, stage, rank, len(stage["ranks"]))
                parts[f"{rank['folder']}/"] = f"stage {stage['index']} rank {rank['rank']}"
            if "ranks" not in stage:
                parts[f"{stage['folder']}/"] = f"stage {stage['index']}"
    except (KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{build_dir / BUILD_MANIFEST}: a stage entry lacks {e} or is not an object; the "
                        "folder is damaged or was written by another version of k3export, build it "
                        "again") from None
    return verify(build_dir, BUILD_MANIFEST, full, parts)


def stage_ranks(build_dir: str | Path) -> list[list[Path]]:
    """The export folders of a `k3export build RECIPE` folder, per stage its ranks' (one for a stage
    that is not split), in stage order, its files verified (verify_build)."""
    build_dir = Path(build_dir)
    manifest = verify_build(build_dir)
    missing = [s["index"] for s in manifest["stages"] if not s.get("files")]
    if missing:
        raise UserError(f"{build_dir}: stage {missing[0]} is not built (built with --stage?); build it first")
    if manifest.get("settings", {}).get("no_weights"):
        raise UserError(f"{build_dir}: built with --no-weights; there are no numbers to run")
    return [[build_dir / r["folder"] for r in s.get("ranks", [s])] for s in manifest["stages"]]


def stage_exports(build_dir: str | Path) -> list[Path]:
    """The export folders of a build whose stages are not split, in stage order, files verified."""
    stages = stage_ranks(build_dir)
    ranks = len(stages[0])
    if ranks > 1:
        raise UserError(f"{build_dir}: every stage is split over {ranks} ranks ([parallel] ranks); run it "
                        f"with torchrun --nproc-per-node {ranks * len(stages)} -m k3export.runtime DIR")
    return [folders[0] for folders in stages]


class Stage:
    """One stage, or one rank of a split stage, holding its caches: its engine when `engine` says
    where it runs (a split stage's engine sums through its communicator), else an ONNX Runtime
    session over its export folder (a rank's: its pieces, summed over `group`, the process group of
    the stage's ranks). `extra_outputs`: intermediate tensors of its graph returned too (check's
    routing choices)."""

    def __init__(self, export_dir: Path, name: str, threads: int | None = None,
                 extra_outputs: list[str] | None = None, group: ProcessGroup | None = None,
                 engine: EnginePlace | None = None) -> None:
        manifest = json.loads((export_dir / MANIFEST_FILE).read_text())
        self.signature = Signature(manifest)
        self.layers = range(*manifest["layers"])
        self.dtype = manifest["dtype"]
        if engine is not None:
            # Imported here: it needs TensorRT, which machines running the ONNX graphs may lack.
            from k3export.engine.runner import EngineRunner

            self.runner = EngineRunner(engine.path, export_dir, name=name, extra_outputs=extra_outputs,
                                       device=engine.device, host_outputs=engine.host_outputs,
                                       communicator=engine.communicator)
        elif manifest.get("parallel", {}).get("ranks", 1) > 1:
            self.runner = SegmentedRunner(export_dir / GRAPH_FILE, self.signature, group, name, threads)
        else:
            self.runner = BoundOnnxrtRunner(export_dir / GRAPH_FILE, self.signature, name=name,
                                            threads=threads, extra_outputs=extra_outputs)
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

    def __call__(self, feed: dict[str, Any]) -> dict[str, Any]:
        """The stage's outputs for `feed`: numpy arrays, or CUDA tensors an engine keeps on its GPU."""
        outputs = self.runner.infer(feed, check_inputs=False)
        self.seconds += self.runner.inference_time
        return outputs

    def reset_slots(self, sizes: list[int]) -> None:
        """Empty caches for each micro-batch of `sizes` rows: every micro-batch its own rows of every
        cache, as if each were the only batch; `use(i)` picks micro-batch i's for the next calls.
        Every runner (ONNX Runtime's, an engine's) holds its caches in `caches` and its double buffers
        in `spares` and reads both at each call."""
        self.slots = []
        for size in sizes:
            self.runner.reset(size)
            # The runner swaps its double-buffered caches inside these two dicts, so they stay its own.
            self.slots.append((self.runner.caches, self.runner.spares))

    def use(self, index: int) -> None:
        self.runner.caches, self.runner.spares = self.slots[index]


def passed_on(stages: list[Stage], index: int) -> list[str]:
    """The outputs of stage `index` that the next stage takes (its boundary), in that stage's order."""
    produced = {s.name for s in stages[index].signature.outputs}
    return [s.name for s in stages[index + 1].signature.feeds if s.name in produced]


def intra_op_threads(args: argparse.Namespace, processes: int) -> int:
    """ONNX Runtime's intra-op threads for one of `processes` stage processes on this host: --threads,
    or its share of the cores this process may run on (at least one), so the stages do not fight."""
    if args.threads is None:
        return max(1, len(os.sched_getaffinity(0)) // processes)
    return args.threads


class Pipeline:
    """The stages in order, in this process (a split build's: one rank of each, its sums over
    `group`); `engines`: where each stage's engine runs (None: ONNX Runtime sessions)."""

    def __init__(self, export_dirs: list[Path], threads: int | None = None,
                 extra_outputs: list[list[str]] | None = None, group: ProcessGroup | None = None,
                 engines: list[EnginePlace] | None = None) -> None:
        extra_outputs = extra_outputs or [[] for _ in export_dirs]
        engines = engines or [None for _ in export_dirs]
        self.stages = [Stage(d, f"stage{i}", threads, extra, group, engine) for i, (d, extra, engine)
                       in enumerate(zip(export_dirs, extra_outputs, engines, strict=True))]
        for stage in self.stages:
            stage.runner.activate()

    def reset(self, batch: int) -> None:
        for stage in self.stages:
            stage.runner.reset(batch)

    def reset_slots(self, sizes: list[int]) -> None:
        for stage in self.stages:
            stage.reset_slots(sizes)

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


# ONNX Runtime cannot start 10^9 threads (an internal error, found by the CLI fuzz): 1024 is beyond
# any host here.
THREADS = integer(1, 1024)


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
        for row in logits.astype(np.float64):
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
            p = p[:keep] / p[:keep].sum()
            tokens.append(order[self.rng.choice(keep, p=p)])
        return np.array(tokens)


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

    def summary(self) -> dict[str, Any]:
        new = sum(len(t) for t in self.tokens)
        return {"tokens": self.tokens, "prefill_seconds": self.prefill_seconds,
                "decode_seconds": self.decode_seconds, "decode_steps": self.decode_steps,
                "decode_tokens_per_second": (new - len(self.tokens)) / self.decode_seconds
                if self.decode_seconds else None,
                "stage_seconds": self.stage_seconds, "micro_batches": self.micro_batches,
                "threads": self.threads, "stages": self.stages}


def generate(pipeline: Pipeline, prompts: list[list[int]], max_new_tokens: int, sampler: Sampler,
             stop_tokens: frozenset[int] = frozenset(), micro_batches: int = 1,
             waits: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext) -> Generation:
    """Prefill of the prompts (right-padded to the longest of each micro-batch), then decode steps
    until every row has `max_new_tokens` or a stop token, micro-batch after micro-batch through the
    pipeline's stages in this process (k3export.runtime.schedule's order); a row that has stopped
    runs on with its micro-batch, its new tokens dropped. Each stage call runs in a `waits()` context
    (under torchrun: a split stage's sums named when they fail, or an engine's under the watchdog)."""
    batches = split_prompts(prompts, micro_batches)
    pipeline.reset_slots([b.size for b in batches])
    stages = pipeline.stages
    tokens = Tokens(len(prompts), max_new_tokens, sampler, stop_tokens)
    times = [StageTimes(s.runner.name) for s in stages]
    start = time.perf_counter()
    for batch in round_robin(batches):
        outputs: dict[str, np.ndarray] = {}
        for i, stage in enumerate(stages):
            stage.use(batch.index)
            started = time.perf_counter()
            with waits():
                outputs = stage(stage.feeds(batch.request(), outputs))
            # What would cross to the next stage (the last: the tokens back to the first).
            last = i + 1 == len(stages)
            sent = 8 * batch.size if last else nbytes([outputs[n] for n in passed_on(stages, i)])
            times[i].record(batch, started, stage.runner.inference_time, sent, stage.runner.collective_time)
        ids = tokens.take(batch, outputs["logits"])
        batch.advance()
        batch.input_ids = ids[:, None].astype(np.int64)
    return Generation(tokens.rows, tokens.prefilled_at - start, tokens.decode_seconds(),
                      max(b.calls for b in batches) - 1, [s.seconds for s in stages], len(batches),
                      [t.summary() for t in times])


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """`batch` prompts of different lengths, the first `prompt_len` tokens long."""
    rng = np.random.default_rng(seed)
    lengths = [max(1, prompt_len * (batch - b) // batch) for b in range(batch)]
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def vocab_size(export_dir: Path) -> int:
    return json.loads((export_dir / "config.json").read_text())["vocab_size"]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("build", metavar="DIR", type=existing_dir, help="a `k3export build RECIPE` folder")
    parser.add_argument("--prompt-len", type=positive_int, default=32, help="tokens of the longest prompt")
    parser.add_argument("--prompt-ids", metavar="IDS", type=token_ids,
                        help="one prompt, comma-separated token ids")
    parser.add_argument("--batch", type=positive_int, default=1, help="random prompts of different lengths")
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
        batch, prompt_len = 1, len(args.prompt_ids)
        request = f"--prompt-ids ({prompt_len} tokens)"
    else:
        batch, prompt_len = args.batch, args.prompt_len
        request = f"--batch {batch} --prompt-len {prompt_len}"
    manifests = [json.loads((d / MANIFEST_FILE).read_text()) for d in exports]
    require_request_fits(f"{request} --max-new-tokens {args.max_new_tokens}", manifests, batch, prompt_len,
                         args.max_new_tokens - 1)
    return [args.prompt_ids] if args.prompt_ids else random_prompts(batch, prompt_len, vocab, args.seed)


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


def stage_name(stage: Stage) -> str:
    return f"{stage.runner.name} (layers {stage.layers.start}..{stage.layers.stop - 1})"


def cmd_run(args: argparse.Namespace) -> int:
    exports = stage_exports(args.build)
    choice = choose_runner(args.build, args.runner)
    print(choice.line(), file=sys.stderr, flush=True)
    threads = intra_op_threads(args, 1) if choice.kind != ENGINE else None  # ONNX Runtime's
    prompts = prompts_of(args, exports)
    engines = None
    if choice.kind == ENGINE:  # every stage on this process's GPU
        device = device_of(os.environ, torch.cuda.device_count())
        engines = [choice.place(i, 0, device) for i in range(len(exports))]
    pipeline = Pipeline(exports, threads, engines=engines)
    try:
        result = generate(pipeline, prompts, args.max_new_tokens,
                          Sampler(args.temperature, args.top_k, args.top_p, args.seed), frozenset(args.stop),
                          args.micro_batches or default_micro_batches(len(prompts), len(exports)))
    finally:
        pipeline.close()
    result.threads = threads
    report(args, result, [stage_name(s) for s in pipeline.stages])
    return 0


def add_parser(sub: Any) -> None:
    """Registers `k3export run` on the CLI's subparsers."""
    run = sub.add_parser("run", help="generate with a sharded build: its stages in order, in this process "
                                     "(torchrun -m k3export.runtime: one process a stage)")
    add_run_arguments(run)
    run.set_defaults(run=cmd_run)
