"""Holding the router's expert choices fixed across backends, for half-precision checks.

With random weights the sigmoid router has near-ties, and two backends that round differently in
half precision pick different experts for a few tokens; one flipped choice changes that token's
output discretely and spreads through the caches, so the comparison measures chaos, not rounding
(a float16 check once saw relative error 0.81 from flips alone). A half-precision check therefore
reads the graph's own choices (each MoE layer's `experts` tensor, the input of its
`k3.RoutedExpertsGroup` node, or of `k3.RoutedExperts` in earlier exports, made an extra output of the
session) and makes the eager models take them: both sides then follow one
discrete path, the error is rounding alone, and the flips are counted and reported, not hidden.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import Tensor, nn

from k3export.model.moe import Router
from k3export.onnx.domain import DOMAIN, ROUTED_OPS


def routing_outputs(graph: Path) -> list[str]:
    """The tensors holding each MoE layer's chosen experts (the `experts` input of each layer's
    routed-experts node, domain.ROUTED_OPS), in graph (= layer) order; a runner can add them to the graph's
    outputs."""
    model = onnx.load(graph, load_external_data=False)
    return [node.input[ROUTED_OPS[node.op_type]] for node in model.graph.node
            if node.domain == DOMAIN and node.op_type in ROUTED_OPS]


@contextlib.contextmanager
def held_routing(model: nn.Module, choices: list[np.ndarray]) -> Iterator[list[int]]:
    """Within the block, the model's routers take `choices` (one [tokens, k] array per MoE layer,
    in call order) instead of choosing. Yields a list that receives, per router call, the number of
    tokens whose own choice (as a set of experts) differed from the one held."""
    queue, flips = list(choices), []

    def choose(router: Router, scores: Tensor) -> Tensor:
        own = Router.choose(router, scores)
        held = torch.from_numpy(np.asarray(queue.pop(0))).to(own.device).reshape(own.shape)
        flips.append(int((own.sort(-1).values != held.sort(-1).values).any(-1).sum()))
        return held

    routers = [m for m in model.modules() if isinstance(m, Router)]
    for router in routers:
        router.choose = functools.partial(choose, router)
    try:
        yield flips
    finally:
        for router in routers:
            del router.choose
    if queue:
        raise RuntimeError(f"{len(queue)} routing choices were not used: the graph and the model disagree "
                           "on the MoE layers")
