"""The plugin registrations as TensorRT itself takes them.

Full TensorRT's: `k3plugins.trt_aot.register` runs through TensorRT 11's own `tensorrt.plugin` (the
tensorrt-cu13-bindings wheel's Python over TensorRT-RTX, tests/trt_plugin_shim.py) in a fresh process
(tests/trt_plugin_worker.py): TensorRT's validation of every register / autotune / impl / aot_impl function,
its creator, and its AOT plugin class calling our descriptors, autotune and aot_impls at the published widths
(the aot_impls compile PTX for sm_90a). What no CPU can run: TensorRT's C++ builder, whose dimension
expressions the worker stands in for. TensorRT-RTX's: `k3plugins.trt.register`, twice in one process.
And the dtype tables of both against every dtype a k3 node can carry.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import trt_plugin_worker as worker

import k3plugins.trt
from k3export.cli import main
from k3export.config import PRESETS, K3Config
from k3export.engine.flavours import load_tensorrt
from k3export.onnx.moe import GROUPED_SCHEMAS, ROUTED_EXPERTS_MXFP4_SCHEMA, ROUTED_EXPERTS_SCHEMA
from k3export.onnx.ops import (
    KDA_CHUNK_RECURRENCE_SCHEMA,
    KDA_PREPARE_SCHEMA,
    KDA_SCHEMA,
    LATENT_MLA_COMBINE_SCHEMA,
    LATENT_MLA_SCHEMA,
    LATENT_MLA_SPLITS_SCHEMA,
)
from k3plugins import trt_aot
from k3plugins.definitions import (
    DEFINITIONS,
    GROUPED_EXPERTS,
    KDA,
    KDA_CHUNK_RECURRENCE,
    KDA_PREPARE,
    LATENT_MLA,
    LATENT_MLA_COMBINE,
    LATENT_MLA_SPLITS,
    ROUTED_EXPERTS,
    ROUTED_EXPERTS_MXFP4,
)
from k3plugins.mla import COMBINE_BLOCK_V, DECODE, split_count

OPS = (KDA, KDA_PREPARE, KDA_CHUNK_RECURRENCE, LATENT_MLA, LATENT_MLA_SPLITS, LATENT_MLA_COMBINE,
       ROUTED_EXPERTS, ROUTED_EXPERTS_MXFP4, *GROUPED_EXPERTS)
TRT_NAMES = {"float32": "DataType.FLOAT", "float16": "DataType.HALF", "bfloat16": "DataType.BF16",
             "int64": "DataType.INT64", "int32": "DataType.INT32"}

# Under the interpreter @triton.jit yields interpreted functions, which do not compile.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="TRITON_INTERPRET is set: the AOT kernels do not compile")


def run_worker(*args: str, env: dict[str, str] | None = None) -> dict:
    """The RESULT line of tests/trt_plugin_worker.py run with `args` in a fresh process."""
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "trt_plugin_worker.py"), *args],
                          capture_output=True, text=True, timeout=600, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def through_tensorrt() -> dict:
    """What TensorRT's tensorrt.plugin made of trt_aot's functions (registered twice in the process).
    The process fails, with TensorRT's message, where TensorRT refuses a function or a second registration."""
    return run_worker()


def test_jit_impl_takes_every_dtype_through_tensorrt() -> None:
    """TensorRT's JIT plugin class enqueues KDA and LatentMLA (one node and two each) in float32, float16 and
    bfloat16: its `enqueue`
    hands our `impl` `tensorrt.plugin` Tensors (whose `__cuda_array_interface__` raises for BF16), and the
    impl's launch writes what the definition's own launch writes (KDA's state in place). On the CPU: the
    kernels in Triton's interpreter over host memory (tests/trt_plugin_shim.py, `use_host_memory`)."""
    launched = run_worker("jit", env={**os.environ, "TRITON_INTERPRET": "1"})
    ops = ("KDA", "KDAPrepare", "KDAChunkRecurrence", "LatentMLA", "LatentMLASplits", "LatentMLACombine")
    assert launched == {f"{op} {dtype}": True for op in ops for dtype in ("float32", "float16", "bfloat16")}


def test_tensorrt_registers_every_op_once_per_process(through_tensorrt: dict) -> None:
    """TensorRT validates each function as it decorates it (an aot_impl needs its return annotation) and
    refuses a second definition of an op: `register` runs twice in the worker."""
    assert through_tensorrt["ops"] == sorted(d.name for d in OPS)


@pytest.mark.parametrize("definition", OPS, ids=lambda d: d.name)
def test_descriptors_and_autotune_through_tensorrt(through_tensorrt: dict, definition) -> None:
    """In each model dtype, TensorRT's plugin gives the outputs the dtypes the network declares (u float32,
    o the model's, the KDA state float32) and aliases KDA's state; our autotune, parsed by TensorRT, offers
    the network's types (the MXFP4 words int32); the output dims are the definition's at those sizes; the
    node's attributes reach the plugin as its fields."""
    config = K3Config.from_preset("kimi-k3")
    dims = [[worker.SIZES.get(d, d) for d in ds] for ds in worker.published_inputs(config)[definition.name]]
    # The creator TensorRT made from our register function declares the fields the definition takes.
    assert through_tensorrt[definition.name]["fields"] == [f.name for f in definition.fields]
    for dtype, seen in through_tensorrt[definition.name]["dtypes"].items():
        network = [TRT_NAMES[t] for t in worker.network_dtypes(definition, dtype)]
        assert seen["network"] == network
        assert seen["output_dtypes"] == network[len(definition.inputs):]
        assert seen["aliases"] == [definition.aliased_input(i) for i in range(len(definition.outputs))]
        assert network in seen["combinations"]
        fields = {"v_dim": config.kv_lora_rank, "num_experts": worker.EXPERTS_HELD}
        assert seen["output_dims"] == definition.output_shapes(dims, fields, int)


def test_aot_launches_through_tensorrt(through_tensorrt: dict) -> None:
    """The bfloat16 AOT plugins' launches at the published widths, as TensorRT read them from our aot_impls
    (B = 2, T = 37, C = 4096 cache rows, N = 9 tokens): a grid covering the work, one block of the kernel's
    warps, its shared memory, the int32 scalars, and PTX for sm_90a whose entry is the named kernel."""
    c = K3Config.from_preset("kimi-k3")
    B, T, C, N, S = (worker.SIZES[k] for k in "BTCNS")
    H, V = c.linear_attn_config.num_heads, c.linear_attn_config.head_dim
    heads = c.num_attention_heads
    shared = trt_aot.shared_memory(c, worker.EXPERTS_HELD)
    E, P, L, I = worker.EXPERTS_HELD, worker.SIZES["P"], c.routed_expert_hidden_size, c.moe_intermediate_size
    tiles = math.ceil(P / 16) + min(E, P)
    expected = {
        # One program per (batch, head) and 32 value columns; scalars T, H, K, V.
        "KDA": ((B * H, math.ceil(V / trt_aot.BLOCK_V)), [T, H, V, V], "kda_aot_bf16_k128"),
        # KDA's two nodes: a program per (16-token chunk, batch x head); then per (batch x head, 64 value
        # columns); scalars T, H (K and V compiled in).
        "KDAPrepare": ((math.ceil(T / 16), B * H), [T, H], "kda_prepare_aot_bf16_k128_v128"),
        "KDAChunkRecurrence": ((B * H, math.ceil(V / 64)), [T, H], "kda_chunk_recurrence_aot_bf16_k128_v128"),
        # One program per (batch, block of DECODE.block_t tokens) and block of heads; scalars T, C, H.
        "LatentMLA": ((B * math.ceil(T / DECODE.block_t), math.ceil(heads / DECODE.block_h)), [T, C, heads],
                      "latent_mla_aot_bf16_kvbf16_d576_v512_many_heads"),
        # The same, over split_count's splits (the grid's z); then a program per (query, head) row and 64
        # value columns, scalars the rows and the splits (the partials' first dim).
        "LatentMLASplits": ((B * math.ceil(T / DECODE.block_t), math.ceil(heads / DECODE.block_h),
                             split_count(B, T, heads)), [T, C, heads],
                            "latent_mla_splits_aot_bf16_kvbf16_d576_v512_many_heads"),
        "LatentMLACombine": ((B * T * heads, math.ceil(c.kv_lora_rank / COMBINE_BLOCK_V)), [B * T * heads, S],
                             "latent_mla_combine_aot_bf16_v512"),
        # One program per token and 256 output columns; every width compiled in.
        "RoutedExperts": ((N, math.ceil(c.routed_expert_hidden_size / 256)), [],
                          "routed_experts_aot_bf16_wbf16_l3584_i3072_e112_k16"),
        "RoutedExpertsMXFP4": ((N, math.ceil(c.routed_expert_hidden_size / 256)), [],
                               "routed_experts_aot_bf16_wmxfp4_l3584_i3072_e112_k16"),
        # The grouping: one program per local expert and one for the pairs held elsewhere; scalar N k.
        "RoutedExpertsGroup": ((E + 1, 1), [P], "moe_group_e112_offset0"),
        # Tactic 0 (none chosen): the decode tiles; moe.max_tiles' bound by I (or L) / 64 rows; scalar k.
        "RoutedExpertsGateUp": ((tiles, I // 64), [P // N], "moe_gate_up_decode_bf16_wbf16_l3584_i3072_e112"),
        "RoutedExpertsGateUpMXFP4": ((tiles, I // 64), [P // N],
                                     "moe_gate_up_decode_bf16_wmxfp4_l3584_i3072_e112"),
        "RoutedExpertsDown": ((tiles, L // 64), [], "moe_down_decode_bf16_wbf16_l3584_i3072_e112"),
        "RoutedExpertsDownMXFP4": ((tiles, L // 64), [], "moe_down_decode_bf16_wmxfp4_l3584_i3072_e112"),
    }
    for name, (grid, scalars, variant) in expected.items():
        seen = through_tensorrt[name]["dtypes"]["bfloat16"]
        launch = seen["launch"]
        assert (launch["grid_x"], launch["grid_y"], launch["grid_z"]) == (*grid, 1)[:3], name
        assert launch["block_x"] % 32 == 0 and (launch["block_y"], launch["block_z"]) == (1, 1), name
        assert launch["shared_mem"] == shared[variant], name
        assert seen["scalars"] == scalars and set(seen["scalar_dtypes"]) <= {"PluginArgDataType.INT32"}, name
        assert seen["ptx_target"] == "sm_90a" and seen["ptx_entry"] == seen["kernel"], name


def test_tensorrt_rtx_registration_is_idempotent() -> None:
    """k3plugins.trt.register twice in one process: the same creators, one of each in TensorRT-RTX's
    registry (which would otherwise hold a second creator under one name, or refuse it)."""
    trt = load_tensorrt("tensorrt-rtx")
    first, second = k3plugins.trt.register(trt), k3plugins.trt.register(trt)
    assert first.keys() == second.keys() and all(first[k] is second[k] for k in first)
    keys = [(c.name, c.plugin_version, c.plugin_namespace) for c in trt.get_plugin_registry().all_creators
            if c.plugin_namespace == "k3"]
    assert sorted(keys) == sorted({(d.name, d.version, d.namespace) for d in DEFINITIONS})


def dtype_name(elem_type: int) -> str:
    """An ONNX element type's dtype name ("float32", "bfloat16", "int32", ...), definitions.py's names."""
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).name


def carried_dtypes() -> set[str]:
    """Every dtype a k3 node's inputs and outputs can carry: the ONNX schemas' types (an export passes
    `onnx.checker.check_model(full_check=True)` against them, every preset and experts format alike) and
    the plugin definitions' groups."""
    types = set()
    for schema in (KDA_SCHEMA, KDA_PREPARE_SCHEMA, KDA_CHUNK_RECURRENCE_SCHEMA, LATENT_MLA_SCHEMA,
                   LATENT_MLA_SPLITS_SCHEMA, LATENT_MLA_COMBINE_SCHEMA, ROUTED_EXPERTS_SCHEMA,
                   ROUTED_EXPERTS_MXFP4_SCHEMA, *GROUPED_SCHEMAS):
        types |= {t for c in schema.type_constraints for t in c.allowed_type_strs}
        types |= {p.type_str for p in schema.inputs + schema.outputs if p.type_str.startswith("tensor(")}
    names = {dtype_name(getattr(onnx.TensorProto, t.removeprefix("tensor(").removesuffix(")").upper()))
             for t in types}
    return names | {d for definition in DEFINITIONS for group in definition.groups.values() for d in group}


def test_dtype_tables_hold_every_carried_dtype() -> None:
    """trt_aot's tables (descriptors and autotune codes; int32: the packed experts' words) and trt.py's
    map every dtype a k3 node carries, to TensorRT's data type of that name."""
    trt = load_tensorrt("tensorrt-rtx")
    carried = carried_dtypes()
    assert {"float32", "float16", "bfloat16", "int64", "int32"} <= carried
    aot_names = trt_aot._dtype_names(trt)
    for table in (aot_names, k3plugins.trt._dtype_names(trt)):
        assert carried <= set(table.values())
        assert all(str(t) == TRT_NAMES[name] for t, name in table.items() if name in carried)
    for definition in OPS:
        assert trt_aot.type_combinations(definition, aot=True)  # every code known (KeyError otherwise)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["as-stored", "mxfp4-packed"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_export_carries_types_the_aot_plugins_take(preset: str, dtype: str, packed: bool,
                                                         tmp_path: Path) -> None:
    """Layers 0:4 of each preset (dense, MoE, KDA and MLA layers) exported without weights in each dtype and
    experts format: every k3 node's input and output dtypes are in trt_aot's tables, and together one of
    its AOT autotune combinations (about 40 s an export: `-m slow`)."""
    assert main(["export", "--preset", preset, "--no-weights", "--layers", "0:4", "--dtype", dtype, "--quiet",
                 "--aot-plugins", "--out", str(tmp_path), *(["--packed-experts"] if packed else [])]) == 0
    graph = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output, *graph.value_info]}
    types |= {t.name: t.data_type for t in graph.initializer}
    definitions = {(d.name, d.version): d for d in DEFINITIONS}
    ops = set()
    for node in graph.node:
        if node.domain == "k3":
            version = next(a.s.decode() for a in node.attribute if a.name == "plugin_version")
            tensors = [*node.input, *node.output]
            codes = ", ".join(trt_aot._AUTOTUNE_CODES[dtype_name(types[n])] for n in tensors)
            assert codes in trt_aot.type_combinations(definitions[node.op_type, version], aot=True), node.name
            ops.add(node.op_type)
    form = "MXFP4" if packed else ""
    assert ops == {"KDAPrepare", "KDAChunkRecurrence", "LatentMLASplits", "LatentMLACombine",
                   "RoutedExpertsGroup", "RoutedExpertsGateUp" + form, "RoutedExpertsDown" + form}

