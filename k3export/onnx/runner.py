"""An export as something that runs: its signature, the stateful runner that every artifact's runner
builds on, and ONNX Runtime's runner, which `check` and the sharded runtime (`k3export run`) share.

A runner is a Polygraphy runner that holds its caches between calls, as a serving runtime does:
`reset(batch)` empties them (`reset(batch, rows)` starts only those rows fresh), then each
`infer(feeds)` takes one call's feeds (token ids or AttnRes tensors, and the lengths; never the
caches) and returns every output, present caches included. `StatefulRunner` does once what every
artifact shares: the caches' reset, the input metadata, refusing a request that does not fit the
cache, the rollback of rejected drafts (`Rollback`), the call's time, and carrying present caches over
to the next call's past. A runner only says how its caches are held (`empty_caches`) and how one call
runs (`call`):

    BoundOnnxrtRunner            here: ONNX Runtime through IO binding, the MLA cache written in place
    EagerRunner                  k3export.check.runners.eager: the PyTorch model
    NetworkRunner                k3export.check.runners.network: the parsed TensorRT network on CPU
    EngineRunner                 k3export.check.runners.engine: a TensorRT engine (GPU)
    ChainRunner                  k3export.check.runners.chain: a sharded build's stages in order
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from k3export.errors import UserError
from k3export.model.cache import check_request
from k3export.onnx.export import TensorSpec, resolve_shape
from k3export.onnx.taps import parse_tap

PAST, PRESENT = "past.", "present."
# A feed beside a graph's own, in speculative decoding's calls: each row's drafted tokens, the last of
# its input_lengths; the rows a runner keeps a copy of for a rollback (Rollback). Absent: none drafts.
DRAFT_LENGTHS = "draft_lengths"
# numpy has no bfloat16: such tensors cross it as float32, which holds every bfloat16 value exactly.
NUMPY_CARRIER = {torch.bfloat16: torch.float32}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a torch dtype name (export.json's)."""
    return torch.empty(0, dtype=getattr(torch, name)).numpy().dtype


def present_to_past(name: str) -> str:
    return PAST + name.removeprefix(PRESENT)


class Signature:
    """A graph's inputs and outputs as export.json lists them, split into what a caller feeds
    (tokens or AttnRes tensors, lengths) and the caches a runner carries from call to call."""

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.inputs = [TensorSpec(**s) for s in manifest["inputs"]]
        self.outputs = [TensorSpec(**s) for s in manifest["outputs"]]
        self.capacity: int = manifest["capacity"]
        self.feeds = [s for s in self.inputs if not s.name.startswith(PAST)]
        self.caches = [s for s in self.inputs if s.name.startswith(PAST)]
        # Taps (export --taps) are compared on their own, for localisation, not for the verdict.
        self.taps = [s for s in self.outputs if parse_tap(s.name)]
        self.compared = [s for s in self.outputs if not parse_tap(s.name)]

    def sizes(self, feed: dict[str, np.ndarray]) -> dict[str, int]:
        """batch, seq and capacity of a feed, read from the fed tensors' named dims."""
        sizes = {"capacity": self.capacity}
        for spec in self.feeds:
            for axis, dim in enumerate(spec.shape):
                if isinstance(dim, str):
                    sizes.setdefault(dim, np.shape(feed[spec.name])[axis])
        return sizes

    def check(self, feed: dict[str, np.ndarray]) -> None:
        """Refuses a request that does not fit the cache (UserError), before anything runs."""
        sizes = self.sizes(feed)
        check_request(torch.as_tensor(feed["cache_lengths"]), torch.as_tensor(feed["input_lengths"]),
                      sizes["seq"], self.capacity)

    def empty_caches(self, batch: int) -> dict[str, np.ndarray]:
        sizes = {"batch": batch, "capacity": self.capacity}
        return {s.name: np.zeros(resolve_shape(s, sizes), numpy_dtype(s.dtype)) for s in self.caches}

    def metadata(self) -> TensorMetadata:
        meta = TensorMetadata()
        for spec in self.feeds:
            shape = [None if isinstance(d, str) else d for d in spec.shape]
            meta.add(spec.name, numpy_dtype(spec.dtype), shape)
        return meta


# A row's call feeds at most 3K + 1 tokens (runtime.speculation's `Speculation.longest`): the verify
# profile's seq, and a row's cache holds its prompt, its new tokens and 3K more (the call's padding past its
# last token). Why 3K + 1: the rollback keeps the state before a call, so each rejected call's re-run re-
# feeds the tokens before it again with its own accepted ones and correction (1 + j + 1 after j < K
# accepted, then 3, 5, 7 ... when the re-runs are rejected too), and a cap cuts the drafts of a row rejected
# twice running. Tokens a call at K = 4 (tools/bench_speculate.py, exact over 2000 tokens a row; per-draft
# state slots give (1 - a^(K+1)) / (1 - a) = 1.94 / 2.77 / 4.10 at a = 0.5 / 0.7 / 0.9): at 2K + 1 1.80 /
# 2.56 / 3.96 (at a = 0.7 7.6% short), at 3K + 1 1.86 / 2.68 / 4.05 (3.4% short), uncapped 1.95 / 2.79 /
# 4.07.
CALL_TOKENS_PER_DRAFT = 3


@dataclass
class Rollback:
    """What a runner can go back to after a verify call (a call that also fed drafted tokens, some of
    which the caller may reject): each drafting row's caches as they were before that call, and each
    row's cache length before and after it. No message says what was accepted: the next call's
    cache_lengths does. A row fed the length it had after the call goes on; a drafting row fed the
    length it had before it is taken back to its state then (its caller feeds the accepted tokens again,
    with the next one: runtime.speculation). The MLA latent rows need nothing: a length hides the rows
    past it, and the next call writes over them. The KDA states and conv tails are copied before the
    call into buffers of the runner's own, which no graph or engine output is ever bound to (an engine
    writes a KDA state in place: the copy is taken before it does), and only the rows the call feeds
    drafts (its DRAFT_LENGTHS feed, runtime.speculation's): a prefill or a plain decode copies nothing,
    and a row just taken back keeps the copy it came from."""

    before: np.ndarray  # [batch] the last call's cache_lengths
    after: np.ndarray  # [batch] its cache_lengths + input_lengths
    kept: dict[str, Any] = field(default_factory=dict)  # per cache, its rows before the last call
    held: np.ndarray | None = None  # [batch] the rows of `kept` that hold that (the rows that drafted)
    copied_bytes: int = 0  # the bytes copied into `kept`, over every call (what a verify costs)

    def __post_init__(self) -> None:
        if self.held is None:
            self.held = np.zeros(len(self.before), bool)

    @classmethod
    def fresh(cls, batch: int) -> Rollback:
        return cls(np.zeros(batch, np.int64), np.zeros(batch, np.int64))

    def rewind(self, caches: dict[str, Any], cache_lengths: np.ndarray, name: str) -> np.ndarray:
        """Takes back to their kept state the drafting rows whose `cache_lengths` is the last call's,
        before that call; refuses a length that is neither, nor 0 (a fresh sequence), naming the row.
        Returns the rows taken back ([batch] bool)."""
        cache_lengths = np.asarray(cache_lengths)
        rewound = (cache_lengths == self.before) & (cache_lengths != self.after) & self.held
        lost = (cache_lengths != self.after) & (cache_lengths != 0) & ~rewound
        if lost.any():
            row = int(np.flatnonzero(lost)[0])
            reachable = f" or {self.before[row]}" if self.held[row] else ""
            raise UserError(f"{name}: row {row} comes with cache_lengths {cache_lengths[row]}, but its "
                            f"caches hold {self.after[row]} tokens; a row goes on from {self.after[row]}"
                            f"{reachable}, or starts fresh from 0 (a rollback goes back one call that fed "
                            "the row drafts)")
        rows = np.flatnonzero(rewound).tolist()
        if rows:
            for cache_name, kept in self.kept.items():
                caches[cache_name][rows] = kept[rows]
        return rewound

    def keep(self, caches: dict[str, Any], feeds: dict[str, np.ndarray], rewound: np.ndarray) -> None:
        """Before a call: its lengths, and a copy of the caches a rejection takes back for the rows it
        feeds drafts that were not just taken back (their kept rows are their state already)."""
        self.before = np.array(feeds["cache_lengths"], np.int64)
        self.after = self.before + np.asarray(feeds["input_lengths"])
        drafting = np.asarray(feeds.get(DRAFT_LENGTHS, np.zeros_like(self.before))) > 0
        rows = np.flatnonzero(drafting & ~rewound).tolist()
        if rows:
            for name, cache in caches.items():
                if name.endswith("mla_latent"):
                    continue
                if name not in self.kept or self.kept[name].shape != cache.shape:
                    self.kept[name] = np.empty_like(cache) if isinstance(cache, np.ndarray) else \
                        torch.empty_like(cache)
                self.kept[name][rows] = cache[rows]
                self.copied_bytes += len(rows) * cache[0].nbytes
        self.held = drafting


class StatefulRunner(BaseRunner):
    """The base of every runner: a graph of `signature` that holds its caches between calls.
    Subclasses give `call` (one call with `self.caches`, returning every output by name as numpy)
    and, if they hold caches other than as the signature's numpy arrays, `empty_caches`."""

    def __init__(self, signature: Signature, name: str) -> None:
        super().__init__(name=name)
        self.signature = signature
        self.caches: dict[str, Any] = {}
        self.seconds = 0.0  # in calls, over every call
        # After a call: did each output that aliases a past input keep that input's buffer (written in
        # place)? Only runners that bind outputs to inputs fill it.
        self.aliased: dict[str, bool] = {}
        self.rollback = Rollback.fresh(0)

    def empty_caches(self, batch: int) -> dict[str, Any]:
        """Zeroed caches for `batch` rows, as the signature's numpy arrays."""
        return self.signature.empty_caches(batch)

    def reset(self, batch: int, rows: list[int] | None = None) -> None:
        """Empty caches for `batch` rows, or only `rows` made fresh (the rest kept): their KDA states
        and conv tails zeroed (their latent rows need nothing: a cache length of 0 hides them)."""
        if rows is None:
            self.caches = self.empty_caches(batch)
            self.rollback = Rollback.fresh(batch)
            return
        for name, cache in self.caches.items():
            if not name.endswith("mla_latent"):
                cache[rows] = 0
        self.rollback.before[rows] = self.rollback.after[rows] = 0
        self.rollback.held[rows] = False

    def get_input_metadata_impl(self) -> TensorMetadata:
        return self.signature.metadata()

    def infer_impl(self, feed_dict: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        self.signature.check(feed_dict)
        if self.caches:  # a chain's or a grid's are its stages' and ranks', which roll back themselves
            rewound = self.rollback.rewind(self.caches, feed_dict["cache_lengths"], self.name)
            self.rollback.keep(self.caches, feed_dict, rewound)
        start = time.perf_counter()
        outputs = self.call(feed_dict)
        self.inference_time = time.perf_counter() - start
        self.seconds += self.inference_time
        return outputs

    def call(self, feeds: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        """One call with the runner's caches, which it leaves as the next call's past."""
        raise NotImplementedError

    def finish(self) -> None:
        """Called once after a request's last call, while the runner is active: a runner that compares
        something of its own after the calls (check's grid of ranks, its partial sums) does it here."""

    def keep_caches(self, outputs: dict[str, Any]) -> None:
        """The call's present caches become the next call's past ones."""
        for name, value in outputs.items():
            if name.startswith(PRESENT):
                self.caches[present_to_past(name)] = value


def session_options(path: Path, threads: int | None = None) -> ort.SessionOptions:
    """CPU session options for the graph at `path` or a graph made from it in memory (its weights read
    from beside `path`), with `threads` intra-op threads (None: ONNX Runtime's default)."""
    options = ort.SessionOptions()
    # Spinning worker threads would slow the eager model, or another stage, running beside them.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    if threads:
        options.intra_op_num_threads = threads
    return options


def onnxrt_session(path: Path, threads: int | None = None,
                   extra_outputs: list[str] | None = None) -> ort.InferenceSession:
    """A CPU session of the graph at `path`; `extra_outputs` names intermediate tensors to output too
    (the graph is then loaded from memory, its weights from beside `path`)."""
    options = session_options(path, threads)
    if not extra_outputs:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    model = onnx.load(path, load_external_data=False)
    outputs = {o.name for o in model.graph.output}  # export --routing-outputs: already there
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in extra_outputs
                              if name not in outputs)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


class BoundOnnxrtRunner(StatefulRunner):
    """ONNX Runtime through IO binding, holding its caches between calls in numpy buffers that
    OrtValues wrap without copying. A present output that `aliases` a past input (the MLA cache,
    written by TensorScatter) is bound to that input's OrtValue, so ONNX Runtime writes the call's
    rows in place and copies no cache. The other present outputs (KDA state and conv tails, which
    a Scan and a Concat rewrite whole) are double-buffered: written into a spare buffer that becomes
    the next call's past. Returned caches are those buffers, valid until the next call.
    `extra_outputs`: graph outputs beyond the signature's (a copy's exposed routing), returned too."""

    def __init__(self, path: Path, signature: Signature, name: str = "onnxrt", threads: int | None = None,
                 extra_outputs: list[str] | None = None):
        super().__init__(signature, name)
        self.path, self.threads = path, threads
        self.extra_outputs = extra_outputs or []
        self.spares: dict[str, np.ndarray] = {}
        self.collective_time = 0.0  # a whole graph sums nothing; runtime.segments' pieces do

    def activate_impl(self) -> None:
        self.session = onnxrt_session(self.path, self.threads, self.extra_outputs)

    def deactivate_impl(self) -> None:
        del self.session

    def reset(self, batch: int, rows: list[int] | None = None) -> None:
        super().reset(batch, rows)
        if rows is None:
            self.spares = {s.name: np.empty_like(self.caches[present_to_past(s.name)])
                           for s in self.signature.outputs if s.name.startswith(PRESENT) and not s.aliases}

    def call(self, feeds: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        into = {}  # the outputs written into cache buffers
        for spec in self.signature.outputs:
            if spec.aliases:
                into[spec.name] = self.caches[spec.aliases]
            elif spec.name in self.spares:
                into[spec.name] = self.spares[spec.name]
        values = {**feeds, **self.caches}
        outputs = self.run({s.name: values[s.name] for s in self.signature.inputs},
                           [*self.extra_outputs, *(s.name for s in self.signature.outputs)], into)
        for spec in self.signature.outputs:
            if spec.aliases:
                self.aliased[spec.name] = outputs[spec.name] is into[spec.name]
                outputs[spec.name] = self.caches[spec.aliases]
            elif spec.name in self.spares:
                past = present_to_past(spec.name)
                self.caches[past], self.spares[spec.name] = self.spares[spec.name], self.caches[past]
                outputs[spec.name] = self.caches[past]
        return outputs

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str],
            into: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        """One run of the graph (`run_bound`); a runner of the same graph in pieces runs them here."""
        return run_bound(self.session, feeds, outputs, into)


def run_bound(session: ort.InferenceSession, feeds: dict[str, np.ndarray], outputs: list[str],
              into: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    """One run of `session` through IO binding: the feeds wrapped, not copied; each output named in
    `into` written into that buffer (one that is also a feed's buffer is written in place). Returns
    `outputs` by name; a bound one is its buffer itself when ONNX Runtime wrote it there."""
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array)))
    for name in outputs:
        if name in into:
            binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(into[name]))
        else:
            binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    results = OrderedDict()
    for name, value in zip(outputs, binding.get_outputs(), strict=True):
        buffer = into.get(name)
        kept = buffer is not None and value.data_ptr() == buffer.ctypes.data
        results[name] = buffer if kept else value.numpy()
    return results
