"""`k3export check --build DIR` on a tensor/expert-parallel build (`[parallel] ranks = N`): the grid of
stages x ranks against the UNSPLIT eager model, and the first divergent stage and rank.

Check starts the ranks itself: one worker process per (stage, rank) (multiprocessing's forkserver,
this module preloaded), each stage's N workers in a gloo process group of their own. Each worker
holds its rank's graph as ONNX Runtime pieces cut at its DistCollective nodes (the runtime's
k3export.runtime.segments.SegmentedGraph, the sums done by gloo) with its caches. The check process
drives them over pipes stage by stage, as ChainRunner drives a chain: the N workers of stage s get
the same feeds, stage s + 1 gets what stage s returned. `GridRunner` is one more runner of check's
driver (compare_with_eager) and returns the unsplit chain's outputs by the unsplit names: logits,
boundaries and the MLA latent from rank 0 (every rank computes them; the others must be equal, or
the check fails), each KDA state and conv tail put together from the ranks' heads. The eager side
is the unsplit eager model over the same layers, so the verdict says "the grid computes the unsplit model".

Naming the rank: an error on one rank is summed into every rank's result by the all-reduce, so the
outputs cannot say which rank is wrong. Each worker records, at every step, its graph's feeds,
partial sums (the inputs of its sums) and expert choices; once the request is done
(GridRunner.finish) it runs its rank's eager split model (k3export.model.parallel.split_model, over
the same gloo group) one layer at a time over the recorded steps (k3export.check.runners.eager.
EagerSide: each layer's part read or drawn when its turn comes), with caches of its own, and
compares the partial sums with the split model's, in graph order. Each stage's references are fed
the grid's own inputs to that stage, so a stage is judged alone: the first divergent stage and rank
is, in the first stage with a partial out of bound, the rank whose partial leaves the bound first
(step, then collective; export.json's
"parallel" names its layer and whether it follows the attention or the FFN).

Checking outputs (`build RECIPE --routing-outputs`): each rank's graph also outputs its expert
choices (routing.{layer}) and its partial sums (partial.{n}), as a rank's engine must to be checked.
The partials are then read from those outputs, else from the pieces' sums. In half precision (float16:
ONNX Runtime has no bfloat16 MatMul) each worker holds its split eager model's routers to its graph's
choices (k3export.check.routing), and the driver holds the unsplit eager chain to rank 0's: the router
is replicated and reads the summed (bit for bit equal) input on every rank, so every rank chooses the
same experts; a rank whose choices differ from rank 0's fails the check as any replicated output does.
Half precision needs the checking outputs: a rank's graph runs in pieces, which output only the
graph's outputs.

Engines (`check --build --runner engine`, the default on a build with engines): each worker runs its
rank's engine on a GPU of its own (`rank_engine`, GPU only: an NCCL group of the stage's workers, its
communicator handed to the engine, whose DIST_COLLECTIVE layers sum over it) in place of the pieces;
the engine's partial sums and expert choices are its checking outputs, which it then must have.

Workers never hang the check: a worker that dies, fails or stays silent past WORKER_TIMEOUT_S is
a UserError naming its stage and rank, and every worker is stopped when the runner deactivates
(on errors and Ctrl-C too).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import signal
import tempfile
import time
import traceback
from collections import OrderedDict
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from k3export.check.compare import TOLERANCES, compare, half_precision_tolerance
from k3export.check.driver import read_export
from k3export.check.runners.eager import EagerSide
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.exits import end_process
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE, graph_signature
from k3export.onnx.runner import DRAFT_LENGTHS, Signature, StatefulRunner
from k3export.ops.collectives import recording_partials
from k3export.runtime.engines import EnginePlace
from k3export.runtime.segments import SegmentedRunner
from k3export.weights.checkpoint import build_model

WORKER_TIMEOUT_S = 600.0  # the longest a worker may take to load or to answer one call
POLL_S = 0.2  # how often a silent worker is looked at (a dead one is named within this)
STOP_S = 2.0  # how long the workers may take to stop before they are terminated
READY, OK, FAILED, STOP = "ready", "ok", "failed", "stop"


def stage_output(stage: int, tensor: str) -> str:
    """A stage's own output among a chain's (its routing choices: tensor names repeat across stages)."""
    return f"stage{stage}:{tensor}"


def held_routing_names(manifest: dict[str, Any]) -> list[str]:
    """The routing outputs (routing.{layer}) a check of an export holds the eager routers to: none in
    float32, where rounding flips no choice that the bound does not cover."""
    return [s["name"] for s in manifest.get("routing_outputs", [])] if manifest["dtype"] != "float32" else []


def unsplit_manifest(manifest: dict[str, Any], config: K3Config) -> dict[str, Any]:
    """A rank's export.json with its stage's unsplit inputs and outputs, what the stage's ranks
    compute together (config.json is the unsplit model's; the rank's caches have its heads only)."""
    inputs, outputs = graph_signature(config, range(*manifest["layers"]), getattr(torch, manifest["dtype"]),
                                      manifest.get("last_logits", False), "taps" in manifest)
    return {**manifest, "inputs": [asdict(s) for s in inputs], "outputs": [asdict(s) for s in outputs]}


def grid_stages(folders: list[list[Path]]) -> list[tuple[dict[str, Any], K3Config]]:
    """Each stage's unsplit export.json (unsplit_manifest of its rank 0) and config, from the rank
    folders of a build that k3export.runtime.stage_ranks has checked (each folder there, that
    rank's, its files the build's)."""
    stages = []
    for ranks in folders:
        manifest, config = read_export(ranks[0])
        stages.append((unsplit_manifest(manifest, config), config))
    return stages


def verified_export(folder: Path) -> tuple[dict[str, Any], K3Config]:
    """export.json and config.json of a rank folder whose files stage_ranks has verified (a rank's
    weights are read once to verify them, not once more in each process that loads them)."""
    return json.loads((folder / MANIFEST_FILE).read_text()), K3Config.from_json(folder / "config.json")


def valid_tokens(partial: np.ndarray, input_lengths: np.ndarray) -> np.ndarray:
    """The valid tokens' rows of a per-token tensor ([batch, seq, width] or [batch * seq, width])."""
    rows = partial.reshape(len(input_lengths), -1, partial.shape[-1])
    return np.concatenate([rows[b, :n] for b, n in enumerate(input_lengths)])


class RankWorker:
    """In a worker process: a rank's graph with its caches, and after the request its eager split model
    one layer at a time (k3export.check.runners.eager.EagerSide over split_model, each layer's part
    read when its turn comes). `call` runs the graph and records the step's feeds, the graph's partial
    sums (its outputs partial.{n} where it has them, else kept from its pieces' sums) and expert
    choices; `compare` then runs the split model over every recorded step, fed the graph's own
    inputs, and compares its partial sums with the graph's. Half precision, as the driver for the
    whole model: the split model's routers take the graph's choices (routing.{layer}), and the split
    model in float32 (held to them too) sets each step's bound, twice the half-vs-float32 spread of
    its partial sums (half_precision_tolerance)."""

    def __init__(self, folder: Path, rank: int, ranks: int, engine: EnginePlace | None = None) -> None:
        manifest, config = verified_export(folder)
        self.manifest, self.config, self.rank, self.ranks = manifest, config, rank, ranks
        self.collectives = manifest["parallel"]["collectives"]
        self.tolerance = TOLERANCES[manifest["dtype"]]
        self.partial_outputs = [s["name"] for s in manifest.get("partial_outputs", [])]
        self.partials_read_from = "graph outputs" if self.partial_outputs else "segments"
        self.routing = held_routing_names(manifest)
        moe = [i for i in range(*manifest["layers"]) if not config.is_dense(i)]
        self.routed_layers = dict(zip(self.routing, moe, strict=True)) if self.routing else {}
        self.graph = rank_engine(folder, engine) if engine else SegmentedRunner(
            folder / GRAPH_FILE, Signature(manifest), None, "grid rank", threads=1,
            keep_partials=not self.partial_outputs)
        self.graph.activate()
        self.steps: list[tuple[dict[str, np.ndarray], list[np.ndarray], dict[int, np.ndarray]]] = []

    def reset(self, batch: int, rows: list[int] | None) -> None:
        self.graph.reset(batch, rows)
        if rows is None:
            self.steps = []

    def close(self) -> None:
        self.graph.deactivate()

    def call(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph's outputs (its routing ones included, its partial sums not); the step recorded."""
        outputs = self.graph.infer(feeds, check_inputs=False)
        actual = [outputs.pop(name) for name in self.partial_outputs] or self.graph.graph.partials
        lengths = feeds["input_lengths"]
        self.steps.append(({n: np.copy(a) for n, a in feeds.items()},
                           [valid_tokens(p, lengths) for p in actual],
                           {layer: np.copy(outputs[name]) for name, layer in self.routed_layers.items()}))
        return dict(outputs)

    def compare(self) -> list[list[dict[str, Any]]]:
        """Per recorded step, each of the graph's partial sums compared with the eager split model's
        (valid tokens only), in graph order."""
        manifest, config = self.manifest, self.config
        layers = range(*manifest["layers"])
        counts = {len(partials) for _, partials, _ in self.steps}
        eager: list[list[list[np.ndarray]]] = [[] for _ in self.steps]  # per step, per model: its sums

        def model_for(dtype: str, span: range) -> torch.nn.Module:
            return build_model(config, getattr(torch, dtype), manifest["weights"], span, rank=self.rank,
                               ranks=self.ranks)

        side = EagerSide(config, manifest["dtype"], manifest["weights"], [range(i, i + 1) for i in layers],
                         manifest["capacity"], manifest.get("last_logits", False), "taps" in manifest,
                         lambda _: None, model_for=model_for)
        with recording_partials() as recorded:
            def on_outputs(t: int, outs: list[dict[str, np.ndarray]]) -> None:
                """The span's sums at step t, each model's in turn (the same count each)."""
                sums = [valid_tokens(p.numpy(), self.steps[t][0]["input_lengths"]) for p in recorded]
                recorded.clear()
                if not eager[t]:
                    eager[t] = [[] for _ in outs]
                for i, mine in enumerate(eager[t]):
                    mine += sums[i * len(sums) // len(outs):(i + 1) * len(sums) // len(outs)]

            side.run([feeds for feeds, _, _ in self.steps],
                     [choices for _, _, choices in self.steps] if self.routing else None, on_outputs)
        if counts != {len(eager[0][0])}:
            raise UserError(f"the graph sums {counts.pop()} times, the eager split model {len(eager[0][0])} "
                            "times: the rank's graph is not its split model's")
        return [self._compared(actual, sums) for (_, actual, _), sums in zip(self.steps, eager, strict=True)]

    def _compared(self, actual: list[np.ndarray], eager: list[list[np.ndarray]]) -> list[dict[str, Any]]:
        """One step's partial sums against the eager split model's (and its float32 twin's spread)."""
        tolerance = self.tolerance
        if len(eager) > 1:
            spread = max(compare("", half, full, tolerance).rel for half, full in zip(*eager, strict=True))
            tolerance = half_precision_tolerance(tolerance, spread, 0.0)
        partials = []
        for k, (where, mine, reference) in enumerate(zip(self.collectives, actual, eager[0], strict=True)):
            comparison = compare(f"layer {where['layer']} {where['after']}", mine, reference, tolerance)
            partials.append({"collective": k, "layer": where["layer"], "after": where["after"],
                             "rel": comparison.rel, "bound": comparison.bound, "passed": comparison.passed})
        return partials


def rank_engine(folder: Path, engine: EnginePlace) -> StatefulRunner:  # GPU only
    """The rank's engine on its GPU, summing through an NCCL communicator of the stage's ranks (every
    worker of this process group makes the group and hands its communicator over, collectively)."""
    from k3export.engine.runner import EngineRunner
    from k3export.runtime.nccl import communicator_capsule

    torch.cuda.set_device(engine.device)
    return EngineRunner(engine.path, folder, name="grid rank", device=engine.device,
                        communicator=communicator_capsule(dist.new_group(backend="nccl")))


def serve(conn: Connection, folder: Path, rank: int, ranks: int, init_file: str,
          engine: EnginePlace | None = None) -> NoReturn:
    """A worker process's life: rank `rank` of a stage of `ranks` (gloo, rendezvous in `init_file`),
    its graph's pieces or its `engine`, answering (method, *arguments) messages from the check process
    until STOP; then the process ends (end_process)."""
    # Ctrl-C is the check process's: it stops every worker (a worker stopped alone would leave its
    # partners waiting in a sum).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.set_num_threads(1)  # every worker shares the machine's cores
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks,
                                timeout=timedelta(seconds=WORKER_TIMEOUT_S))
        worker = RankWorker(folder, rank, ranks, engine)
        conn.send((READY, worker.partials_read_from))
        while (message := conn.recv())[0] != STOP:
            conn.send((OK, getattr(worker, message[0])(*message[1:])))
        worker.close()
    except (EOFError, BrokenPipeError):
        pass  # the check process is gone (killed): nothing to answer
    except UserError as e:
        conn.send((FAILED, str(e)))
    except Exception:
        conn.send((FAILED, traceback.format_exc()))
    end_process(0)  # every answer is sent; the group destroyed, and no teardown to race gloo's threads


@dataclass
class Worker:
    stage: int
    rank: int
    process: multiprocessing.Process
    conn: Connection

    def ask(self, message: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):  # it died: answer() says so
            self.conn.send(message)

    def answer(self) -> Any:
        """The worker's answer to its last message; a UserError naming its stage and rank if it
        failed, died or stayed silent past WORKER_TIMEOUT_S."""
        where = f"check --build: stage {self.stage} rank {self.rank}"
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while not self.conn.poll(POLL_S):
            if not self.process.is_alive():
                break
            if time.monotonic() > deadline:
                raise UserError(f"{where}: no answer within {WORKER_TIMEOUT_S:.0f} s")
        try:
            status, value = self.conn.recv()
        except (EOFError, ConnectionResetError):  # a killed worker's pipe: closed, or reset mid-message
            self.process.join(POLL_S)
            raise UserError(f"{where}: its process died (exit code {self.process.exitcode})") from None
        if status == FAILED:
            raise UserError(f"{where}: {value}")
        return value


class GridRunner(StatefulRunner):
    """The grid's workers as one check runner: it takes the request's feeds and returns the unsplit
    chain's outputs in `signature`'s order, then rank 0's routing choices `routing[stage]` (routing
    outputs of the stage's graphs) as stage_output(stage, name). `folders`: per stage its ranks'
    folders (verified); `stage_manifests`: per stage its unsplit export.json (grid_stages'). After each
    call, `partials[stage][rank]` holds that rank's partial sums compared with its eager split model's,
    and `disagreements` each replicated output (routing choices too) in which a rank differs from rank
    0 ({"stage", "rank", "output", "max_abs"}). `partials_read_from`: where the workers read their
    partial sums ("graph outputs", "segments": one each, both for a build that mixes them)."""

    def __init__(self, folders: list[list[Path]], stage_manifests: list[dict[str, Any]],
                 signature: Signature, routing: list[list[str]] | None = None,
                 engines: list[list[EnginePlace]] | None = None, numbers: list[int] | None = None) -> None:
        super().__init__(signature, "grid")
        self.folders, self.engines = folders, engines
        self.numbers = numbers or list(range(len(folders)))  # the stages' indices in the build
        self.routing = routing or [[] for _ in folders]
        self.unsplit = [Signature(m) for m in stage_manifests]
        self.split = [Signature(verified_export(ranks[0])[0]) for ranks in folders]
        self.workers: list[list[Worker]] = []
        self.disagreements: list[list[dict[str, Any]]] = []  # per call since the reset
        self.entries: list[list[dict[str, Any]]] = []  # per call since the reset, once finished

    def activate_impl(self) -> None:
        context = multiprocessing.get_context("forkserver")  # not fork: torch and ONNX Runtime ran here
        # torch._dynamo too: build_model's meta-device init imports it, once here, not in every worker.
        context.set_forkserver_preload([__name__, "torch._dynamo"])
        self.rendezvous = tempfile.TemporaryDirectory(prefix="k3export-grid-")
        try:
            for s, ranks in enumerate(self.folders):
                self.workers.append([])
                for r, folder in enumerate(ranks):
                    ours, theirs = context.Pipe()
                    rendezvous = f"{self.rendezvous.name}/stage-{s}"
                    engine = self.engines[s][r] if self.engines else None
                    process = context.Process(target=serve, args=(theirs, folder, r, len(ranks), rendezvous,
                                                                   engine),
                                              name=f"k3export check stage {s} rank {r}", daemon=True)
                    process.start()
                    theirs.close()
                    self.workers[-1].append(Worker(self.numbers[s], r, process, ours))
            # READY, with where the worker reads its partial sums.
            self.partials_read_from = sorted({w.answer() for ranks in self.workers for w in ranks})
        except BaseException:
            self.deactivate_impl()
            raise

    def deactivate_impl(self) -> None:
        every = [w for ranks in self.workers for w in ranks]
        for worker in every:
            worker.ask((STOP,))
        deadline = time.monotonic() + STOP_S  # one wait for all: a worker stuck in a sum never stops
        for worker in every:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join()
            worker.conn.close()
        self.workers = []
        self.rendezvous.cleanup()

    def _ask(self, *message: Any, stage: int | None = None) -> list[Any]:
        """Sends `message` to every worker of `stage` (None: every worker), all before any answers,
        and returns their answers in order."""
        workers = [w for s, ranks in enumerate(self.workers) if stage in (None, s) for w in ranks]
        for worker in workers:
            worker.ask(message)
        return [worker.answer() for worker in workers]

    def reset(self, batch: int, rows: list[int] | None = None) -> None:
        self._ask("reset", batch, rows)
        if rows is None:
            self.disagreements, self.entries = [], []

    def call(self, feeds: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        produced = dict(feeds)
        self.disagreements.append([])
        for s, (unsplit, split) in enumerate(zip(self.unsplit, self.split, strict=True)):
            feed = {spec.name: produced[spec.name] for spec in split.feeds}
            if DRAFT_LENGTHS in feeds:  # the ranks' rollback reads it
                feed[DRAFT_LENGTHS] = feeds[DRAFT_LENGTHS]
            outputs = self._ask("call", feed, stage=s)
            produced.update(self._unsplit_outputs(s, unsplit, split, outputs))
            produced.update({stage_output(s, name): outputs[0][name] for name in self.routing[s]})
        names = [spec.name for spec in self.signature.outputs]
        names += [stage_output(s, name) for s, stage in enumerate(self.routing) for name in stage]
        return OrderedDict((name, produced[name]) for name in names)

    def finish(self) -> None:
        """Every worker compares its rank's partial sums over the recorded steps (RankWorker.compare),
        all at once (the split models sum together); `entries` then holds each step's rank_entries."""
        answers = self._ask("compare")
        partials = [[[answers[s * len(self.workers[0]) + r][t] for r in range(len(ranks))]
                     for s, ranks in enumerate(self.workers)] for t in range(len(self.disagreements))]
        self.entries = [rank_entries(self.numbers, step, disagreements)
                        for step, disagreements in zip(partials, self.disagreements, strict=True)]

    def _unsplit_outputs(self, stage: int, unsplit: Signature, split: Signature,
                         outputs: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """A stage's outputs by the unsplit names: a rank-split tensor concatenated in rank order along
        the axis where the rank's shape differs from the unsplit one; a replicated one rank 0's."""
        whole, replicated = {}, list(self.routing[stage])
        for spec, part in zip(unsplit.outputs, split.outputs, strict=True):
            axes = [axis for axis, (a, b) in enumerate(zip(spec.shape, part.shape, strict=True)) if a != b]
            if axes:
                whole[spec.name] = np.concatenate([ranks[spec.name] for ranks in outputs], axis=axes[0])
            else:
                replicated.append(spec.name)
        for name in replicated:
            arrays = [ranks[name] for ranks in outputs]
            whole[name] = arrays[0]
            # Every rank computes it from the same summed tensors: it must be rank 0's, bit for bit.
            self.disagreements[-1] += [{"stage": self.numbers[stage], "rank": r, "output": name,
                                    "max_abs": float(np.abs(a.astype(np.float64) - arrays[0]).max())}
                                   for r, a in enumerate(arrays) if not np.array_equal(a, arrays[0])]
        return whole


def rank_entries(numbers: list[int], partials: list[list[list[dict[str, Any]]]],
                 disagreements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One step's per (stage, rank) entries: whether all its partial sums (partials[stage][rank]) are
    within the bound and its replicated outputs are rank 0's, its worst partial (relative to its
    bound), the first one out of bound and the replicated outputs that differ from rank 0's
    (`disagreements`: the step's, by stage number)."""
    entries = []
    for s, ranks in zip(numbers, partials, strict=True):
        for r, mine in enumerate(ranks):
            differs = [d["output"] for d in disagreements if (d["stage"], d["rank"]) == (s, r)]
            failed = [p for p in mine if not p["passed"]]
            entries.append({"stage": s, "rank": r, "passed": not failed and not differs,
                            "worst": max(mine, key=lambda p: p["rel"] / max(p["bound"], 1e-30)),
                            "first_failed": failed[0] if failed else None, "differs_from_rank_0": differs})
    return entries


def first_divergent_rank(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """In the first stage with a partial sum out of bound, the rank whose partial leaves it first
    (step, then collective; the worst of ranks failing at the same one), or a rank whose replicated
    outputs differ from rank 0's: {"stage", "rank", "step", "layer", "after", "rel", "bound"}."""
    candidates = []
    for i, step in enumerate(steps):
        for entry in step["ranks"]:
            partial = entry["first_failed"]
            if partial:
                worse = -partial["rel"] / max(partial["bound"], 1e-30)
                key = (entry["stage"], i, partial["collective"], worse)
                candidates.append((key, {"stage": entry["stage"], "rank": entry["rank"], "step": step["step"],
                                         **{k: partial[k] for k in ("layer", "after", "rel", "bound")}}))
            elif entry["differs_from_rank_0"]:
                key = (entry["stage"], i, float("inf"), 0.0)
                candidates.append((key, {"stage": entry["stage"], "rank": entry["rank"], "step": step["step"],
                                         "differs_from_rank_0": entry["differs_from_rank_0"]}))
    return min(candidates, key=lambda c: c[0])[1] if candidates else None


def rank_lines(report: dict[str, Any]) -> list[str]:
    """For the terminal: each (stage, rank)'s worst partial sum over the steps, and the first
    divergent stage and rank."""
    lines = []
    for entry in report["steps"][0]["ranks"]:
        s, r = entry["stage"], entry["rank"]
        mine = [e for step in report["steps"] for e in step["ranks"] if (e["stage"], e["rank"]) == (s, r)]
        worst = max((e["worst"] for e in mine), key=lambda p: p["rel"] / max(p["bound"], 1e-30))
        differs = sorted({name for e in mine for name in e["differs_from_rank_0"]})
        lines.append(f"stage {s} rank {r}: worst partial sum layer {worst['layer']} {worst['after']} rel "
                     f"{worst['rel']:.2e} (bound {worst['bound']:.1e})"
                     + (f"; differs from rank 0 in {', '.join(differs)}" if differs else ""))
    first = report["first_divergent_rank"]
    if first is None:
        lines.append("first divergent stage and rank: none (every rank's partial sums within the bound, "
                     "replicated outputs equal to rank 0's)")
    elif "differs_from_rank_0" in first:
        lines.append(f"first divergent stage and rank: stage {first['stage']} rank {first['rank']} at "
                     f"{first['step']}: {', '.join(first['differs_from_rank_0'])} differ from rank 0's")
    else:
        lines.append(f"first divergent stage and rank: stage {first['stage']} rank {first['rank']} (layer "
                     f"{first['layer']} {first['after']}) at {first['step']}: partial sum rel "
                     f"{first['rel']:.2e} > bound {first['bound']:.1e}")
    return lines
