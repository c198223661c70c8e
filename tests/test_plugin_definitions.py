"""The plugin definitions and the pieces of the tensorrt.plugin AOT registration that run with no
TensorRT: shapes, dtypes, fields, type combinations, launches, and the AOT kernels' compilation for
sm_90 and PTX parameter order (their numerics: tests/kernels; the registration through TensorRT's own
tensorrt.plugin: tests/test_trt_plugin.py)."""

import os
import re

import numpy as np
import pytest

from k3plugins.aot import MAX_SHARED_BYTES, compile_variant, kernel_stats
from k3plugins.definitions import (
    DEFINITIONS,
    KDA,
    KDA_CHUNK_RECURRENCE,
    KDA_PREPARE,
    LATENT_MLA,
    ROUTED_EXPERTS,
    ROUTED_EXPERTS_MXFP4,
    ROUTED_EXPERTS_V2,
)
from k3plugins.trt_aot import (
    kda_aot_kernel,
    kda_aot_launch,
    kda_chunk_recurrence_aot_launch,
    kda_prepare_aot_launch,
    kda_two_node_aot_kernels,
    latent_mla_aot_kernel,
    latent_mla_aot_launch,
    type_combinations,
)

# Under the interpreter @triton.jit yields interpreted functions, which do not compile.
needs_compiler = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                    reason="TRITON_INTERPRET is set: the AOT kernels do not compile")

# q k v g beta initial_state of the tiny model: B=2, T=5, H=3, K=V=32.
KDA_DIMS = [[2, 5, 3, 32], [2, 5, 3, 32], [2, 5, 3, 32], [2, 5, 3, 32], [2, 5, 3], [2, 3, 32, 32]]


def test_lookup_keys_match_the_export() -> None:
    # Every op at version 1 (full TensorRT's tensorrt.plugin registers no other); the routed experts'
    # version 2 stays for the exports of 2026-11/12 that name it.
    assert [(d.name, d.namespace, d.version) for d in DEFINITIONS] == [
        ("KDA", "k3", "1"), ("KDAPrepare", "k3", "1"), ("KDAChunkRecurrence", "k3", "1"),
        ("LatentMLA", "k3", "1"), ("LatentMLASplits", "k3", "1"), ("LatentMLACombine", "k3", "1"),
        ("RoutedExperts", "k3", "1"), ("RoutedExpertsMXFP4", "k3", "1"), ("RoutedExperts", "k3", "2"),
        ("RoutedExpertsMXFP4", "k3", "2"), ("RoutedExpertsGroup", "k3", "1"),
        ("RoutedExpertsGateUp", "k3", "1"), ("RoutedExpertsGateUpMXFP4", "k3", "1"),
        ("RoutedExpertsDown", "k3", "1"), ("RoutedExpertsDownMXFP4", "k3", "1")]


def test_output_shapes() -> None:
    assert KDA.output_shapes(KDA_DIMS, {}, int) == [[2, 5, 3, 32], [2, 3, 32, 32]]
    fields = {"v_dim": 32, "scale": 0.125}
    # q [B, T, H, D], kv [B, 1, capacity, D], cache_lengths [B]. The constant goes through the
    # builder's constructor (here a tag, to see that it is used).
    dims = [[2, 5, 4, 48], [2, 1, 9, 48], [2]]
    assert LATENT_MLA.output_shapes(dims, fields, lambda c: ("const", c)) == [[2, 5, 4, ("const", 32)]]


def test_output_dtypes() -> None:
    assert KDA.output_dtypes(["bfloat16"] * 3 + ["float32"] * 3) == ["bfloat16", "float32"]
    assert LATENT_MLA.output_dtypes(["float16", "float32", "int64"]) == ["float16"]


def test_inputs_and_aliases() -> None:
    assert [a.name for a in LATENT_MLA.inputs] == ["q", "kv", "cache_lengths"]
    # KDA's final state shares the initial state's buffer (updated in place); nothing else aliases.
    assert [KDA.aliased_input(i) for i in range(2)] == [-1, 5]
    assert LATENT_MLA.aliased_input(0) == -1


def test_supported_dtypes() -> None:
    half = ["float16"] * 3 + ["float32", "float32", "float32"]
    assert KDA.supports([*half, "float16", "float32"])
    assert KDA.supports(half[:2] + [None] * 6)  # later positions undecided
    assert not KDA.supports(["float16", "float32"])  # q and k differ
    assert not KDA.supports(["float32"] * 5 + ["float16"])  # the state is float32 only
    assert not KDA.supports([*half, "float32"])  # o must be v's dtype
    assert LATENT_MLA.supports(["bfloat16", "float32", "int64", "bfloat16"])
    assert not LATENT_MLA.supports(["float32", "float32", "int32"])  # lengths are int64
    assert not LATENT_MLA.supports(["float32", "float32", "int64", "float16"])  # o is q's dtype



def test_kda_two_node_definitions() -> None:
    """KDA as exports hold it: KDAPrepare's terms (q, k's shape, u v's, a_qk a chunk of 16 columns, decay_last
    one row a chunk: 17 tokens are 2), in v's dtype but decay_last; KDAChunkRecurrence's outputs KDA's, its
    final state in place of its initial state (input 11), and the AOT kernels' type combinations KDA's."""
    q, v = [2, 17, 3, 32], [2, 17, 3, 8]
    assert KDA_PREPARE.output_shapes([q, q, v, q, [2, 17, 3]], {}, int) == [
        q, q, q, v, [2, 17, 3, 16], [2, 2, 3, 32]]
    assert KDA_PREPARE.output_dtypes(["bfloat16"] * 3 + ["float32"] * 2) == ["bfloat16"] * 5 + ["float32"]
    terms = [q, q, q, v, [2, 17, 3, 16], [2, 2, 3, 32]]
    assert KDA_CHUNK_RECURRENCE.output_shapes([q, q, v, q, [2, 17, 3], *terms, [2, 3, 32, 8]], {}, int) == [
        v, [2, 3, 32, 8]]
    assert [KDA_CHUNK_RECURRENCE.aliased_input(i) for i in range(2)] == [-1, 11]
    assert [KDA_PREPARE.aliased_input(i) for i in range(6)] == [-1] * 6
    half = ["float16"] * 3 + ["float32"] * 2
    assert KDA_CHUNK_RECURRENCE.supports([*half, *["float16"] * 5, "float32", "float32", "float16",
                                          "float32"])
    assert not KDA_CHUNK_RECURRENCE.supports([*half, *["float32"] * 5])  # the terms are v's dtype
    assert type_combinations(KDA_PREPARE, aot=True)[1] == "FP16, FP16, FP16, FP32, FP32, " + \
        "FP16, FP16, FP16, FP16, FP16, FP32"
    assert len(type_combinations(KDA_CHUNK_RECURRENCE, aot=True)) == 3
    assert kda_prepare_aot_launch(q) == ((2, 2 * 3), [17, 3])  # chunks x rows and heads; T, H
    recurrence = kda_two_node_aot_kernels("bfloat16", 32, 8)[1]
    assert kda_chunk_recurrence_aot_launch(q, v, recurrence) == ((2 * 3, 1), [17, 3])


@pytest.mark.parametrize(("B", "T", "H", "blocks"), [
    (1, 1, 12, 8), (1, 4, 12, 8), (1, 5, 12, 2), (1, 1, 16, 8), (1, 1, 17, 2), (8, 1, 12, 2), (1, 1, 96, 2),
    (2, 3000, 96, 2)])
def test_kda_chunk_recurrence_grid(B: int, T: int, H: int, blocks: int) -> None:
    """KDAChunkRecurrence's value blocks at V = 128 (bfloat16): 16 columns a program (8 blocks) for a stepped
    call (T <= 4) whose (row, head) pairs x 8 fit in one wave of 132 programs (16 pairs, not 17), else the
    chunk path's 64 (2 blocks); float32's chunk path already takes 16. Evaluated on ints, as TensorRT
    evaluates the expression (tests/test_trt_plugin.py: through TensorRT)."""
    q, v = [B, T, H, 128], [B, T, H, 128]
    recurrence = kda_two_node_aot_kernels("bfloat16", 128, 128)[1]
    assert kda_chunk_recurrence_aot_launch(q, v, recurrence) == ((B * H, blocks), [T, H])
    fp32 = kda_two_node_aot_kernels("float32", 128, 128)[1]
    assert kda_chunk_recurrence_aot_launch(q, v, fp32)[0] == (B * H, 8)


def test_routed_experts_definitions() -> None:
    """k3.RoutedExperts(MXFP4) as k3export/onnx/moe.py writes it: u [N, L] float32 like z; the fields are
    the node's SiTU betas; float experts of any float dtype, packed ones int32 words (uint8 refused:
    the export declares the bytes as words so that TensorRT-RTX keeps them packed)."""
    z, experts = [5, 64], [5, 2]
    plain = [z, experts, experts, [8, 32, 64], [8, 32, 64], [8, 64, 32]]
    assert ROUTED_EXPERTS.output_shapes(plain, {}, int) == [[5, 64]]
    assert [a.name for a in ROUTED_EXPERTS_MXFP4.inputs] == [
        "z", "experts", "weights", "w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale"]
    assert ROUTED_EXPERTS.output_dtypes(["bfloat16", "int64", "float32", *["bfloat16"] * 3]) == ["float32"]
    assert ROUTED_EXPERTS.supports(["float16", "int64", *["float32"] * 5])  # experts of another dtype
    assert not ROUTED_EXPERTS.supports(["float16", "int64", "float16"])  # routing weights are float32
    assert ROUTED_EXPERTS_MXFP4.supports(["bfloat16", "int64", "float32", *["int32"] * 6, "float32"])
    assert not ROUTED_EXPERTS_MXFP4.supports(["bfloat16", "int64", "float32", "uint8"])
    assert not ROUTED_EXPERTS_MXFP4.supports(["bfloat16", "int64", "float32", "float16"])
    # expert_offset (expert parallelism) is 0 on a node without it.
    fields = {"situ_beta": 4.0, "situ_linear_beta": 25.0}
    assert ROUTED_EXPERTS_MXFP4.parse_fields(fields) == {**fields, "expert_offset": 0}
    assert ROUTED_EXPERTS.parse_fields({**fields, "expert_offset": np.array([448])})["expert_offset"] == 448
    assert ROUTED_EXPERTS.version == "1" and ROUTED_EXPERTS_V2.version == "2"
    assert ROUTED_EXPERTS_V2.fields == ROUTED_EXPERTS.fields
    assert ROUTED_EXPERTS.aliased_input(0) == -1


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
    assert "BF16, FP32, INT64, BF16" in type_combinations(LATENT_MLA, aot=False)


def test_aot_kda_launch() -> None:
    grid, scalars = kda_aot_launch(KDA_DIMS[0], KDA_DIMS[2])
    assert grid == (2 * 3, 1)
    assert scalars == [5, 3, 32, 32]  # T, H, K, V


def parameter_kinds(ptx: str) -> list[str]:
    """The PTX types of the kernel entry's parameters: u64 for pointers, u32 for int32 scalars."""
    params = re.search(r"\.entry\s+\w+\((.*?)\)", ptx, re.S).group(1)
    return re.findall(r"\.param\s+\.(u64|u32)", params)


@needs_compiler
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_aot_kda_kernel_parameter_order(dtype: str) -> None:
    """TensorRT passes the input pointers, then the scalar args, then the output pointers."""
    ptx = compile_variant(kda_aot_kernel(dtype, 32)).asm["ptx"]
    # 6 inputs, T H K V, 2 outputs, then Triton's two scratch pointers.
    assert parameter_kinds(ptx) == ["u64"] * 6 + ["u32"] * 4 + ["u64"] * 2 + ["u64"] * 2


@needs_compiler
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_aot_kda_two_node_kernels_parameter_order(dtype: str) -> None:
    """KDAPrepare: 5 inputs, T H, 6 outputs; KDAChunkRecurrence: 12 inputs, T H, 2 outputs (K and V compiled
    in); then Triton's two scratch pointers."""
    prepare, recurrence = (compile_variant(v).asm["ptx"] for v in kda_two_node_aot_kernels(dtype, 32, 32))
    assert parameter_kinds(prepare) == ["u64"] * 5 + ["u32"] * 2 + ["u64"] * 6 + ["u64"] * 2
    assert parameter_kinds(recurrence) == ["u64"] * 12 + ["u32"] * 2 + ["u64"] * 2 + ["u64"] * 2


def test_aot_latent_mla_launch() -> None:
    # q [B, T, H, D], kv [B, 1, C, D]: one program per token and block of 16 heads; one split, or
    # split_count's (the grid's z: at most 264 programs): 2 x 37 x 1 programs before the splits, 96 heads 6
    # head blocks.
    grid, scalars = latent_mla_aot_launch([2, 37, 3, 48], [2, 1, 40, 48])
    assert grid == (2 * 37, 1, 1)
    assert scalars == [37, 40, 3]  # T, C, H
    assert latent_mla_aot_launch([2, 37, 3, 48], [2, 1, 40, 48], splits=True) == ((2 * 37, 1, 3), [37, 40, 3])
    published = latent_mla_aot_launch([4, 1, 96, 576], [4, 1, 1000, 576], splits=True)
    assert published == ((4, 6, 11), [1, 1000, 96])


def test_aot_latent_mla_kernel_refuses_unbuilt_widths() -> None:
    with pytest.raises(ValueError, match="D=100, v_dim=64"):
        latent_mla_aot_kernel("float16", "float16", 100, 64, 0.1, 12)


@needs_compiler
# The published widths compile in tests/test_aot.py (for sm_90a and sm_100a).
@pytest.mark.parametrize(("head_dim", "v_dim", "scale"), [(48, 32, 32**-0.5)], ids=["tiny"])
@pytest.mark.parametrize(("dtype", "kv_dtype"), [("float32", "float32"), ("float16", "float16"),
                                                 ("bfloat16", "bfloat16"), ("float16", "float32")])
def test_aot_latent_mla_kernel_compiles(dtype: str, kv_dtype: str, head_dim: int, v_dim: int,
                                        scale: float) -> None:
    """One launch with no workspace, for sm_90 without spills; TensorRT passes q, kv and
    cache_lengths, then T, C, H, then o (the scale and widths are compiled in)."""
    kernel = compile_variant(latent_mla_aot_kernel(dtype, kv_dtype, head_dim, v_dim, scale, 12))
    stats = kernel_stats(kernel)
    assert stats.shared_bytes <= MAX_SHARED_BYTES["sm90"], stats
    assert stats.spill_stores == 0 and stats.spill_loads == 0, stats
    # q, kv, cache_lengths; T, C, H; o; then Triton's two scratch pointers.
    assert parameter_kinds(kernel.asm["ptx"]) == ["u64"] * 3 + ["u32"] * 3 + ["u64"] + ["u64"] * 2
