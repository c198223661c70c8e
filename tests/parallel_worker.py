"""One rank of tests/test_parallel.py's torchrun runs: the unsplit eager model and this rank's split
of it (k3export.model.parallel) on the same requests, written to OUT/rank-{r}.json for the test to judge.

    python -m torch.distributed.run --nproc-per-node N tests/parallel_worker.py CONFIG.json OUT

Records, per call (a ragged prefill, then two decode steps): the logits' relative error against the
unsplit model, and each KDA layer's state against the unsplit state's heads of this rank; per MoE
layer, the experts the router chose on every rank (all-gathered) and the sha256 of each expert held.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from k3export.config import K3Config
from k3export.exits import run_to_end
from k3export.model import K3ForCausalLM, KDACache
from k3export.model.parallel import split_model


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def expert_hashes(model: K3ForCausalLM) -> dict[str, str]:
    """'layer.expert' (the model's expert index) -> sha256 of its w1, w3, w2 bytes."""
    hashes = {}
    for i, layer in enumerate(model.model.layers):
        if layer.is_dense:
            continue
        experts = layer.block_sparse_moe.experts
        for e in range(experts.w1.shape[0]):
            digest = hashlib.sha256()
            for name in experts.PROJECTIONS:
                digest.update(getattr(experts, name)[e].detach().contiguous().numpy().tobytes())
            hashes[f"{i}.{experts.expert_offset + e}"] = digest.hexdigest()
    return hashes


@torch.no_grad()
def main(config_path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    config = K3Config.from_json(config_path)
    reference = K3ForCausalLM(config).eval()
    reference.init_weights(0)
    model = split_model(copy.deepcopy(reference), rank, ranks)

    choices: list[torch.Tensor] = []
    for layer in model.model.layers:
        if not layer.is_dense:
            layer.block_sparse_moe.gate.register_forward_hook(lambda _m, _i, out: choices.append(out[0]))

    gen = torch.Generator().manual_seed(1)
    B, T = 2, 5
    prompt = torch.randint(0, config.vocab_size, (B, T), generator=gen)
    steps = [(prompt, torch.tensor([T, 3]))]
    steps += [(torch.randint(0, config.vocab_size, (B, 1), generator=gen), torch.ones(B, dtype=torch.int64))
              for _ in range(2)]
    ours_cache, ref_cache = model.empty_cache(B, 16), reference.empty_cache(B, 16)
    logits_errors, state_errors = [], []
    heads = config.linear_attn_config.num_heads // ranks
    for ids, lengths in steps:
        ours, ours_cache = model(ids, ours_cache, lengths)
        expected, ref_cache = reference(ids, ref_cache, lengths)
        valid = torch.arange(ids.shape[1]) < lengths[:, None]
        logits_errors.append(rel_error(ours[valid], expected[valid]))
        state_errors.append(max(
            rel_error(mine.kda_state, full.kda_state[:, rank * heads:(rank + 1) * heads])
            for mine, full in zip(ours_cache.layers, ref_cache.layers, strict=True)
            if isinstance(mine, KDACache)))
    every_rank: list[list[list[int]]] = [[] for _ in range(ranks)]
    dist.all_gather_object(every_rank, [c.tolist() for c in choices])
    result = {"rank": rank, "ranks": ranks, "logits_errors": logits_errors, "state_errors": state_errors,
              "router_choices": every_rank, "expert_hashes": expert_hashes(model)}
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_to_end(lambda: main(*sys.argv[1:]))  # destroys the process group
