import json

import pytest

from k3export.config import PRESETS, ConfigError, K3Config


def test_published_schedule():
    config = K3Config.from_preset("kimi-k3")
    assert config.num_hidden_layers == 93
    assert [i + 1 for i in config.mla_layers] == [*range(4, 93, 4), 93]
    assert len(config.mla_layers) == 24 and config.num_hidden_layers - len(config.mla_layers) == 69
    assert config.is_mla(92) and config.is_mla(91) and not config.is_mla(90)
    assert config.latent_dim == 576 and config.mla_scale == pytest.approx(192**-0.5)
    seed = K3Config.from_preset("k3-seed")
    assert [i + 1 for i in seed.mla_layers] == list(range(4, 93, 4))


def test_tiny_preset_has_every_feature():
    c = K3Config.from_preset("k3-tiny")
    assert len(c.mla_layers) >= 3 and c.is_mla(c.num_hidden_layers - 1)  # 2 cycles + trailing MLA
    assert c.first_k_dense_replace == 1 and c.num_shared_experts > 0 and c.num_experts_per_token > 1
    assert c.num_hidden_layers > 2 * c.attn_res_block_size
    assert c.moe_intermediate_size % 32 == 0 and c.routed_expert_hidden_size % 32 == 0


@pytest.mark.parametrize("name", list(PRESETS))
def test_json_round_trip(tmp_path, name):
    config = K3Config.from_preset(name)
    config.to_json(tmp_path / "config.json")
    assert K3Config.from_json(tmp_path / "config.json") == config
    assert K3Config.from_json(tmp_path) == config  # a directory means its config.json


def test_reads_nested_text_config_and_aliases(tmp_path):
    text = K3Config.from_preset("k3-tiny").to_dict()
    text["n_routed_experts"] = text.pop("num_experts")
    text["num_experts_per_tok"] = text.pop("num_experts_per_token")
    text["n_shared_experts"] = text.pop("num_shared_experts")
    text["some_unrelated_hf_field"] = 1
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "kimi_k3", "text_config": text, "vision_config": {}}))
    assert K3Config.from_json(path) == K3Config.from_preset("k3-tiny")


@pytest.mark.parametrize(("change", "field"), [
    ({"num_attention_heads": 3}, "linear_attn_config.num_heads"),
    ({"linear_attn_config": {"full_attn_layers": [4, 10]}}, "linear_attn_config.full_attn_layers"),
    ({"linear_attn_config": {"full_attn_layers": [0]}}, "linear_attn_config.full_attn_layers"),
    ({"num_experts_per_token": 9}, "num_experts_per_token"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"linear_attn_config": {"gate_lower_bound": 2.0}}, "linear_attn_config.gate_lower_bound"),
    ({"linear_attn_config": {"kda_layers": [1, 2, 3]}}, "linear_attn_config.kda_layers"),
    ({"torch_dtype": "int8"}, "torch_dtype"),
])
def test_invalid_configs_name_the_field(tmp_path, change, field):
    data = K3Config.from_preset("k3-tiny").to_dict()
    for key, value in change.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        K3Config.from_json(path)
    assert f"'{field}'" in str(err.value) and str(path) in str(err.value)


def test_unreadable_inputs(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        K3Config.from_json(bad)
    with pytest.raises(ConfigError, match="missing.json: no such file"):
        K3Config.from_json(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="linear_attn_config"):
        K3Config.from_dict({"hidden_size": 8})
    with pytest.raises(ConfigError, match="unknown preset"):
        K3Config.from_preset("k4")
