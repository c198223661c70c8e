import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3export.config import K3Config
from k3export.model import K3ForCausalLM
from k3export.model.parallel import split_model
from k3export.weights.checkpoint import CheckpointError, build_model, load_checkpoint, save_checkpoint


def fresh(config: K3Config) -> K3ForCausalLM:
    model = K3ForCausalLM(config)
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    return model


@pytest.mark.parametrize("shard_bytes", [1 << 40, 300_000])
def test_round_trip(tmp_path, tiny_model, shard_bytes):
    files = save_checkpoint(tiny_model, tmp_path, max_shard_bytes=shard_bytes)
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert (len(shards) > 1) == (shard_bytes < 1 << 40)
    assert all(f.stat().st_size <= shard_bytes + 50_000 for f in shards)  # + the JSON header
    config = K3Config.from_json(tmp_path / "config.json")
    loaded = fresh(config)
    load_checkpoint(loaded, tmp_path)
    for (name, a), (_, b) in zip(tiny_model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary files left behind


def test_published_names_one_tensor_per_expert(tmp_path, tiny_model):
    save_checkpoint(tiny_model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        w1 = f.get_tensor("model.layers.1.block_sparse_moe.experts.3.w1.weight")
    config = tiny_model.config
    assert w1.shape == (config.moe_intermediate_size, config.routed_expert_hidden_size)
    assert torch.equal(w1, tiny_model.model.layers[1].block_sparse_moe.experts.w1[3])
    for expected in ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate_proj.weight",
                     "model.layers.0.self_attn.q_conv1d.weight", "model.layers.3.self_attn.kv_b_proj.weight",
                     "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                     "model.output_attn_res_proj.weight", "model.layers.2.mlp_res_norm.weight"]:
        assert expected in names
    assert not any(n.endswith(("experts.w1", "experts.w2", "experts.w3")) for n in names)


def test_mismatches_are_named(tmp_path, tiny_model):
    save_checkpoint(tiny_model, tmp_path)
    path = tmp_path / "model.safetensors"
    with safe_open(path, framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    del tensors["model.layers.2.self_attn.A_log"]
    tensors["model.layers.2.self_attn.bogus.weight"] = torch.zeros(3)
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(fresh(tiny_model.config), tmp_path)
    message = str(err.value)
    assert "missing (1): model.layers.2.self_attn.A_log" in message
    assert "unexpected (1): model.layers.2.self_attn.bogus.weight" in message
    assert "mis-shaped (1): model.norm.weight (model.safetensors: [7], model: [64])" in message


def test_bad_index_and_empty_dir(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json or model.safetensors"):
        load_checkpoint(fresh(K3Config.from_preset("k3-tiny")), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weights": {}}))
    with pytest.raises(CheckpointError, match="index.json: expected JSON with a 'weight_map'"):
        load_checkpoint(fresh(K3Config.from_preset("k3-tiny")), tmp_path)


def test_layer_range_build_holds_only_its_layers(tiny_config):
    """A shard's eager model: the range's layers (and the head, as the range ends at the last
    layer) get the same seeded weights as in the whole model; the rest stay on the meta device."""
    whole = dict(build_model(tiny_config, torch.float32, {"seed": 3}).named_parameters())
    part = build_model(tiny_config, torch.float32, {"seed": 3}, range(4, 9))
    for name, param in part.named_parameters():
        used = name.startswith(("lm_head.", "model.norm.", "model.output_attn_res")) or any(
            name.startswith(f"model.layers.{i}.") for i in range(4, 9))
        assert (param.device.type != "meta") == used, name
        if used:
            assert torch.equal(param, whole[name]), name


@pytest.mark.parametrize("rank", [0, 1])
def test_seeded_rank_is_its_part_of_the_seeded_stage(rank, monkeypatch):
    """A seeded rank holds exactly what split_model keeps of the whole seeded stage, and its weights
    are drawn into the rank's shapes (split on the meta device first, each parameter drawn whole
    and its part kept): the whole stage is never held at once."""
    config = K3Config.from_preset("k3-tiny")
    layers = range(1, 3)
    expected = split_model(build_model(config, torch.float32, {"seed": 3}, layers), rank, 2).state_dict()
    held_when_drawn = []
    real_init = K3ForCausalLM.init_weights

    def recording_init(model, seed):
        held_when_drawn.append(sum(p.numel() for p in model.parameters() if p.device.type != "meta"))
        return real_init(model, seed)

    monkeypatch.setattr(K3ForCausalLM, "init_weights", recording_init)
    model = build_model(config, torch.float32, {"seed": 3}, layers, rank=rank, ranks=2)
    got = model.state_dict()
    assert list(got) == list(expected)
    held = [name for name, tensor in expected.items() if tensor.device.type != "meta"]
    assert held and all(got[name].device.type != "meta" for name in held)
    for name in held:
        assert torch.equal(got[name], expected[name]), name
    params = dict(model.named_parameters())
    assert held_when_drawn == [sum(expected[name].numel() for name in held if name in params)]
