"""Recipes: the shipped ones load, and every bad key is refused naming the file, the key and the
expectation."""

from pathlib import Path

import pytest

from k3export.errors import UserError
from k3export.shards.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]

TINY = (ROOT / "engines/k3-tiny.toml").read_text()


def test_shipped_recipes_load() -> None:
    tiny = load_recipe(ROOT / "engines/k3-tiny.toml")
    assert (tiny.stage_count, tiny.dtype, tiny.weights, tiny.taps) == (2, "float32", {"seed": 0}, False)
    assert load_recipe(ROOT / "engines/k3-small.toml").stage_count == 4
    for name, stages, ranks in (("kimi-k3.toml", 2, 8), ("kimi-k3-16x1.toml", 16, 1)):
        k3 = load_recipe(ROOT / "engines" / name)
        assert (k3.backend, k3.target, k3.packed_experts) == ("tensorrt", "sm90", True)
        assert (k3.config.num_hidden_layers, k3.stage_count, k3.ranks) == (93, stages, ranks)
        assert k3.weights["checkpoint"].endswith("checkpoints/Kimi-K3") and k3.weights["packed_experts"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("old", "new", "message"), [
    ("capacity = 256", "capacity = 0", "key 'cache.capacity' = 0: expected an integer >= 1"),
    ("capacity = 256", "capacty = 256", "unknown key 'cache.capacty'"),
    ("count = 2", "ranges = [[0, 4], [5, 9]]", "key 'stages.ranges'"),
    ("count = 2", "count = 2\nranges = [[0, 9]]", "expected exactly one of 'count' or 'ranges', found both"),
    ('backend = "tensorrt-rtx"', 'backend = "trt"', "key 'build.backend' = 'trt': expected one of"),
    ('target = "sm89"', 'target = "sm90"', "TensorRT-RTX's targets"),
    ('experts = "as-stored"', 'experts = "mxfp4-packed"', "only a checkpoint's MXFP4 experts"),
    ("decode = { batch = 2 }", "decode = { batch = 3 }", "key 'profiles.decode.batch' = 3: expected at most"),
    ("decode = { batch = 2 }", "decode = { batch = 2 }\nverify = { seq = 1 }",
     "key 'profiles.verify.seq' = 1: expected 2 up to cache.capacity (256)"),
    ("decode = { batch = 2 }", "decode = { batch = 2 }\nverify = { batch = 2 }",
     "key 'profiles.verify.seq' missing"),
    ('preset = "k3-tiny"', 'preset = "k3-huge"', "key 'model.preset' = 'k3-huge'"),
    ("[cache]", "[cash]", "unknown table [cash]"),
    ('target = "sm89"', 'target = "sm89"\ntaps = 1', "key 'build.taps' = 1: expected true or false"),
    ('target = "sm89"', 'target = "sm89"\nrouting_outputs = "yes"',
     "key 'build.routing_outputs' = 'yes': expected true or false"),
])
def test_bad_keys_are_named(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in TINY
    path = write(tmp_path, TINY.replace(old, new))
    with pytest.raises(UserError, match="recipe.toml") as error:
        load_recipe(path)
    assert message in str(error.value)


def test_explicit_ranges_and_relative_config(tmp_path: Path) -> None:
    from k3export.config import K3Config

    K3Config.from_preset("k3-tiny").to_json(tmp_path / "config.json")
    text = TINY.replace('preset = "k3-tiny"', 'config = "config.json"').replace(
        "count = 2", "ranges = [[0, 3], [3, 7], [7, 9]]")
    recipe = load_recipe(write(tmp_path, text))
    assert recipe.stage_ranges == (range(0, 3), range(3, 7), range(7, 9))
    assert recipe.config == K3Config.from_preset("k3-tiny")


def test_verify_profile_key(tmp_path: Path) -> None:
    """[profiles] verify = { seq = N }: a third engine profile (run --speculate K: N = 3K + 1); none by
    default."""
    assert load_recipe(write(tmp_path, TINY)).verify_seq == 0
    text = TINY.replace("decode = { batch = 2 }", "decode = { batch = 2 }\nverify = { seq = 5 }")
    assert load_recipe(write(tmp_path, text)).verify_seq == 5


def test_taps_key(tmp_path: Path) -> None:
    assert load_recipe(write(tmp_path, TINY.replace('target = "sm89"', 'target = "sm89"\ntaps = true'))).taps


def test_not_toml(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not valid TOML"):
        load_recipe(write(tmp_path, "[model\n"))
