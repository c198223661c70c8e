"""The plugin definitions and the pieces of the tensorrt.plugin AOT registration that run with no
TensorRT: shapes, dtypes, fields, type combinations, and the AOT KDA kernel's PTX parameter order."""

import re

import pytest

from k3plugins.aot import compile_variant
from k3plugins.definitions import DEFINITIONS, KDA, LATENT_MLA
from k3plugins.trt_aot import kda_aot_kernel, kda_aot_launch, type_combinations

# q k v g beta initial_state of the tiny model: B=2, T=5, H=3, K=V=32.
KDA_DIMS = [[2, 5, 3, 32], [2, 5, 3, 32], [2, 5, 3, 32], [2, 5, 3, 32], [2, 5, 3], [2, 3, 32, 32]]


def test_lookup_keys_match_the_export() -> None:
    assert [(d.name, d.namespace, d.version) for d in DEFINITIONS] == [("KDA", "k3", "1"),
                                                                         ("LatentMLA", "k3", "1")]


def test_output_shapes() -> None:
    assert KDA.output_shapes(KDA_DIMS, {}, int) == [[2, 5, 3, 32], [2, 3, 32, 32]]
    fields = {"v_dim": 32, "scale": 0.125}
    # The constant goes through the builder's constructor (here a tag, to see that it is used).
    assert LATENT_MLA.output_shapes([[2, 5, 4, 48], [2, 9, 48]], fields, lambda c: ("const", c)) == \
        [[2, 5, 4, ("const", 32)]]


def test_output_dtypes() -> None:
    assert KDA.output_dtypes(["bfloat16"] * 3 + ["float32"] * 3) == ["bfloat16", "float32"]
    assert LATENT_MLA.output_dtypes(["float16", "float32"]) == ["float16"]


def test_supported_dtypes() -> None:
    half = ["float16"] * 3 + ["float32", "float32", "float32"]
    assert KDA.supports([*half, "float16", "float32"])
    assert KDA.supports(half[:2] + [None] * 6)  # later positions undecided
    assert not KDA.supports(["float16", "float32"])  # q and k differ
    assert not KDA.supports(["float32"] * 5 + ["float16"])  # the state is float32 only
    assert not KDA.supports([*half, "float32"])  # o must be v's dtype
    assert LATENT_MLA.supports(["bfloat16", "float32", "bfloat16"])
    assert not LATENT_MLA.supports(["float32", "float32", "int32"])


def test_fields() -> None:
    assert LATENT_MLA.parse_fields({"v_dim": 32, "scale": 0.5}) == {"v_dim": 32, "scale": 0.5}
    with pytest.raises(ValueError, match=r"k3::LatentMLA v1: missing fields \['scale'\]"):
        LATENT_MLA.parse_fields({"v_dim": 32})
    assert KDA.parse_fields({}) == {}


def test_aot_type_combinations() -> None:
    # One per dtype choice of each group; the AOT KDA kernel takes g and beta in float32 only.
    assert type_combinations(KDA, aot=True)[1] == "FP16, FP16, FP16, FP32, FP32, FP32, FP16, FP32"
    assert len(type_combinations(KDA, aot=True)) == 3
    assert len(type_combinations(KDA, aot=False)) == 9
    assert "BF16, FP32, BF16" in type_combinations(LATENT_MLA, aot=False)


def test_aot_kda_launch() -> None:
    grid, scalars = kda_aot_launch(KDA_DIMS[0], KDA_DIMS[2])
    assert grid == (2 * 3, 1)
    assert scalars == [5, 3, 32, 32]  # T, H, K, V


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_aot_kda_kernel_parameter_order(dtype: str) -> None:
    """TensorRT passes the input pointers, then the scalar args, then the output pointers."""
    ptx = compile_variant(kda_aot_kernel(dtype, 32)).asm["ptx"]
    params = re.search(r"\.entry\s+\w+\((.*?)\)", ptx, re.S).group(1)
    kinds = re.findall(r"\.param\s+\.(u64|u32)", params)
    # 6 inputs, T H K V, 2 outputs, then Triton's two scratch pointers.
    assert kinds == ["u64"] * 6 + ["u32"] * 4 + ["u64"] * 2 + ["u64"] * 2
