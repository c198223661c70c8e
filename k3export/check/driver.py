"""Check's one driver: the same requests to an artifact's runner and to the eager model, compared
step by step, and the verdict.

`compare_with_eager` serves every artifact: it takes the artifact's runner (k3export.check.runners,
on k3export.onnx.runner.StatefulRunner) and the eager model (k3export.check.runners.eager.EagerSide),
each holding its own caches, as a serving runtime does. The requests: a prefill of a right-padded
batch of prompts of different lengths from empty caches, then greedy decode steps in which every
side takes the artifact's token, so that a near-tie cannot derail the comparison. The artifact runs
every step first, recorded (`Recording`); the eager side then follows on the same feeds a span of
layers at a time (one layer streamed, one stage in memory), and each step is judged once its last
output is in (`StepStats`). Only the valid entries
are compared (k3export.check.compare): each row's first input_lengths[b] positions, the cache rows
written so far, and the KDA states and conv tails. A request that does not fit the cache capacity is
refused before any runner runs. `run_check` is `check --onnx DIR` (and, with an engine's runner,
`check --engine`): the driver over one export folder, its replay files and report in DIR/check.

A half-precision export is held to what its dtype allows: the eager model also runs in float32
on the same weights and inputs, and at each step the outputs may differ from the eager
half-precision ones by up to twice the largest difference between eager half precision and eager
float32 in that step (never less than the dtype's fixed bound), and a greedy position is a tie
when its margin is within twice the step's largest logit spread. The spread is taken over the step
because rounding flips the router's choice on near-tied experts, a discrete change that lands in
one backend's layer 4 and the other's layer 6 and then spreads through the caches; so the eager
routers are also held to the graph's own expert choices (k3export.check.routing). With random
weights such near-ties are common and the bound is loose; with trained weights it tightens.
The prefill's inputs (caches included) and the eager outputs are saved in Polygraphy's format, so
that

    polygraphy run DIR/model.onnx --onnxrt --load-inputs DIR/check/inputs.json \\
        --load-outputs DIR/check/golden.json --atol A --rtol R

repeats the prefill comparison from the command line (the report prints the exact command).
"""

from __future__ import annotations

import math
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from polygraphy.comparator import IterationResult, RunResults
from polygraphy.json import save_json
from polygraphy.logger import G_LOGGER

from k3export.artifacts import REPLAY, OutputDir, require, verify, write_json
from k3export.check.compare import (
    TOLERANCES,
    Comparison,
    TokenAgreement,
    Tolerance,
    compare,
    half_precision_tolerance,
    top1_agreement,
    verdict,
)
from k3export.check.machine import machine
from k3export.check.routing import routing_outputs
from k3export.check.runners.eager import EagerSide, carried, plan_eager, require_fits_disk
from k3export.check.speculative import SpeculativeRequests, require_speculation_fits
from k3export.check.taps import compare_taps, first_divergent
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE, TensorSpec, resolve_shape
from k3export.onnx.runner import BoundOnnxrtRunner, Signature, StatefulRunner, numpy_dtype
from k3export.onnx.taps import parse_tap
from k3export.options import AUTO, require_request_fits
from k3export.progress import track
from k3export.weights.checkpoint import check_weights

CHECK_DIR, CHECK_MANIFEST = "check", "check.json"
# Elementwise tolerances for the `polygraphy run` replay: |a - b| <= atol + rtol |b|.
POLYGRAPHY_TOLERANCES = {"float32": (1e-3, 1e-3), "float16": (0.1, 0.05), "bfloat16": (0.5, 0.1)}
Arrays = dict[str, np.ndarray]


def valid_entries(spec: TensorSpec, array: np.ndarray, lengths_after: np.ndarray,
                  input_lengths: np.ndarray) -> np.ndarray:
    """The entries of an output that mean something, flattened row by row: along "seq" each row's
    first input_lengths[b], along "capacity" the rows written so far (lengths_after[b])."""
    limits = input_lengths if "seq" in spec.shape else lengths_after if "capacity" in spec.shape else None
    if limits is None:
        return array.ravel()
    batch_axis = spec.shape.index("batch")
    axis = spec.shape.index("seq" if "seq" in spec.shape else "capacity")
    axis -= axis > batch_axis  # once the batch axis is taken
    rows = [np.take(np.take(array, b, axis=batch_axis), np.arange(n), axis=axis).ravel()
            for b, n in enumerate(limits)]
    return np.concatenate(rows)


def read_export(onnx_dir: Path) -> tuple[dict[str, Any], K3Config]:
    """export.json and config.json of an export folder whose files all match export.json."""
    manifest = verify(onnx_dir, MANIFEST_FILE)
    require(manifest, onnx_dir / MANIFEST_FILE, "graph", "dtype", "weights", "layers", "inputs", "outputs",
            "capacity")
    return manifest, K3Config.from_json(onnx_dir / "config.json")


def prompt_lengths(batch: int, prompt_len: int) -> list[int]:
    """Rows of different lengths, the first `prompt_len` long, so every check covers padding."""
    return [max(1, prompt_len * (batch - b) // batch) for b in range(batch)]


def request(signature: Signature, tokens: np.ndarray | None, cache_lengths: list[int],
            input_lengths: list[int], vocab: int, gen: torch.Generator) -> dict[str, np.ndarray]:
    """One call's feeds: `tokens` (random ones if None) or random AttnRes boundary tensors for a range."""
    batch, seq = len(cache_lengths), max(input_lengths)
    sizes = {"batch": batch, "seq": seq}
    feed = {"cache_lengths": np.array(cache_lengths, np.int64),
            "input_lengths": np.array(input_lengths, np.int64)}
    for spec in signature.feeds:
        shape = resolve_shape(spec, sizes) if spec.name not in feed else None
        if spec.name == "input_ids":
            feed[spec.name] = (torch.randint(0, vocab, shape, generator=gen).numpy() if tokens is None
                               else tokens.astype(np.int64))
        elif spec.name.startswith("attn_res."):
            feed[spec.name] = torch.randn(shape, generator=gen).numpy().astype(numpy_dtype(spec.dtype))
    return feed


def last_tokens(logits: np.ndarray, input_lengths: list[int]) -> np.ndarray:
    """Each row's greedy token at its last valid position, [batch, 1]."""
    if logits.ndim == 2:  # --last-logits
        return logits.argmax(-1)[:, None]
    return np.array([[logits[b, n - 1].argmax()] for b, n in enumerate(input_lengths)])


def fitting_lengths(manifests: list[dict[str, Any]], batch: int, prompt_len: int, steps: int) -> list[int]:
    """The prompt lengths of a check of the exports of `manifests` (one, or a build's stages),
    refused (UserError) unless the longest row's prompt and decode steps fit their cache capacity
    and the graph's and the eager model's caches fit this machine's memory."""
    require_request_fits(f"--batch {batch} --prompt-len {prompt_len} --steps {steps}", manifests, batch,
                         prompt_len, steps, copies=2)
    return prompt_lengths(batch, prompt_len)


def planned(export_dir: Path, taps: bool, batch: int, prompt_len: int,
             steps: int) -> tuple[dict[str, Any], K3Config, list[int]]:
    """An export folder's manifest and config, verified, and the prompt lengths of a check that is
    known to fit its cache capacity (the prefill, then the last decode step of the longest row)."""
    manifest, config = read_export(export_dir)
    if taps:
        require_taps(manifest, export_dir)
    if manifest["weights"].get("stripped"):
        raise UserError(f"{export_dir}: exported with --no-weights, so there are no numbers to check; "
                        "it is checked structurally (onnx.checker full_check)")
    if "parallel" in manifest:
        split = manifest["parallel"]
        raise UserError(f"{export_dir}: rank {split['rank']} of {split['ranks']} of a split model (its "
                        "export.json's 'parallel'); a rank computes only its share, summed with the other "
                        "ranks': check the grid it belongs to, k3export check --build BUILD_DIR "
                        "(docs/parallel.md)")
    return manifest, config, fitting_lengths([manifest], batch, prompt_len, steps)


def run_check(onnx_dir: str | Path, steps: int = 16, seed: int = 0, batch: int = 2,
              prompt_len: int = 70, log: Any = print, taps: bool = False,
              graph_runner: Callable[[Signature, list[str]], StatefulRunner] | None = None,
              eager: str = AUTO, speculate: int = 0) -> dict[str, Any]:
    """A prefill of `batch` prompts of different lengths (the longest `prompt_len`), right-padded,
    then `steps` decode steps, ONNX Runtime against eager; returns the report (see "passed"). The
    replay files and the report go to DIR/check (a folder of check's own, replaced each run).
    `taps`: also compare the export's taps (export --taps) and name the first divergent layer.
    `graph_runner(signature, extra outputs)`: the artifact's runner in place of ONNX Runtime
    (check --engine). `eager`: how the eager side runs (k3export.check.runners.eager.plan_eager).
    `speculate`: K, speculative decoding's requests (k3export.check.speculative) after the prefill."""
    onnx_dir = Path(onnx_dir)
    G_LOGGER.module_severity = G_LOGGER.WARNING  # Polygraphy prints every tensor's metadata at INFO
    manifest, config, lengths = planned(onnx_dir, taps, batch, prompt_len, steps)
    if manifest["dtype"] == "bfloat16" and graph_runner is None:
        raise UserError(f"{onnx_dir}: ONNX Runtime's CPU provider has no bfloat16 MatMul; check the "
                        f"bfloat16 graph as TensorRT parses it: k3export check --network {onnx_dir}")
    graph = onnx_dir / GRAPH_FILE
    out = OutputDir(onnx_dir / CHECK_DIR, REPLAY, overwrite=None,
                    option="the check's folder")
    # The replay is `polygraphy run --onnxrt`, which cannot run bfloat16 (nor numpy hold it).
    replayable = manifest["dtype"] != "bfloat16"
    with out.staged() as stage:
        signature = Signature(manifest)
        report, session = compare_with_eager(
            manifest, config, graph,
            graph_runner or (lambda sig, extra: BoundOnnxrtRunner(graph, sig, extra_outputs=extra)),
            steps, seed, lengths, log, taps,
            on_prefill=(lambda feed, golden: _save_replay(stage, signature, feed, golden, len(lengths)))
            if replayable else None, eager=eager, speculate=speculate)
        report["aliased"] = dict(session.aliased)
        if replayable:
            report["polygraphy_command"] = _replay_command(onnx_dir, manifest["dtype"], report)
        save_json(report, str(stage / "report.json"), description="check report")
        write_json(stage / CHECK_MANIFEST, {"passed": report["passed"], "report": "report.json"})
    return report


def _replay_command(onnx_dir: Path, dtype: str, report: dict[str, Any]) -> str:
    """The `polygraphy run` command that replays the prefill comparison from the saved files."""
    atol, rtol = POLYGRAPHY_TOLERANCES[dtype]
    # Elementwise replay tolerance: room for the prefill's own error when it passed (half precision
    # may exceed the fixed atol), the fixed one when it failed, so the replay fails too.
    prefill = report["steps"][0]["outputs"]
    if all(c["passed"] for c in prefill):
        atol = max(atol, 2 * max(c["max_abs"] for c in prefill))
    check_dir = onnx_dir / CHECK_DIR
    return (f"polygraphy run {onnx_dir / GRAPH_FILE} --onnxrt --load-inputs {check_dir / 'inputs.json'} "
            f"--load-outputs {check_dir / 'golden.json'} --atol {atol:.3g} --rtol {rtol}")


def require_taps(manifest: dict[str, Any], folder: Path) -> None:
    if "taps" not in manifest:
        raise UserError(f"--taps: {folder / MANIFEST_FILE} lists no taps outputs; expected an export "
                        f"written with `k3export export --taps`")


SPILL_BYTES = 16 << 20  # a recorded array past this is written to disk


@dataclass
class Recorded:
    """One step of the artifact, as the eager side follows it: its feeds, its compared outputs and
    taps (valid entries only), its expert choices by layer."""

    feed: Arrays
    valid: Arrays
    choices: dict[int, np.ndarray]


class Recording:
    """The artifact's steps, recorded before the eager side runs. An array past SPILL_BYTES is
    written to a temporary folder and read back memory-mapped (at kimi-k3 widths a KDA state is
    6.3 MB a row and the MLA cache 131,072 rows); the folder goes when the recording closes."""

    def __init__(self) -> None:
        self.steps: list[Recorded] = []
        self.folder = tempfile.TemporaryDirectory(prefix="k3export-check-")
        self.bytes_on_disk = 0

    def _kept(self, array: np.ndarray) -> np.ndarray:
        array = np.asarray(array)
        if array.nbytes <= SPILL_BYTES:
            return np.copy(array)  # a runner's buffers are reused by its next call
        path = Path(self.folder.name) / f"{self.bytes_on_disk:x}.npy"
        np.save(path, array)
        self.bytes_on_disk += array.nbytes
        # Copy-on-write: torch takes only writable arrays; an ndarray on the mapping, not a np.memmap.
        return np.asarray(np.load(path, mmap_mode="c"))

    def add(self, feed: Arrays, valid: Arrays, choices: dict[int, np.ndarray]) -> None:
        kept = ({k: self._kept(a) for k, a in d.items()} for d in (feed, valid, choices))
        self.steps.append(Recorded(*kept))

    def close(self) -> None:
        self.folder.cleanup()


def recording_bytes(signature: Signature, lengths: list[int], steps: int, taps: bool) -> int:
    """An upper bound of what the artifact's recorded outputs take: every compared output (and tap)
    at every step, its "seq" the prompt's length at the prefill and 1 after, its "capacity" the
    rows written by the last step."""
    sizes = {"batch": len(lengths), "capacity": max(lengths) + steps}
    specs = signature.compared + (signature.taps if taps else [])
    return sum(math.prod(resolve_shape(s, {**sizes, "seq": seq})) * numpy_dtype(s.dtype).itemsize
               for seq in [max(lengths)] + [1] * steps for s in specs)


class StepStats:
    """One step's comparisons, gathered as the eager side's spans give its outputs, and judged once
    the step's last output is in: in half precision its bound and tie margin grow with the eager
    half-vs-float32 spread over every output of the step (half_precision_tolerance)."""

    def __init__(self, tolerance: Tolerance) -> None:
        self.tolerance = tolerance
        self.comparisons: dict[str, Comparison] = {}
        self.half, self.spread, self.logit_spread = False, 0.0, 0.0
        self.tokens: TokenAgreement | None = None

    def add(self, name: str, actual: np.ndarray, reference: np.ndarray, float32: np.ndarray | None) -> None:
        self.comparisons[name] = compare(name, actual, reference, self.tolerance)
        if float32 is not None:
            self.half = True
            self.spread = max(self.spread, compare(name, reference, float32, self.tolerance).rel)
            if name == "logits":
                self.logit_spread = float(np.abs(reference.astype(np.float64) - float32).max())

    def bound(self) -> Tolerance:
        return half_precision_tolerance(self.tolerance, self.spread, self.logit_spread) if self.half \
            else self.tolerance

    def add_tokens(self, actual: np.ndarray, reference: np.ndarray, vocab: int) -> None:
        """The greedy tokens, once every other output of the step is in (the margin needs the spread)."""
        self.tokens = top1_agreement(actual.reshape(-1, vocab), reference.reshape(-1, vocab),
                                     self.bound().margin)

    def judged(self, label: str, signature: Signature, log: Any) -> dict[str, Any]:
        """The step's report entry: each compared output (in signature order) against the step's bound."""
        bound = self.bound().rel
        comparisons = [replace(c, bound=bound, passed=c.finite and c.rel <= bound)
                       for c in (self.comparisons[s.name] for s in signature.compared)]
        step: dict[str, Any] = {"step": label, "outputs": [c.as_dict() for c in comparisons]}
        worst = max(comparisons, key=lambda c: c.rel / c.bound)
        line = f"{label:>10}: worst {worst.name} rel {worst.rel:.2e} (bound {worst.bound:.1e})"
        if self.tokens:
            tokens, logits = self.tokens, next(c for c in comparisons if c.name == "logits")
            step["tokens"] = tokens.as_dict()
            line += (f"; logits rel {logits.rel:.2e} cos {logits.cosine:.6f}; top-1 {tokens.agree}/"
                     f"{tokens.positions} (ties {tokens.ties}, mismatches {tokens.mismatches})")
        failed = [c.name for c in comparisons if not c.passed]
        nonfinite = [c.name for c in comparisons if not c.finite]
        if nonfinite:
            step["nonfinite"] = nonfinite
            line += f"; NaN/Inf in {', '.join(nonfinite)}"
        log(line + (f"  FAILED: {', '.join(failed)}" if failed else ""))
        return step


def first_request(signature: Signature, lengths: list[int], vocab: int, gen: torch.Generator) -> Arrays:
    """The prefill's feeds: right-padded prompts of `lengths` random tokens (or random AttnRes boundary
    tensors for a range) from empty caches."""
    feed = request(signature, None, [0] * len(lengths), lengths, vocab, gen)
    # Pad with token 0, as a server would: any value works, none is read.
    if "input_ids" in feed:
        feed["input_ids"][np.arange(max(lengths)) >= np.array(lengths)[:, None]] = 0
    return feed


def compare_with_eager(manifest: dict[str, Any], config: K3Config, graph: Path | None,
                       graph_runner: Callable[[Signature, list[str]], StatefulRunner], steps: int, seed: int,
                       lengths: list[int], log: Any, taps: bool = False,
                       on_prefill: Callable[[Arrays, Arrays], None] | None = None,
                       routing: list[str] | None = None,
                       on_step: Callable[[int, dict[str, Any]], None] | None = None,
                       stages: list[dict[str, Any]] | None = None, eager: str = AUTO,
                       feeds: list[Arrays] | None = None,
                       speculate: int = 0) -> tuple[dict[str, Any], StatefulRunner]:
    """The one check driver, for every backend: `graph_runner(signature, extra_outputs)` (ONNX
    Runtime, the parsed TensorRT network, a chain of stages) against the eager model, and for half
    precision the eager float32 model, on the same requests: a prefill of right-padded prompts of
    `lengths` from empty caches, then `steps` greedy decode steps, each side with its own caches.

    The artifact runs every step first, taking its own greedy tokens (a graph without logits takes
    random tokens or AttnRes tensors; `feeds`, when given, are every step's); its feeds, compared
    outputs and taps (valid entries only) and expert choices are recorded (k3export.check.driver.
    Recording). The eager side then follows on the same feeds, span of layers after span
    (k3export.check.runners.eager.EagerSide: one layer a span streamed, one stage a span in memory,
    `eager` says which or auto), held in half precision to the artifact's expert choices (extra
    outputs `routing`, default: read from `graph`) step by step; each output is compared as its span
    gives it, and each step judged once its last output is in. Returns the report, verdict
    included, and the graph's runner.

    For a chain of stages (check --build) `stages` are its stages' export.json (the in-memory spans)
    and `on_step(index, step)` is called with each step's report entry once judged (to add columns).
    `speculate` K: the requests after the prefill are the artifact's speculative decoding's, with K
    drafts a call (k3export.check.speculative); report["speculation"] says what they were."""
    dtype = manifest["dtype"]
    tolerance = TOLERANCES[dtype]
    layers = range(*manifest["layers"])
    signature = Signature(carried(manifest))
    tapped = "taps" in manifest  # the graph gives them, compared or not
    weights = manifest["weights"]
    log(f"eager reference: {config.num_hidden_layers} layers, {dtype}, weights {weights}; "
        f"prompts of {lengths} tokens, cache capacity {signature.capacity}")
    plan = plan_eager(eager, config, dtype, weights, [range(*m["layers"]) for m in stages or [manifest]])
    log(plan.line())
    speculative = SpeculativeRequests(speculate, config.vocab_size) if speculate else None
    if speculative:
        require_speculation_fits(speculate, max(lengths), steps, signature.capacity)
    require_fits_disk(recording_bytes(signature, lengths, steps, taps), tempfile.gettempdir(), "check")
    check_weights(config, getattr(torch, dtype), weights, layers)  # every layer's tensors, before any runs
    # Where the graph's expert choices are read: its own outputs (export --routing-outputs), or
    # intermediates the runner exposes.
    source = "graph outputs" if "routing_outputs" in manifest else "intermediates"
    if routing is None:
        routing = ([] if dtype == "float32" else [s["name"] for s in manifest["routing_outputs"]]
                   if source == "graph outputs" else routing_outputs(graph))
    held = dict(zip(routing, (i for i in layers if not config.is_dense(i)), strict=True)) if routing else {}
    graph_side = graph_runner(signature, routing)
    report: dict[str, Any] = {"dtype": dtype, "tolerance": tolerance.__dict__, "prompt_lengths": lengths,
                              "capacity": signature.capacity, "held_routing": bool(routing),
                              "routing_read_from": source if routing else None, "steps": []}
    recording = Recording()
    try:
        streams = [_run_artifact(graph_side, signature, recording, held, steps, seed, lengths,
                                 config.vocab_size, taps, feeds, speculative), []]
        stats = [StepStats(tolerance) for _ in recording.steps]
        tap_values: list[list[Arrays]] = [[r.valid] for r in recording.steps]  # per step: artifact, eager..
        golden: Arrays = {}
        outputs = {s.name: s for s in signature.outputs}
        compared = {s.name for s in signature.compared}

        def on_outputs(t: int, outs: list[Arrays]) -> None:
            """One span's outputs at step t: compared with the artifact's as they come."""
            recorded = recording.steps[t]
            input_lengths = recorded.feed["input_lengths"]
            after = recorded.feed["cache_lengths"] + input_lengths
            if t == 0 and on_prefill:
                golden.update({n: np.copy(a) for n, a in outs[0].items() if n in outputs})
            valid = [{n: valid_entries(outputs[n], a, after, input_lengths) for n, a in out.items()
                      if n in outputs} for out in outs]
            for name in (n for n in valid[0] if n in compared):
                stats[t].add(name, recorded.valid[name], valid[0][name],
                             valid[1][name] if len(valid) > 1 else None)
            if "logits" in valid[0]:
                stats[t].add_tokens(recorded.valid["logits"], valid[0]["logits"], config.vocab_size)
                streams[1].append(last_tokens(outs[0]["logits"], input_lengths.tolist())[:, 0].tolist())
            if taps:
                for i, v in enumerate(valid, 1):
                    if len(tap_values[t]) <= i:
                        tap_values[t].append({})
                    tap_values[t][i].update({n: a for n, a in v.items() if parse_tap(n)})

        side = EagerSide(config, dtype, weights, plan.spans, signature.capacity,
                         manifest.get("last_logits", False), tapped, log)
        side.run([r.feed for r in recording.steps], [r.choices for r in recording.steps] if held else None,
                 on_outputs)
        if on_prefill:
            on_prefill(recording.steps[0].feed, {s.name: golden[s.name] for s in signature.outputs})
        tap_steps = []
        for t, step_stats in enumerate(stats):
            label = "prefill" if t == 0 else f"decode {t}"
            report["steps"].append(step_stats.judged(label, signature, log))
            if routing:
                # Token-layer choices where each eager model would have picked other experts.
                report["steps"][-1]["routing_flips"] = {name: flips[t] for name, flips in side.flips.items()}
            if on_step:
                on_step(t, report["steps"][-1])
            if taps:
                actual, *eager_taps = ({s.name: values[s.name] for s in signature.taps}
                                       for values in tap_values[t])
                float32 = eager_taps[1] if len(eager_taps) > 1 else None
                rows = compare_taps(eager_taps[0], actual, float32, tolerance)
                tap_steps.append({"step": label, "taps": rows})
        report["recorded_bytes_on_disk"] = recording.bytes_on_disk
    finally:
        recording.close()
    report.update(verdict(report["steps"], side.nonfinite_weights))
    report["compared_nothing"] = compared_nothing(report["steps"], report["token_positions"],
                                                  layers.stop == config.num_hidden_layers)
    report["passed"] = report["passed"] and not report["compared_nothing"]
    report["machine"] = machine()
    report["eager"] = {**plan.as_dict(), **side.report()}
    report["tokens_from"] = "the artifact's greedy tokens" if streams[0] and not feeds else "drawn at random"
    report["routing_flips"] = sum(side.flips.get("eager", [])) if routing else 0
    report["greedy_streams_identical"] = streams[0] == streams[1]
    if speculative:
        report["speculation"] = speculative.summary()
        report["passed"] = report["passed"] and speculative.streams_identical
    if taps:
        report["taps"] = {"steps": tap_steps, "first_divergent": first_divergent(tap_steps)}
    return report, graph_side


def compared_nothing(steps: list[dict[str, Any]], token_positions: int, ends_the_model: bool) -> str | None:
    """Why a check compared nothing, or None: a check never passes without comparing. No output of any
    step compared; or 0 greedy token positions where the graph ends at the model's last layer (it then
    gives logits: without them, a build missing its last stage, say, would pass on its boundaries)."""
    if not any(s["outputs"] for s in steps):
        return "no output was compared"
    if ends_the_model and not token_positions:
        return ("0 greedy token positions compared: the graph ends at the model's last layer but gave no "
                "logits")
    return None


def _run_artifact(runner: StatefulRunner, signature: Signature, recording: Recording, held: dict[str, int],
                  steps: int, seed: int, lengths: list[int], vocab: int, taps: bool,
                  feeds: list[Arrays] | None,
                  speculative: SpeculativeRequests | None = None) -> list[list[int]]:
    """The artifact over every step, recorded; returns its greedy tokens per step (none without logits).
    `speculative`: the steps are the requests it makes with the runner first."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    feed = feeds[0] if feeds else first_request(signature, lengths, vocab, gen)
    kept = signature.compared + (signature.taps if taps else [])
    stream = []
    with runner:
        if speculative:
            feeds = speculative.feeds(runner, feed, steps)
            steps = len(feeds) - 1
        runner.reset(batch)
        for step in track(range(steps + 1), "check: the artifact's prefill and decode steps"):
            out = runner.infer(feed, check_inputs=False)
            input_lengths = feed["input_lengths"]
            cache_lengths = feed["cache_lengths"] + input_lengths
            valid = {s.name: valid_entries(s, out[s.name], cache_lengths, input_lengths) for s in kept}
            recording.add(feed, valid, {layer: out[name] for name, layer in held.items()})
            tokens = None
            if "logits" in out:
                tokens = last_tokens(out["logits"], input_lengths.tolist())
                stream.append(tokens[:, 0].tolist())
            if step < steps:
                feed = feeds[step + 1] if feeds else \
                    request(signature, tokens, cache_lengths.tolist(), [1] * batch, vocab, gen)
        runner.finish()
    return stream


def _save_replay(stage: Path, signature: Signature, feed: dict[str, np.ndarray],
                 golden: dict[str, np.ndarray], batch: int) -> None:
    """The prefill's full inputs (empty caches included) and the eager outputs, in Polygraphy's
    format, for `polygraphy run --onnxrt` (which feeds every input itself, copying the caches)."""
    full = {**feed, **signature.empty_caches(batch)}
    save_json([OrderedDict((s.name, full[s.name]) for s in signature.inputs)], str(stage / "inputs.json"),
              description="check inputs")
    results = RunResults()
    outputs = {name: np.copy(value) for name, value in golden.items()}
    results.append(("eager", [IterationResult(outputs, runner_name="eager")]))
    results.save(str(stage / "golden.json"))
