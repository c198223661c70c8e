"""`k3export check --network DIR`: the TensorRT network the builder receives, evaluated on CPU
(k3export.engine.network), against the eager model through check's driver."""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from polygraphy.logger import G_LOGGER

from k3export.check.driver import compare_with_eager, planned
from k3export.engine.network import NetworkEvaluator, ParsedNetwork, parse_network, to_numpy
from k3export.onnx.export import GRAPH_FILE
from k3export.onnx.runner import Signature, StatefulRunner
from k3export.options import AUTO


class NetworkRunner(StatefulRunner):
    """The parsed network evaluated on CPU, holding its caches as torch tensors (in the network's own
    dtypes once written). `signature` may declare bfloat16 tensors float32 (check's `carried`): they
    cross numpy as float32 and are cast to the network's dtypes."""

    def __init__(self, net: ParsedNetwork, signature: Signature, name: str = "network",
                 extra_outputs: list[str] | None = None) -> None:
        super().__init__(signature, name)
        self.evaluator = NetworkEvaluator(net, extra_outputs)

    def deactivate_impl(self) -> None:
        """The driver leaves the runner once every step is recorded: the caches and the network's
        weights (the parser's, and the evaluator's copies) go then, before the eager side runs."""
        self.caches = {}
        self.layer_seconds = self.evaluator.layer_seconds
        self.evaluator.net.close()
        del self.evaluator

    def empty_caches(self, batch: int) -> dict[str, torch.Tensor]:
        return {name: torch.from_numpy(a) for name, a in self.signature.empty_caches(batch).items()}

    def call(self, feeds: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        with torch.no_grad():
            outputs = self.evaluator.evaluate({**feeds, **self.caches})
        self.keep_caches(outputs)
        return OrderedDict((name, to_numpy(value)) for name, value in outputs.items())


def run_network_check(export_dir: str | Path, steps: int = 4, seed: int = 0, batch: int = 2,
                      prompt_len: int = 70, log: Any = print,
                      net: ParsedNetwork | None = None, taps: bool = False,
                      kernels: bool = False, eager: str = AUTO, speculate: int = 0) -> dict[str, Any]:
    """The parsed network against the eager model through check's one driver (the same requests,
    bounds, held routing and verdict as `check --onnx`). Returns the report (see "passed"). `net`:
    an already parsed network (tests alter one after parsing). `taps`: also compare the export's
    taps and name the first divergent layer (report["taps"]). `kernels`: plugin layers launch their
    Triton kernels (TRITON_INTERPRET=1 must be set before triton is first imported; the cli does it)
    instead of the reference ops. `eager`: how the eager side runs (check.runners.eager.plan_eager).
    `speculate` K: speculative decoding's requests (k3export.check.speculative)."""
    export_dir = Path(export_dir)
    G_LOGGER.module_severity = G_LOGGER.WARNING
    manifest, config, lengths = planned(export_dir, taps, batch, prompt_len, steps)
    start = time.perf_counter()
    net = net or parse_network(export_dir / GRAPH_FILE)
    net.kernels = kernels
    layers = net.network.num_layers
    log(f"network: {layers} layers parsed by TensorRT-RTX, evaluated on CPU")
    report, runner = compare_with_eager(
        manifest, config, export_dir / GRAPH_FILE,
        lambda signature, extra: NetworkRunner(net, signature, extra_outputs=extra),
        steps, seed, lengths, log, taps, eager=eager, speculate=speculate)
    report["network"] = {"layers": layers, "seconds": runner.seconds,
                         "seconds_by_layer_type": runner.layer_seconds,
                         "plugins": "triton kernels" if net.kernels else "reference ops",
                         "kernel_launches": net.kernel_launches}
    report["seconds"] = time.perf_counter() - start
    return report
