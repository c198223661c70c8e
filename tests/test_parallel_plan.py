"""`k3export plan --ranks N`: per GPU of a stage, the split and replicated weights, the cache (KDA
heads split, MLA latent whole), the all-reduces with their bytes per token, and the fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3export.cli import main
from k3export.config import K3Config
from k3export.model import K3ForCausalLM
from k3export.model.parallel import split_model
from k3export.shards.plan import make_plan, rank_stages


def eight_head_config() -> K3Config:
    """k3-tiny with 8 KDA and 8 MLA heads, so that 2, 4 and 8 ranks divide it (k3-tiny has 2)."""
    data = K3Config.from_preset("k3-tiny").to_dict()
    data["num_attention_heads"] = data["linear_attn_config"]["num_heads"] = 8
    return K3Config.from_dict(data)


@pytest.mark.parametrize(("stages", "ranks"), [(1, 2), (3, 2), (2, 4), (1, 8)])
def test_rank_bytes_add_up_to_the_stage(stages: int, ranks: int) -> None:
    """Each rank's weights are those of the split model itself (k3export.model.parallel.split_model
    on the meta device: its parameters in the stage's parts, counted here); N ranks' split weights
    plus one copy of the replicated ones are the unsplit stage's weights; the KDA cache is split,
    the MLA cache is whole on every rank."""
    config = eight_head_config()
    plan = make_plan(config, stages, model="k3-tiny", dtype="float32", context=64, batch=2)
    split = []
    for r in (0, ranks - 1):
        with torch.device("meta"):
            split.append(split_model(K3ForCausalLM(config).eval(), r, ranks))
    for stage, rank in zip(plan.stages, rank_stages(plan, ranks), strict=True):
        for model in split:
            held = sum(p.numel() * p.element_size() for part in model.parts(stage.layers)
                       for p in part.parameters())
            assert rank.split_weight_bytes + rank.replicated_weight_bytes == held
        assert rank.split_weight_bytes * ranks + rank.replicated_weight_bytes == stage.weight_bytes
        assert rank.split_weight_bytes > 0 and rank.replicated_weight_bytes > 0
        lac = config.linear_attn_config
        kda = (lac.num_heads * lac.head_dim**2 * 4 + 3 * (lac.short_conv_kernel_size - 1) * lac.num_heads
               * lac.head_dim * 4) // ranks
        mla = 64 * config.latent_dim * 4
        assert rank.cache_bytes_per_sequence == sum(mla if config.is_mla(i) else kda for i in stage.layers)
        assert rank.cache_bytes == 2 * rank.cache_bytes_per_sequence


@pytest.mark.parametrize("ranks", [4, 8])
def test_collectives_per_token(ranks: int) -> None:
    """eight_head_config (so that 4 and 8 ranks divide it): each all-reduce sums a
    whole activation (the same bytes on every rank, whatever N), and a ring all-reduce moves
    2 (N - 1) / N of them over each GPU's link: 1.5x at N = 4, 1.75x at N = 8 (at N = 2 the factor is 1)."""
    config = eight_head_config()
    plan = make_plan(config, 1, model="k3-tiny", dtype="float32", context=64)
    (rank,) = rank_stages(plan, ranks, collective_gb_per_s=100.0)
    D, L = config.hidden_size, config.routed_expert_hidden_size
    assert rank.collective_bytes_per_token == [4 * D, 4 * D] + [4 * D, 4 * (L + D)] * 8
    ring = 2 * (ranks - 1) / ranks
    sent = ring * sum(rank.collective_bytes_per_token)
    assert rank.collective_seconds_per_token == pytest.approx(sent / 100e9)


def test_published_model_on_two_hosts_of_eight(capsys) -> None:
    """kimi-k3 in bf16 with MXFP4 experts, 2 stages x 8 GPUs: each GPU fits, holding about 1/16 of the
    model (plus the replicated parts)."""
    assert main(["plan", "--preset", "kimi-k3", "--stages", "2", "--ranks", "8", "--packed-experts",
                 "--dtype", "bfloat16", "--batch", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    total = sum(s["weight_bytes"] for s in plan["stages"])
    ranks = plan["parallel"]["stages"]
    assert plan["parallel"]["ranks"] == 8 and len(ranks) == 2
    for rank in ranks:
        assert rank["fits_h200"]
        assert total / 16 < rank["weight_bytes"] < 1.2 * total / 16
        assert len(rank["collective_bytes_per_token"]) == 2 * (rank["layers"][1] - rank["layers"][0])


def test_the_two_host_recipe_plans_its_ranks(capsys) -> None:
    """engines/kimi-k3.toml ([parallel] ranks = 8) plans per GPU without --ranks."""
    recipe = Path(__file__).parents[1] / "engines" / "kimi-k3.toml"
    assert main(["plan", str(recipe), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["parallel"]["ranks"] == 8 and len(plan["stages"]) == 2
    assert all(rank["fits_h200"] for rank in plan["parallel"]["stages"])


def test_recipe_links_set_the_plans_bandwidths(tmp_path: Path, capsys) -> None:
    """[links] gives the plan its two bandwidths (between stages, among a stage's ranks), and the
    command line's options override them; a bandwidth that is not a positive number is refused."""
    text = (Path(__file__).parents[1] / "engines" / "k3-tiny-2x2.toml").read_text()
    recipe = tmp_path / "links.toml"
    recipe.write_text(text + "\n[links]\nstages_gb_per_s = 10\nranks_gb_per_s = 20.5\n")

    def planned(*options: str) -> dict:
        assert main(["plan", str(recipe), "--json", *options]) == 0
        return json.loads(capsys.readouterr().out)

    plan, default = planned(), planned("--link-gb-per-s", "50", "--collective-gb-per-s", "450")
    assert (plan["link_gb_per_s"], plan["parallel"]["collective_gb_per_s"]) == (10, 20.5)
    sent = plan["stages"][0]["seconds_per_token_sent"]
    assert sent == pytest.approx(5 * default["stages"][0]["seconds_per_token_sent"])
    collective = [p["parallel"]["stages"][0]["collective_seconds_per_token"] for p in (plan, default)]
    assert collective[0] == pytest.approx(450 / 20.5 * collective[1])
    for bad in ("0", "-1", '"fast"', "true", "inf"):
        recipe.write_text(text + f"\n[links]\nranks_gb_per_s = {bad}\n")
        assert main(["plan", str(recipe)]) == 2
        assert "key 'links.ranks_gb_per_s' = " in capsys.readouterr().err


def test_ranks_that_do_not_divide_are_refused(capsys) -> None:
    # 96 heads and the MLP widths divide by 3, the 896 experts do not.
    assert main(["plan", "--preset", "kimi-k3", "--stages", "2", "--ranks", "3"]) == 2
    assert "ranks = 3 does not divide num_experts = 896: expected" in capsys.readouterr().err
    assert main(["plan", "--preset", "kimi-k3", "--stages", "2", "--ranks", "0"]) == 2
    assert "argument --ranks: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_bytes_per_token_use_the_model_dtype(tiny_config: K3Config) -> None:
    plan = make_plan(tiny_config, 1, model="k3-tiny", dtype="bfloat16", context=64)
    (rank,) = rank_stages(plan, 2)
    D, L = tiny_config.hidden_size, tiny_config.routed_expert_hidden_size
    assert rank.collective_bytes_per_token[:4] == [2 * D, 2 * D, 2 * D, 4 * (L + D)]
