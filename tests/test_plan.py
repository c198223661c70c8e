"""The shard planner against independent arithmetic (docs/architecture.md's parameter counts) and a
brute-force partition, on the published model at the shipped recipe's stage count."""

import importlib.util
import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3export.cli import main
from k3export.config import K3Config
from k3export.model import K3ForCausalLM
from k3export.shards.plan import LINK_GB_PER_S, partition, plan_recipe
from k3export.shards.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]

# The published shapes, written out from docs/architecture.md (not read from the code).
D, V, C, H, K = 7168, 163840, 12288, 96, 128
F32_KDA = 3 * C * 4 + H + C + K  # conv weights, A_log (96 heads used), dt_bias, o_norm: float32
KDA = 4 * C * D + D * C + K * D + C * K + H * D + F32_KDA
MLA = 1536 * D + 1536 + 18432 * 1536 + 576 * D + 512 + 24576 * 512 + C * D + D * C
DENSE = 3 * 33792 * D
EXPERTS = 896 * 3 * 3584 * 3072
MOE_REST = 3 * D * 6144 + 896 * D + 896 + 2 * D * 3584 + 3584  # shared, router + bias, latent, norm
NORMS = 4 * D + 2 * D  # four RMSNorms and two AttnRes projections per layer
HEAD = V * D + 3 * D  # lm_head, final norm, output AttnRes norm and projection
MLA_LAYERS = {*range(3, 92, 4), 92}  # 0-based: 1-based 4, 8, ..., 92 and 93


def test_arithmetic_matches_architecture_md() -> None:
    """The hand formulas above reproduce docs/architecture.md's rounded counts."""
    assert round(KDA / 1e6, 2) == 443.74 and round(MLA / 1e6, 2) == 232.20
    assert round(DENSE / 1e6, 1) == 726.7 and round((EXPERTS + MOE_REST) / 1e9, 3) == 29.785
    total = 69 * KDA + 24 * MLA + DENSE + 92 * (EXPERTS + MOE_REST) + 93 * NORMS + V * D + HEAD
    assert round(total / 1e12, 4) == 2.7795


def expected_layer(i: int) -> tuple[int, int]:
    """(parameters, bytes) of layer i with the globals it carries; bfloat16 but for the float32
    KDA parameters and router bias, routed experts in MXFP4 (17 bytes per 32 weights)."""
    mixer = MLA if i in MLA_LAYERS else KDA
    f32 = 0 if i in MLA_LAYERS else F32_KDA
    if i == 0:
        ffn, ffn_bytes = DENSE, 2 * DENSE
    else:
        ffn, ffn_bytes, f32 = EXPERTS + MOE_REST, EXPERTS * 17 // 32 + 2 * MOE_REST, f32 + 896
    extra = V * D if i == 0 else HEAD if i == 92 else 0
    params = mixer + ffn + NORMS + extra
    return params, 2 * (mixer + NORMS + extra) + 2 * f32 + ffn_bytes


@pytest.fixture(scope="module")
def k3_plan():
    recipe = load_recipe(ROOT / "engines/kimi-k3-16x1.toml")
    return recipe, plan_recipe(recipe)


def test_every_layer_once_in_order(k3_plan) -> None:
    recipe, plan = k3_plan
    assert len(plan.stages) == recipe.stage_count
    assert [i for s in plan.stages for i in s.layers] == list(range(93))
    assert all(len(s.layers) > 0 for s in plan.stages)


def test_balance_bound(k3_plan) -> None:
    """Proven: heaviest <= mean + heaviest layer (plan.py's docstring); at this stage count the
    layers are fine enough that the heaviest stage is also within 1.25x of the lightest."""
    _, plan = k3_plan
    weights = [s.weight_bytes for s in plan.stages]
    heaviest_layer = max(expected_layer(i)[1] for i in range(93))
    assert max(weights) <= sum(weights) / len(weights) + heaviest_layer
    assert max(weights) <= 1.25 * min(weights)


def test_numbers_agree_with_independent_arithmetic(k3_plan) -> None:
    recipe, plan = k3_plan
    elem, context = 2, recipe.capacity
    for s in plan.stages:
        assert s.params == sum(expected_layer(i)[0] for i in s.layers)
        assert s.weight_bytes == sum(expected_layer(i)[1] for i in s.layers)
        n_mla = len(MLA_LAYERS & set(s.layers))
        n_kda = len(s.layers) - n_mla
        assert s.cache_bytes_per_sequence == n_mla * context * 576 * elem + n_kda * (
            H * K * K * 4 + 3 * 3 * C * elem)
        assert s.cache_bytes == s.cache_bytes_per_sequence * recipe.batch
        # The AttnRes boundary: one bank row per block of 12 started before the stage, plus the
        # partial block, each `hidden` wide.
        first, last = s.layers.start, s.layers.stop
        received = 8 if first == 0 else (math.ceil(first / 12) + 1) * D * elem
        sent = V * elem if last == 93 else (math.ceil(last / 12) + 1) * D * elem
        assert (s.bytes_received_per_token, s.bytes_sent_per_token) == (received, sent)
        assert s.seconds_per_token_sent == pytest.approx(sent / (LINK_GB_PER_S * 1e9))
        assert s.total_bytes == s.weight_bytes + s.cache_bytes + s.activation_bytes
        assert s.fits_h200 == (s.total_bytes <= 141e9)
    assert sum(s.params for s in plan.stages) == sum(expected_layer(i)[0] for i in range(93))
    # Adjacent stages agree on what crosses between them.
    for a, b in itertools.pairwise(plan.stages):
        assert [t.name for t in a.sends] == [t.name for t in b.receives]


def brute_force(weights: list[int], parts: int) -> tuple[int, int]:
    """(smallest possible heaviest part, then largest possible lightest part), by enumeration."""
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), parts - 1):
        bounds = [0, *cuts, len(weights)]
        sums = [sum(weights[a:b]) for a, b in itertools.pairwise(bounds)]
        key = (max(sums), -min(sums))
        best = key if best is None or key < best else best
    return best[0], -best[1]


def test_partition_is_optimal() -> None:
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 9)
        weights = [rng.choice([1, 2, 5, 30, 31]) for _ in range(n)]
        parts = rng.randint(1, n)
        ranges = partition(weights, parts)
        assert [i for r in ranges for i in r] == list(range(n)) and len(ranges) == parts
        sums = [sum(weights[r.start:r.stop]) for r in ranges]
        assert (max(sums), min(sums)) == brute_force(weights, parts)


def test_cli_json(capsys) -> None:
    assert main(["plan", "--preset", "kimi-k3", "--stages", "16", "--packed-experts", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    bounds = [s["layers"] for s in plan["stages"]]
    assert bounds[0][0] == 0 and bounds[-1][1] == 93
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert main(["plan", "--preset", "kimi-k3"]) == 2  # no --stages: a message, not a traceback


def test_host_memory_of_a_build(capsys) -> None:
    """Each stage's (and each rank's) build host memory from the measured fit; kimi-k3's ranks (about
    105 GB of weights each) peak near 290 GB, of it about 185 GB anonymous, so that all 8 of a 2 TB
    host's rank builds fit in 80% of it (by the peaks' total, only 5 would)."""
    assert main(["plan", str(Path(__file__).resolve().parents[1] / "engines/kimi-k3.toml"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for stage in plan["stages"]:
        weights = stage["memory"]["weights"]
        assert stage["memory"]["build_anon"] == round(0.66e9 + 1.76 * weights)
        assert stage["memory"]["build_host"] == stage["memory"]["build_anon"] + round(0.26e9 + weights)
        # Each profile's activations at its own tokens: prefill 1 x 8192, decode 8 x 1.
        by_profile = stage["memory"]["activations_by_profile"]
        assert by_profile["prefill"] == stage["memory"]["activations"]
        assert by_profile["decode"] * 8192 == by_profile["prefill"] * 8
    assert plan["parallel"]["host_bytes"] == 2e12
    for rank in plan["parallel"]["stages"]:
        assert 250e9 < rank["build_host_bytes"] < 300e9 and 150e9 < rank["build_anon_bytes"] < 200e9
        assert rank["builds_at_once"] == 8 and 0.8 * 2e12 // rank["build_host_bytes"] == 5


def test_builds_at_once_take_80_percent_of_the_host(capsys) -> None:
    """--host-gb where the share decides, not the 8 ranks: a 1 TB host runs as many of kimi-k3's rank
    builds at once as 80% of it holds by their anonymous memory (4), not all of it (5)."""
    recipe = Path(__file__).resolve().parents[1] / "engines/kimi-k3.toml"
    assert main(["plan", str(recipe), "--host-gb", "1000", "--json"]) == 0
    parallel = json.loads(capsys.readouterr().out)["parallel"]
    assert parallel["host_bytes"] == 1e12
    for rank in parallel["stages"]:
        assert rank["builds_at_once"] == 0.8e12 // rank["build_anon_bytes"] == 4
        assert 1e12 // rank["build_anon_bytes"] == 5


BUILD_AND_PEAK = """
import sys
from k3export.cli import main
assert main(["build", sys.argv[1], "--out", sys.argv[2], "--stage", "0", "--quiet"]) == 0
print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1])
"""


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt_rtx is not installed")
def test_build_memory_fit_bounds_a_measured_build(tmp_path, capsys) -> None:
    """plan's build memory against a real one: a k3-tiny stage built with TensorRT-RTX in a fresh
    process, whose own peak resident memory (VmHWM, from its /proc/self/status) the fit must bound,
    by no more than a quarter (its fixed part dominates at these weights)."""
    recipe = str(Path(__file__).resolve().parents[1] / "engines/k3-tiny.toml")
    child = subprocess.run([sys.executable, "-c", BUILD_AND_PEAK, recipe, str(tmp_path / "build")],
                           capture_output=True, text=True, check=True)
    peak = int(child.stdout.split()[-1]) * 1024
    assert main(["plan", recipe, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["stages"][0]["memory"]["build_host"]
    assert peak <= planned <= 1.25 * peak, (peak, planned)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_memory_of_a_check(capsys, dtype: str) -> None:
    """check runs a stage's eager reference on the host's CPU: the stage's weights, and for half
    precision its float32 model's too. Over the stages, the whole model's parameter bytes in its dtype
    (and in float32), counted on models of the preset."""
    assert main(["plan", "--preset", "k3-tiny", "--stages", "2", "--dtype", dtype, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    config = K3Config.from_preset("k3-tiny")
    dtypes = [torch.float32] if dtype == "float32" else [getattr(torch, dtype), torch.float32]
    expected, models = 0, []
    for torch_dtype in dtypes:
        with torch.device("meta"):
            models.append(K3ForCausalLM(config, torch_dtype))
        expected += sum(p.numel() * p.element_size() for p in models[-1].parameters())
    assert sum(s["memory"]["check_host"] for s in plan["stages"]) == expected

    def held(layer: int, models: list[K3ForCausalLM]) -> int:
        """What running one layer holds: its parts' weights in each model."""
        return sum(p.numel() * p.element_size() for model in models
                   for part in model.parts(range(layer, layer + 1)) for p in part.parameters())

    # Streamed (check --eager streamed): the heaviest layer of the stage with its float32 twin, or of
    # the layers before it (check --stage I computes its input with them, one model).
    for stage in plan["stages"]:
        start, stop = stage["layers"]
        heaviest = max([held(i, models) for i in range(start, stop)]
                       + [held(i, models[:1]) for i in range(start)])
        assert stage["memory"]["check_host_streamed"] == heaviest < stage["memory"]["check_host"]
