"""Tensor and expert parallelism (k3export.model.parallel): the eager split under torchrun against the
unsplit eager model (k3-tiny over 2 ranks; a 4-head variant over 4), expert ownership, router
agreement, N = 1 as the plain model, and the refusals."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from launch import succeeded, torchrun

from k3export.config import K3Config
from k3export.errors import UserError
from k3export.model import K3ForCausalLM
from k3export.model.parallel import check_split, split_model

WORKER = Path(__file__).with_name("parallel_worker.py")


def four_head_config() -> K3Config:
    """k3-tiny with 4 KDA and 4 MLA heads (k3-tiny has 2), so that 4 ranks hold one head each."""
    data = K3Config.from_preset("k3-tiny").to_dict()
    data["num_attention_heads"] = 4
    data["linear_attn_config"]["num_heads"] = 4
    return K3Config.from_dict(data)


def run_ranks(config: K3Config, ranks: int, folder: Path) -> list[dict]:
    """tests/parallel_worker.py under torchrun (gloo on 127.0.0.1): each rank's record."""
    folder.mkdir(parents=True)
    config.to_json(folder / "config.json")
    succeeded(torchrun(ranks, str(WORKER), str(folder / "config.json"), str(folder), timeout=240))
    return [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module", params=[("k3-tiny", 2), ("four-heads", 4)], ids=["tiny-N2", "4heads-N4"])
def split_run(request, tmp_path_factory) -> tuple[K3Config, list[dict]]:
    name, ranks = request.param
    config = K3Config.from_preset(name) if name == "k3-tiny" else four_head_config()
    return config, run_ranks(config, ranks, tmp_path_factory.mktemp("parallel") / name)


def test_split_ranks_equal_the_unsplit_model(split_run) -> None:
    """Prefill then two decode steps: every rank's logits are the unsplit model's, and its KDA state
    is the unsplit state's heads of that rank (float32, relative error)."""
    _, records = split_run
    for record in records:
        assert len(record["logits_errors"]) == 3
        assert max(record["logits_errors"]) <= 1e-5, record
        assert max(record["state_errors"]) <= 1e-5, record


def test_every_rank_routes_tokens_to_the_same_experts(split_run) -> None:
    config, records = split_run
    for record in records:
        choices = record["router_choices"]
        assert len(choices) == len(records)
        moe_layers = config.num_hidden_layers - config.first_k_dense_replace
        assert len(choices[0]) == 3 * moe_layers  # three calls per MoE layer
        assert all(c == choices[0] for c in choices)


def test_experts_are_disjoint_and_complete_across_ranks(split_run) -> None:
    """Each expert is held whole by exactly one rank, the one holding [rE/N, (r+1)E/N)."""
    config, records = split_run
    sys.path.insert(0, str(WORKER.parent))
    from parallel_worker import expert_hashes

    unsplit = K3ForCausalLM(config).eval()
    unsplit.init_weights(0)
    expected = expert_hashes(unsplit)
    held = [r["expert_hashes"] for r in records]
    assert sum(len(h) for h in held) == len(expected)
    assert {k: v for h in held for k, v in h.items()} == expected
    share = config.num_experts // len(records)
    for rank, hashes in enumerate(held):
        assert {int(key.split(".")[1]) // share for key in hashes} == {rank}


@torch.no_grad()
def test_one_rank_is_the_plain_model(tiny_model) -> None:
    model = split_model(copy.deepcopy(tiny_model), 0, 1)
    assert model.config == tiny_model.config
    plain = tiny_model.state_dict()
    assert all(torch.equal(plain[name], value) for name, value in model.state_dict().items())
    ids = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids)[0], tiny_model(ids)[0])


def test_rank_shapes(tiny_model) -> None:
    """Rank 1 of 2 holds half the heads (its caches too), half the experts and half the MLP widths."""
    model = split_model(copy.deepcopy(tiny_model), 1, 2)
    kda, mla = model.model.layers[1].self_attn, model.model.layers[3].self_attn
    moe = model.model.layers[1].block_sparse_moe
    assert kda.q_proj.weight.shape == (32, 64) and kda.o_proj.weight.shape == (64, 32)
    assert kda.A_log.shape == (1,) and kda.b_proj.weight.shape == (1, 64)
    assert mla.q_b_proj.weight.shape == (32, 48) and mla.o_proj.weight.shape == (64, 16)
    assert moe.experts.w1.shape[0] == 4 and moe.experts.expert_offset == 4
    assert moe.gate.weight.shape == (8, 64)  # the router is whole
    assert moe.shared_experts.gate_proj.weight.shape == (32, 64)
    assert model.model.layers[0].mlp.down_proj.weight.shape == (64, 64)
    assert model.empty_cache(2, 8).layers[1].kda_state.shape == (2, 1, 32, 32)


def test_splits_that_do_not_divide_are_refused(tiny_config, tiny_model) -> None:
    with pytest.raises(UserError, match=r"ranks = 3 does not divide linear_attn_config.num_heads = 2, "
                                        r"num_attention_heads = 2, num_experts = 8, intermediate_size = 128"):
        check_split(tiny_config, 3)
    with pytest.raises(UserError, match="ranks = 4 does not divide linear_attn_config.num_heads = 2, "
                                        "num_attention_heads = 2: "):
        check_split(tiny_config, 4)
    with pytest.raises(UserError, match="ranks = 0: expected a positive integer"):
        check_split(tiny_config, 0)
    with pytest.raises(UserError, match="rank = 2: expected 0 <= rank < ranks = 2"):
        split_model(copy.deepcopy(tiny_model), 2, 2)
    split = split_model(copy.deepcopy(tiny_model), 0, 2)
    with pytest.raises(UserError, match=r"already split \(rank 0 of 2\)"):
        split_model(split, 0, 2)


def test_a_split_model_outside_torchrun_is_refused(tiny_model) -> None:
    model = split_model(copy.deepcopy(tiny_model), 0, 2)
    with pytest.raises(UserError, match="all_reduce over 2 ranks, but the process group has 1"):
        model(torch.zeros(1, 2, dtype=torch.int64))
