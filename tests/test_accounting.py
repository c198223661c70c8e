"""Parameter accounting against the arithmetic of docs/architecture.md, written out here."""

import pytest

from k3export.config import K3Config
from k3export.model.accounting import parameter_report

D, H, HK, VOCAB = 7168, 96, 96 * 128, 163840


def kda_layer() -> int:
    projections = 4 * HK * D + D * HK  # q, k, v, g; o
    decay = 128 * D + HK * 128 + HK + H  # f_a, f_b, dt_bias, A_log (unpadded)
    return projections + decay + H * D + 3 * HK * 4 + 128  # b_proj, convs, o_norm


def mla_layer() -> int:
    return (1536 * D + 1536 + 1536 * H * 192 + 576 * D + 512 + 512 * H * 256
            + H * 128 * D + D * H * 128)


def moe_layer() -> int:
    experts = 896 * 3 * 3584 * 3072
    return experts + 3 * D * 6144 + 896 * D + 896 + 2 * D * 3584 + 3584


def layer_extras() -> int:
    return 6 * D  # four norms, two AttnRes projections


def test_kimi_k3_totals():
    report = parameter_report(K3Config.from_preset("kimi-k3"))
    assert kda_layer() == pytest.approx(443.74e6, rel=1e-4)
    assert mla_layer() == pytest.approx(232.20e6, rel=1e-4)
    assert moe_layer() == pytest.approx(29.785e9, rel=1e-4)
    dense = 3 * D * 33792
    total = (69 * kda_layer() + 24 * mla_layer() + dense + 92 * moe_layer() + 93 * layer_extras()
             + 2 * VOCAB * D + 3 * D)
    assert report.total == total
    assert report.total == pytest.approx(2.7795e12, rel=1e-3)
    inactive_experts = 92 * (896 - 16) * 3 * 3584 * 3072
    assert report.active == total - VOCAB * D - inactive_experts
    assert report.active == pytest.approx(104.19e9, rel=1e-3)


def test_seed_variant_and_cache():
    report = parameter_report(K3Config.from_preset("k3-seed"))
    assert report.total == pytest.approx(2.75e12, rel=5e-3)
    cache = parameter_report(K3Config.from_preset("kimi-k3")).cache(1000)
    assert cache["mla_latent_per_token"] == 24 * 576 * 2
    assert cache["plain_mha_per_token"] / cache["mla_latent_per_token"] == pytest.approx(53.33, rel=1e-3)
    assert cache["kda_state_per_sequence"] == 69 * 96 * 128 * 128 * 4
    assert cache["kda_conv_per_sequence"] == 69 * 3 * 3 * HK * 2


def test_mxfp4_bytes():
    report = parameter_report(K3Config.from_preset("kimi-k3"))
    routed = 92 * 896 * 3 * 3584 * 3072
    assert report.weight_bytes - report.weight_bytes_mxfp4_experts == pytest.approx(routed * (2 - 4.25 / 8))
