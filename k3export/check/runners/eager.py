"""The eager model as a check runner: the reference every artifact is compared against, run a span
of layers at a time over every step of a request the artifact has already run.

`EagerRunner` is the model over one span of layers (an ExportGraph) with its caches, as every
runner holds them. `EagerSide` runs the check's layers span after span: each span's weights are
built (read from the checkpoint, or drawn from the seed) when its turn comes, run over every step
with the span's caches, and freed; what passes from one span to the next (the AttnRes bank and
partial, or the logits) is kept per step. Spans of one layer each are the streamed eager side
(about one layer's weights in memory, whatever the model's size); spans of a stage each are the
in-memory one. Both run the same ops on the same inputs, so they give the same numbers.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from k3export.check.compare import nonfinite_tensors
from k3export.check.machine import peak_memory, reset_peak_memory
from k3export.check.routing import held_routing
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.model import K3ForCausalLM
from k3export.onnx.export import ExportGraph, TensorSpec, graph_signature
from k3export.onnx.runner import DRAFT_LENGTHS, NUMPY_CARRIER, PAST, Signature, StatefulRunner
from k3export.onnx.taps import parse_tap
from k3export.options import AUTO, IN_MEMORY, STREAMED, available_memory
from k3export.weights.checkpoint import build_model

Arrays = dict[str, np.ndarray]


class EagerRunner(StatefulRunner):
    """`graph` (an ExportGraph, or anything called the same way: flat tensors in and out in the
    signature's order) holding its caches as torch tensors. It casts feeds to the model's own dtypes,
    so a float32 model can take a float16 graph's feeds."""

    def __init__(self, graph: Any, name: str, signature: Signature) -> None:
        super().__init__(signature, name)
        self.graph = graph

    def empty_caches(self, batch: int) -> dict[str, torch.Tensor]:
        dtype = self.graph.model.dtype
        # KDA states are float32 in every model; the other caches take the model's dtype.
        return {name: torch.from_numpy(a).to(torch.float32 if "kda_state" in name else dtype)
                for name, a in self.signature.empty_caches(batch).items()}

    def call(self, feeds: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        model_dtype = self.graph.model.dtype
        tensors = []
        for spec in self.signature.inputs:
            if spec.name in self.caches:
                tensors.append(self.caches[spec.name])
            else:
                x = torch.from_numpy(np.asarray(feeds[spec.name]))
                tensors.append(x.to(model_dtype) if x.is_floating_point() else x)
        with torch.no_grad():
            outputs = dict(zip((s.name for s in self.signature.outputs), self.graph(*tensors), strict=True))
        self.keep_caches(outputs)
        return OrderedDict((name, value.numpy()) for name, value in outputs.items())


class Float32Boundary:
    """An ExportGraph whose bfloat16 tensors cross numpy as float32 (exact): inputs are cast to the
    graph's dtypes, bfloat16 outputs widened, so that EagerRunner serves a bfloat16 model."""

    def __init__(self, graph: ExportGraph, inputs: list[TensorSpec]) -> None:
        self.graph, self.model, self.layers = graph, graph.model, graph.layers
        self.dtypes = [getattr(torch, s.dtype) for s in inputs]

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = self.graph(*(x.to(d) for x, d in zip(inputs, self.dtypes, strict=True)))
        return tuple(o.to(NUMPY_CARRIER.get(o.dtype, o.dtype)) for o in outputs)


def span_manifest(config: K3Config, layers: range, dtype: str, capacity: int, last_logits: bool,
                  taps: bool) -> dict[str, Any]:
    """The export.json fields of a graph over `layers` (inputs, outputs, capacity), as check runs
    the eager model over them."""
    inputs, outputs = graph_signature(config, layers, getattr(torch, dtype), last_logits, taps)
    return {"inputs": [asdict(s) for s in inputs], "outputs": [asdict(s) for s in outputs],
            "capacity": capacity}


def carried(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with bfloat16 tensors declared float32, as they cross numpy."""
    def widen(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**s, "dtype": "float32" if s["dtype"] == "bfloat16" else s["dtype"]} for s in specs]

    return {**manifest, "inputs": widen(manifest["inputs"]), "outputs": widen(manifest["outputs"])}


def passed_on(name: str) -> bool:
    """Whether a span's output goes on to the next span (the AttnRes state) or ends the model (logits),
    rather than being a cache or a tap."""
    return not name.startswith(("present.", PAST)) and not parse_tap(name)


def weight_bytes(model: K3ForCausalLM, layers: range, dtype: torch.dtype) -> int:
    """The bytes of the weights that running `layers` holds (k3export.model.K3ForCausalLM.parts), its
    floating-point tensors in `dtype` (a meta model's shapes will do)."""
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
               for part in model.parts(layers) for t in chain(part.parameters(), part.buffers()))


def eager_dtypes(dtype: str) -> list[str]:
    """The eager models of a check: the reference, and in half precision its float32 twin."""
    return [dtype] if dtype == "float32" else [dtype, "float32"]


@dataclass(frozen=True)
class EagerPlan:
    """How the eager side runs: its mode, why, its spans, and the memory of each mode's weights (the
    largest span's, every model of the check together)."""

    mode: str
    why: str
    spans: list[range]
    streamed_bytes: int
    in_memory_bytes: int

    def line(self) -> str:
        return (f"eager side: {self.mode} ({self.why}), {len(self.spans)} span(s) of layers; weights held "
                f"at once: streamed {self.streamed_bytes / 1e9:.3g} GB, in memory "
                f"{self.in_memory_bytes / 1e9:.3g} GB")

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "why": self.why, "spans": [[s.start, s.stop] for s in self.spans],
                "streamed_bytes": self.streamed_bytes, "in_memory_bytes": self.in_memory_bytes}


# auto holds the eager side in memory only when its weights take at most this share of the memory
# available. In memory it peaked at its weights and 1.9 GB more (the published widths' first 4 layers,
# bfloat16 with its float32 twin: 21.8 GB of weights, 23.7 GB peak of this machine's 24.3, measured by
# tools/check_memory.py), and the host runs other processes beside a check; streaming is not slower
# at those widths (2 layers: 60 s streamed, 80 s in memory), so auto errs toward it.
AUTO_IN_MEMORY_SHARE = 0.5


def plan_eager(choice: str, config: K3Config, dtype: str, weights: dict[str, Any],
               stages: list[range]) -> EagerPlan:
    """The eager side of a check over `stages` (layer ranges, in order): streamed (one layer a span)
    or in memory (one stage a span), as `choice` says (auto: in memory when its weights take at most
    AUTO_IN_MEMORY_SHARE of this machine's available memory, else streamed). Refuses (UserError,
    naming the numbers) a mode whose weights do not fit."""
    stripped = {"stripped": True, **({"packed_experts": True} if weights.get("packed_experts") else {})}
    shapes = build_model(config, getattr(torch, dtype), stripped)  # meta: shapes, no memory
    layers = range(stages[0].start, stages[-1].stop)

    def held(spans: list[range]) -> int:
        return max(sum(weight_bytes(shapes, span, getattr(torch, d)) for d in eager_dtypes(dtype))
                   for span in spans)

    streamed, in_memory = [range(i, i + 1) for i in layers], list(stages)
    need = {STREAMED: held(streamed), IN_MEMORY: held(in_memory)}
    available = available_memory()
    fits = {mode: not available or n <= available for mode, n in need.items()}
    if choice == AUTO:
        roomy = not available or need[IN_MEMORY] <= AUTO_IN_MEMORY_SHARE * available
        mode = IN_MEMORY if roomy else STREAMED
        why = (f"auto: the in-memory side's {need[IN_MEMORY] / 1e9:.3g} GB of weights are "
               + ("within" if roomy else "more than") + f" {AUTO_IN_MEMORY_SHARE:.0%} of the "
               f"{available / 1e9:.3g} GB available") if available else \
            "auto: this machine's available memory is unknown"
    else:
        mode, why = choice, f"--eager {choice}"
    if not fits[mode]:
        models = " and its float32 twin" if dtype != "float32" else ""
        span = "one layer" if mode == STREAMED else "the largest stage"
        instead = "; check with --eager streamed (one layer at a time)" if mode == IN_MEMORY else ""
        raise UserError(f"--eager {mode}: {span} of the eager model{models} holds {need[mode] / 1e9:.3g} GB "
                        f"of weights and this machine has {available / 1e9:.3g} GB available{instead}")
    return EagerPlan(mode, why, streamed if mode == STREAMED else in_memory, need[STREAMED], need[IN_MEMORY])


# Per step, the outputs of every eager model (the reference first) of one span.
OnOutputs = Callable[[int, list[Arrays]], None]


class EagerSide:
    """The eager models of a check (the reference in `dtype`, and in half precision its float32 twin)
    over `spans`, run span after span over every step of a request: `run(feeds, choices, on_outputs)`.
    `model_for(dtype, span)` builds a span's model (default: build_model from `weights`); a rank's
    check builds its split model. The reference's names in the report: "eager", "eager-float32"."""

    def __init__(self, config: K3Config, dtype: str, weights: dict[str, Any], spans: list[range],
                 capacity: int, last_logits: bool, taps: bool, log: Callable[[str], None],
                 float32_twin: bool = True,
                 model_for: Callable[[str, range], K3ForCausalLM] | None = None) -> None:
        self.dtype, self.spans, self.log = dtype, spans, log
        self.capacity, self.last_logits, self.taps = capacity, last_logits, taps
        self.dtypes = eager_dtypes(dtype) if float32_twin else [dtype]
        self.model_for = model_for or (lambda d, span: build_model(config, getattr(torch, d), weights, span))
        self.names = ["eager" if d == dtype else f"eager-{d}" for d in self.dtypes]
        self.nonfinite_weights: list[str] = []  # the reference's weights that hold a NaN or an Inf
        self.flips = {name: [] for name in self.names}  # per step, own choices that differed from the held
        self.ran: list[tuple[range, int]] = []  # each span as it ran, with the bytes of weights it read
        self.seconds = 0.0
        self.peak_memory = 0  # the process's peak resident bytes while the side last ran (0: unknown)

    def _graph(self, model: K3ForCausalLM, span: range, manifest: dict[str, Any]) -> Any:
        graph = ExportGraph(model, span, self.last_logits, self.taps)
        return Float32Boundary(graph, Signature(manifest).inputs) if model.dtype == torch.bfloat16 else graph

    def _run_span(self, span: range, first: bool, feeds: list[Arrays],
                  choices: list[dict[int, np.ndarray]] | None, state: list[list[Arrays]],
                  on_outputs: OnOutputs) -> int:
        """One span over every step (see run); its weights and caches are gone when it returns. Returns
        the bytes of weights it read."""
        models = [self.model_for(d, span) for d in self.dtypes]
        # The model's own config: a rank's split model has its share of the heads (and caches).
        manifest = span_manifest(models[0].config, span, self.dtype, self.capacity, self.last_logits,
                                 self.taps)
        signature = Signature(carried(manifest))
        self.nonfinite_weights += nonfinite_tensors(models[0].named_parameters())
        with contextlib.ExitStack() as running:
            runners = [running.enter_context(EagerRunner(self._graph(m, span, manifest), name, signature))
                       for m, name in zip(models, self.names, strict=True)]
            for runner in runners:
                runner.reset(len(feeds[0]["input_lengths"]))
            for t, feed in enumerate(feeds):
                outs = []
                for i, (runner, model) in enumerate(zip(runners, models, strict=True)):
                    step_feed = {n: feed[n] for n in ("cache_lengths", "input_lengths", DRAFT_LENGTHS)
                                 if n in feed}
                    for spec in signature.feeds:
                        if spec.name not in step_feed:
                            step_feed[spec.name] = feed[spec.name] if first else state[i][t][spec.name]
                    held = [choices[t][layer] for layer in span if layer in choices[t]] if choices else []
                    with held_routing(model, held) if held else contextlib.nullcontext([]) as flipped:
                        # The float32 model takes the half-precision feeds, unlike its metadata says.
                        out = runner.infer(step_feed, check_inputs=False)
                    self.flips[runner.name][t] += sum(flipped)
                    state[i][t] = {n: a for n, a in out.items() if passed_on(n)}
                    outs.append(out)
                on_outputs(t, outs)
        return sum(weight_bytes(m, span, m.dtype) for m in models)

    def run(self, feeds: list[Arrays], choices: list[dict[int, np.ndarray]] | None,
            on_outputs: OnOutputs) -> list[list[Arrays]]:
        """Every span over every step: `feeds[t]` is step t's request (the first span's inputs and the
        lengths), `choices[t]` the expert choices the routers are held to at step t by layer (None:
        their own). Calls on_outputs(t, outputs of each model) per span and step. Returns per model
        and step what the last span passes on (the AttnRes state at its end, or the logits)."""
        steps, start = len(feeds), time.perf_counter()
        reset_peak_memory()
        self.flips = {name: [0] * steps for name in self.names}
        state = [[{} for _ in feeds] for _ in self.dtypes]  # per model and step: what the last span passed on
        for k, span in enumerate(self.spans):
            read = self._run_span(span, k == 0, feeds, choices, state, on_outputs)
            self.ran.append((span, read))
            elapsed = time.perf_counter() - start
            where = f"layer {span.start}" if len(span) == 1 else f"layers {span.start}..{span.stop - 1}"
            self.log(f"eager: {where} ({k + 1}/{len(self.spans)} spans) over "
                     f"{steps} steps, {read / 1e9:.2f} GB of weights; {elapsed:.1f} s so far, about "
                     f"{elapsed / (k + 1) * (len(self.spans) - k - 1):.0f} s left")
        self.seconds = time.perf_counter() - start
        self.peak_memory = peak_memory()
        return state

    def report(self) -> dict[str, Any]:
        """What ran (a report's "eager" entry, beside the plan): each span's layers and bytes of weights
        read, their sum, the seconds and the peak."""
        return {"ran": [{"layers": [s.start, s.stop], "bytes": n} for s, n in self.ran],
                "bytes_read": sum(n for _, n in self.ran), "seconds": self.seconds,
                "peak_memory": self.peak_memory}


def require_fits_disk(bytes_needed: int, folder: str, what: str) -> None:
    """Refuses (UserError, with the numbers) recordings that would not fit on `folder`'s disk."""
    import shutil

    free = shutil.disk_usage(folder).free
    if bytes_needed > free:
        raise UserError(f"{what}: the artifact's recorded outputs need about {bytes_needed / 1e9:.2f} GB on "
                        f"disk and {folder} has {free / 1e9:.2f} GB free; ask for fewer steps or a smaller "
                        "batch, or set TMPDIR to a larger disk")
