"""Full TensorRT's `tensorrt.plugin` registration of the k3 ops, each compiled ahead of time.

Run here through full TensorRT's own `tensorrt.plugin` (TensorRT 11.4: the tensorrt-cu13-bindings wheel's
plain Python, over TensorRT-RTX's module; tests/test_trt_plugin.py): its validation of every function, its
registration (twice in a process), its creator and AOT plugin class calling the descriptors, autotune and
`aot_impl`s at the published widths, the PTX for sm_90a. What only a GPU host runs: TensorRT's C++ builder
(whose dimension expressions the tests stand in for), the engine, the kernels' launches. The kernels'
numerics are tested in Triton's interpreter (tests/kernels), their PTX for sm_90a and sm_100a in
tests/test_aot.py.

    k3export build --onnx DIR --backend tensorrt --target sm90   # calls register(tensorrt) itself

This is full TensorRT's one registration of each op (k3export.engine.flavours; TensorRT-RTX
registers the IPluginV3 adapters of k3plugins.trt instead). Each `aot_impl` compiles its kernel for
the GPU the build runs on (`aot.device_target()`: sm_90a on H100/H200, sm_100a on B200) and the
engine holds the PTX, so it runs with no Python. KDA and LatentMLA also keep a just-in-time `impl`
(Python at run time); the builder sets PREFER_AOT_PYTHON_PLUGINS, so the AOT form is built. The
routed experts' nodes have the AOT form only.

An AOT plugin is one kernel launch with no workspace and int32 scalar arguments only, so:
- KDA is two nodes in the graph (k3export/onnx/ops.py), so that its chunk terms are graph tensors between
  two launches: KDAPrepare runs kda.py's parallel prepare over (16-token chunk, batch x head), and
  KDAChunkRecurrence its recurrence over the chunks, the state on chip (chunk_kda's two kernels, at the
  JIT plugin's blocks). A call of at most KDA_STEP_TOKENS tokens (decode, a short verify call) steps the
  recurrence from the token inputs in KDAChunkRecurrence, the state read and written once (16 value columns
  a program where the (row, head) pairs are few, KDA_NARROW_BV: the grid says which), and KDAPrepare
  writes nothing. The one-node KDA of earlier exports keeps its one-launch kernel (float16 and bfloat16
  walk chunks of 16 tokens with each chunk's prepare work in the dependent chain, `_fused_chunk_kda_kernel`;
  float32 runs the recurrence, its chunked form spilling registers).
- LatentMLA is two nodes in the graph (k3export/onnx/ops.py), so that its partials are a graph tensor
  between two launches: LatentMLASplits runs the attention kernel over `mla.split_count` splits of each
  row's visible cache (the grid's z; 16 heads of a token a program, each cache block loaded once for
  them), writing float32 partials and their lse; LatentMLACombine weighs them into o. The one-node
  LatentMLA of earlier exports runs the same kernel as one split. `scale`, the head dim and `v_dim` are
  model constants, taken from the node and compiled in as constexprs (an AOT scalar cannot be a
  float).
- The routed experts are three nodes in the graph (k3export/onnx/moe.py), so that they run grouped by
  expert with their intermediates graph tensors: RoutedExpertsGroup (k3plugins.moe's grouping kernel, E + 1
  programs; E and the expert offset compiled in, N k a scalar), RoutedExpertsGateUp(MXFP4) writing h and
  RoutedExpertsDown(MXFP4) writing y (the grouped GEMMs, widths, E and the SiTU betas compiled in, k a
  scalar; decode and prefill tiles as two tactics, GROUPED_TACTICS, which TensorRT times per profile);
  each token's slots are summed in standard ops after them. The one-node RoutedExperts(MXFP4) of
  earlier exports runs one program per token and block of 256 output columns over its k slots (the
  gate/up products recomputed for each column block: 0.28% of the HBM bound at decode in
  tools/kernel_estimate.py, where the grouped nodes give 32%).
- KDA's final state (KDAChunkRecurrence's, the one-node KDA's) is declared aliased to its initial state
  (`TensorDesc.aliased()`), as the IPluginV3 adapters declare it: every KDA kernel is safe in place.
- Every AOT kernel asks at most the 48 KB of dynamic shared memory a CUDA launch gets without raising the
  kernel's limit (DEFAULT_SHARED_BYTES; `shared_memory`, tests/test_aot.py), since nothing in TensorRT's
  open sources says its AOT launch raises it. LatentMLA takes two pipeline stages, and in float32 its value
  columns in slices of 128, one pass over the cache each: at the published widths 37,376 B in float16 and
  bfloat16, 28,672 B in float32 (55,808 and 111,680 B before).
An AOT kernel's parameters must be the inputs, then the scalars, then the outputs; the Triton kernels
take the outputs earlier, so the `_kda_*_aot_kernel`s and the `_latent_mla_*_aot_kernel`s reorder them.
A compiled kernel also has Triton's two trailing scratch pointers, which TensorRT does not pass:
tests/test_aot.py refuses an AOT kernel whose scratch sizes are not 0.

`tensorrt.plugin` registers every plugin as version "1" (its plugin class sets plugin_version = "1":
tensorrt_bindings/plugin/_plugin_class.py, which `tensorrt.plugin` re-exports), so every k3 node names
version 1 (the routed experts' carry expert_offset there).
"""

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from k3plugins import kda, moe
from k3plugins.aot import compile_variant, device_target
from k3plugins.definitions import (
    KDA,
    KDA_CHUNK_RECURRENCE,
    KDA_PREPARE,
    LATENT_MLA,
    LATENT_MLA_COMBINE,
    LATENT_MLA_SPLITS,
    ROUTED_EXPERTS,
    ROUTED_EXPERTS_DOWN,
    ROUTED_EXPERTS_DOWN_MXFP4,
    ROUTED_EXPERTS_GATE_UP,
    ROUTED_EXPERTS_GATE_UP_MXFP4,
    ROUTED_EXPERTS_GROUP,
    ROUTED_EXPERTS_MXFP4,
    PluginDefinition,
)
from k3plugins.kda import (
    CHUNK_SIZE,
    _fused_chunk_kda_kernel,
    _kda_chunk_recurrence_kernel,
    _kda_prepare_kernel,
    _recurrent_kda_kernel,
)
from k3plugins.mla import (
    COMBINE_BLOCK_V,
    COMBINE_SPLITS,
    COMBINE_WARPS,
    DECODE,
    DECODE_MANY_HEADS,
    SPLIT_ROWS,
    _mla_attn_kernel,
    _mla_combine_kernel,
    block_dims,
    decode_tiles,
    split_count,
)
from k3plugins.moe import _tanh, _weight_tile
from k3plugins.trt import launch_from_pointers
from k3plugins.variants import KernelVariant

_TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# The dynamic shared memory a CUDA kernel may take without cudaFuncSetAttribute(
# cudaFuncAttributeMaxDynamicSharedMemorySize): 48 KB on every GPU since Volta.
DEFAULT_SHARED_BYTES = 48 * 1024

# KDA's chunk (tokens; kda.py's, 16: a chunk's decay stays within e^-80 at the published gate bound g >= -5,
# so the factored scores always apply) and value columns per program: 64 halves the programs against 32, and
# with them the chunks' state-free work each repeats (measured on the one-node kernel, which keeps it:
# tools/kernel_estimate.py on an H100, prefill at T = 8192 5.2 ms at 96 heads against 7.7 at 32 columns).
# KDAChunkRecurrence's chunk path takes it too (213 registers, 35,328 B of shared memory, no spills; 1.06 ms
# at 96 heads); its decode step takes 16 columns where the call has few (row, head) pairs (its launch's grid).
KDA_CHUNK = CHUNK_SIZE
BLOCK_V = 64
# Calls of at most this many tokens (decode; a verify call of 3 drafts) step the recurrence in float16 and
# bfloat16 too: compiled for sm_90a, a token's step is 475 SASS instructions a warp with 6 shuffles and no
# barrier, a chunk of 16 tokens about 2,060 with 150 barriers and shuffles (docs/kernels.md): the recurrence
# costs less up to 4 tokens, by issue slots and with tools/kernel_estimate.py's latency terms alike.
KDA_STEP_TOKENS = 4
# A stepped call whose (row, head) pairs are few (12 heads a rank at batch 1) steps NARROW_BV value columns a
# program, not the chunk path's 64, while those programs fit in one wave of an H100 (132 SMs; the kernel holds
# one program an SM at the chunk path's 213 registers): 96 programs at 12 heads and batch 1, not 24, each
# stepping a quarter of the state (16 lanes along the key channels: 4 shuffles a sum, not 2). Past one wave
# the chunk path's 64 columns take less issue a column (tools/kernel_estimate.py, docs/kernels.md).
KDA_NARROW_BV = 16
KDA_NARROW_PROGRAMS = 132


@triton.jit
def _kda_aot_chunk_kernel(q, k, v, g, beta, h0, T, H, K, V, o, ht, BT: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, LANES_K: tl.constexpr, SHORT_K: tl.constexpr,
                          STEP_TOKENS: tl.constexpr):
    # One AOT kernel serves every profile (aot_impl sees T only as a symbol), so the call's T picks the path
    # at run time: decode and short verify calls step the recurrence, reading and writing the state once.
    if T <= STEP_TOKENS:
        _recurrent_kda_kernel(q, k, v, g, beta, h0, o, ht, T, H, K, V, BK, BV, LANES_K, SHORT_K)
    else:
        _fused_chunk_kda_kernel(q, k, v, g, beta, h0, o, ht, T, H, K, V, BT, BK, BV)


@triton.jit
def _kda_aot_recurrent_kernel(q, k, v, g, beta, h0, T, H, K, V, o, ht, BK: tl.constexpr, BV: tl.constexpr,
                              LANES_K: tl.constexpr, SHORT_K: tl.constexpr):
    _recurrent_kda_kernel(q, k, v, g, beta, h0, o, ht, T, H, K, V, BK, BV, LANES_K, SHORT_K)


def kda_aot_kernel(dtype: str, head_dim: int) -> KernelVariant:
    """The AOT KDA kernel for q, k, v, o in `dtype` ("float32", ...) and key head dim `head_dim`;
    g, beta and the states are float32. Float16 and bfloat16 walk chunks of KDA_CHUNK tokens, their
    products on tensor cores (kda.py's `_fused_chunk_kda_kernel`), and a call of at most KDA_STEP_TOKENS
    tokens steps the recurrence (`_recurrent_kda_kernel`, chosen at run time from T); float32 runs the
    recurrence, token by token: its chunked form's float32 products over 128 key channels
    spill registers (88 bytes at the best setting tried, 8 warps and TF32x3)."""
    block_k = next((bk for bk in (32, 64, 128) if bk >= head_dim), None)
    if block_k is None:
        raise ValueError(f"KDA head dim K={head_dim}: the kernels support K <= 128")
    t = _TRITON_DTYPES[dtype]
    signature = {"q": f"*{t}", "k": f"*{t}", "v": f"*{t}", "g": "*fp32", "beta": "*fp32", "h0": "*fp32",
                 "T": "i32", "H": "i32", "K": "i32", "V": "i32", "o": f"*{t}", "ht": "*fp32"}
    if dtype == "float32":
        # 8 warps: 32 state elements a thread at K = 128 (at 4, 64 of them spill).
        fn, num_warps = _kda_aot_recurrent_kernel, 8
        lanes = kda.step_lanes(BLOCK_V, num_warps)
        constexprs = {"BK": block_k, "BV": BLOCK_V, "LANES_K": lanes,
                      "SHORT_K": kda.short_k(head_dim, block_k, lanes)}
    else:
        # 8 warps: at 4 the chunk's tiles spill (255 registers either way).
        fn, num_warps = _kda_aot_chunk_kernel, 8
        lanes = kda.step_lanes(BLOCK_V, num_warps)
        constexprs = {"BT": KDA_CHUNK, "BK": block_k, "BV": BLOCK_V, "LANES_K": lanes,
                      "SHORT_K": kda.short_k(head_dim, block_k, lanes), "STEP_TOKENS": KDA_STEP_TOKENS}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    # The model's KDA heads are head_dim wide in q, k and v: at a multiple of 16 (every preset) the token
    # rows' offsets are aligned and the loads vectorise.
    aligned = ("K", "V") if head_dim % 16 == 0 else ()
    return KernelVariant(f"kda_aot_{t}_k{block_k}", fn, signature, constexprs, num_warps, num_stages=1,
                         divisible_by_16=aligned)


def kda_aot_launch(q_dims: Sequence[Any], v_dims: Sequence[Any]) -> tuple[tuple[Any, Any], list[Any]]:
    """(grid, scalar args T, H, K, V) from q [B, T, H, K] and v [B, T, H, V]; the dims may be ints
    or `tensorrt.plugin` shape expressions (only +, * and // are used)."""
    B, T, H, K = q_dims
    V = v_dims[3]
    return (B * H, (V + BLOCK_V - 1) // BLOCK_V), [T, H, K, V]


@triton.jit
def _kda_prepare_aot_kernel(q, k, v, g, beta, T, H, qg, kt, w, u, a_qk, decay_last, BT: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, STEP_TOKENS: tl.constexpr, K: tl.constexpr,
                            V: tl.constexpr):
    # A call the recurrence node steps (T <= STEP_TOKENS) reads none of the terms: nothing to write.
    if T > STEP_TOKENS:
        _kda_prepare_kernel(q, k, v, g, beta, qg, kt, w, u, a_qk, decay_last, T, H, K, V, BT, BK, BV)


@triton.jit
def _kda_chunk_recurrence_aot_kernel(q, k, v, g, beta, qg, kt, w, u, a_qk, decay_last, h0, T, H, o, ht,
                                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                     LANES_K: tl.constexpr, SHORT_K: tl.constexpr,
                                     STEP_TOKENS: tl.constexpr, NARROW_BV: tl.constexpr,
                                     NARROW_LANES_K: tl.constexpr, NARROW_SHORT_K: tl.constexpr,
                                     K: tl.constexpr, V: tl.constexpr):
    # As _kda_aot_chunk_kernel, T picks the path at run time: decode and short verify calls step the
    # recurrence from the token inputs (the state read and written once), longer calls walk the terms.
    if T <= STEP_TOKENS:
        # The step takes the mapping the grid was given (kda_chunk_recurrence_aot_launch): NARROW_BV value
        # columns a program where a grid of them fits in one wave, else the chunk path's BV.
        if NARROW_BV < BV and tl.num_programs(1) > tl.cdiv(V, BV):
            _recurrent_kda_kernel(q, k, v, g, beta, h0, o, ht, T, H, K, V, BK, NARROW_BV, NARROW_LANES_K,
                                  NARROW_SHORT_K)
        else:
            _recurrent_kda_kernel(q, k, v, g, beta, h0, o, ht, T, H, K, V, BK, BV, LANES_K, SHORT_K)
    else:
        _kda_chunk_recurrence_kernel(qg, kt, w, u, a_qk, decay_last, h0, o, ht, T, H, K, V, BT, BK, BV)


def kda_two_node_aot_kernels(dtype: str, head_dim: int,
                             value_dim: int) -> tuple[KernelVariant, KernelVariant]:
    """The AOT kernels of KDAPrepare and KDAChunkRecurrence for q, k, v, o and the terms in `dtype` (g, beta,
    decay_last and the states float32): kda.py's prepare and chunk recurrence at the JIT plugin's blocks and
    stages (RECURRENCE_BLOCKS: 64 value columns and 2 stages in float16 / bfloat16, 16 and 1 in float32), in
    TensorRT's parameter order, with the short-call rule (KDA_STEP_TOKENS). The head and value widths K and
    V are compiled in, as the other ops' widths: their masks and address arithmetic fold (the recurrence's
    one-token step, sm_90a bf16 at 128 x 128: 319 SASS a warp on its 16-column path, 346 with them
    scalars)."""
    t = _TRITON_DTYPES[dtype]
    x, f32, block_k = f"*{t}", "*fp32", kda._block_k(head_dim)
    sizes = {"T": "i32", "H": "i32"}
    widths = {"K": head_dim, "V": value_dim}
    tokens = {"q": x, "k": x, "v": x, "g": f32, "beta": f32}
    terms = {"qg": x, "kt": x, "w": x, "u": x, "a_qk": x, "decay_last": f32}
    recurrence_kernel = kda.RECURRENCE[t]
    common = {"BT": KDA_CHUNK, "BK": block_k, "STEP_TOKENS": KDA_STEP_TOKENS, **widths}
    prepare_constexprs = {**common, "BV": kda.PREPARE.blocks["BV"]}
    block_v = recurrence_kernel.blocks["BV"]
    lanes = kda.step_lanes(block_v, recurrence_kernel.num_warps)
    narrow_v = min(block_v, KDA_NARROW_BV)
    narrow_lanes = kda.step_lanes(narrow_v, recurrence_kernel.num_warps)
    recurrence_constexprs = {**common, "BV": block_v, "LANES_K": lanes,
                             "SHORT_K": kda.short_k(head_dim, block_k, lanes), "NARROW_BV": narrow_v,
                             "NARROW_LANES_K": narrow_lanes,
                             "NARROW_SHORT_K": kda.short_k(head_dim, block_k, narrow_lanes)}
    prepare = KernelVariant(f"kda_prepare_aot_{t}_k{head_dim}_v{value_dim}", _kda_prepare_aot_kernel,
                            {**tokens, **sizes, **terms, **dict.fromkeys(prepare_constexprs, "constexpr")},
                            prepare_constexprs, kda.PREPARE.num_warps, kda.PREPARE.num_stages)
    recurrence = KernelVariant(f"kda_chunk_recurrence_aot_{t}_k{head_dim}_v{value_dim}",
                               _kda_chunk_recurrence_aot_kernel,
                               {**tokens, **terms, "h0": f32, **sizes, "o": x, "ht": f32,
                                **dict.fromkeys(recurrence_constexprs, "constexpr")},
                               recurrence_constexprs, recurrence_kernel.num_warps,
                               recurrence_kernel.num_stages)
    return prepare, recurrence


def kda_prepare_aot_launch(q_dims: Sequence[Any]) -> tuple[tuple[Any, Any], list[Any]]:
    """(grid: chunks x rows and heads, scalar args T, H) from q [B, T, H, K]."""
    B, T, H, _ = q_dims
    return ((T + KDA_CHUNK - 1) // KDA_CHUNK, B * H), [T, H]


def kda_chunk_recurrence_aot_launch(q_dims: Sequence[Any], v_dims: Sequence[Any], variant: KernelVariant,
                                    minimum: Any = min,
                                    maximum: Any = max) -> tuple[tuple[Any, Any], list[Any]]:
    """(grid: rows and heads x blocks of value columns, scalar args T, H). The blocks are the kernel's
    BV columns, or NARROW_BV for a stepped call (T <= KDA_STEP_TOKENS) whose grid of NARROW_BV blocks is at
    most KDA_NARROW_PROGRAMS: the kernel reads which from its grid. The dims may be ints or `tensorrt.plugin`
    shape expressions (then `minimum`, `maximum` are tensorrt.plugin's min and max; its expressions take no
    int on the left of an operator): x > c is min(x // (c + 1), 1), 1 or 0 for x >= 0."""
    B, T, H, _ = q_dims
    V = v_dims[3]
    wide, narrow = ((V + variant.constexprs[bv] - 1) // variant.constexprs[bv] for bv in ("BV", "NARROW_BV"))
    # 1 where the call walks chunks or its narrow grid passes one wave: the chunk path's blocks.
    wide_call = maximum(minimum(T // (KDA_STEP_TOKENS + 1), 1),
                        minimum(B * H * narrow // (KDA_NARROW_PROGRAMS + 1), 1))
    return (B * H, narrow - (narrow - wide) * wide_call), [T, H]


# Value columns a float32 LatentMLA AOT program accumulates at once (a pass over the cache each).
MLA_FP32_SLICE = 128


@triton.jit
def _latent_mla_aot_kernel(q, kv, cache_lengths, T, C, H, o, D: tl.constexpr, V_DIM: tl.constexpr,
                           SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_S: tl.constexpr, BDV: tl.constexpr, BDR: tl.constexpr,
                           V_SLICES: tl.constexpr):
    # One split (grid z = 1) of at least C rows covers each row's visible rows: o written directly, no lse.
    _mla_attn_kernel(q, kv, cache_lengths, o, None, T, C, H, C, SCALE, D, V_DIM, BLOCK_T, BLOCK_H, BLOCK_S,
                     BDV, BDR, V_SLICES)


@triton.jit
def _latent_mla_splits_aot_kernel(q, kv, cache_lengths, T, C, H, o_part, lse, D: tl.constexpr,
                                  V_DIM: tl.constexpr, SCALE: tl.constexpr, BLOCK_T: tl.constexpr,
                                  BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BDV: tl.constexpr,
                                  BDR: tl.constexpr, V_SLICES: tl.constexpr, SPLIT_ROWS: tl.constexpr):
    # The grid's third axis is the split count: o_part [S, B, T, H, V_DIM] and lse [S, B, T, H], float32.
    _mla_attn_kernel(q, kv, cache_lengths, o_part, lse, T, C, H, SPLIT_ROWS, SCALE, D, V_DIM, BLOCK_T,
                     BLOCK_H, BLOCK_S, BDV, BDR, V_SLICES)


@triton.jit
def _latent_mla_combine_aot_kernel(q, o_part, lse, n_rows, n_splits, o, V_DIM: tl.constexpr,
                                   BLOCK_V: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
    # q gives the node its output's dtype and shape; it is not read.
    _mla_combine_kernel(o_part, lse, o, n_rows, n_splits, V_DIM, BLOCK_V, BLOCK_SPLITS)


def latent_mla_aot_kernel(dtype: str, kv_dtype: str, head_dim: int, v_dim: int, scale: float, heads: int,
                          splits: bool = False) -> KernelVariant:
    """The AOT LatentMLA attention kernel for q in `dtype`, the cache in `kv_dtype` (cast to `dtype` as it
    is loaded, as `latent_mla` does), head dim `head_dim`, value width `v_dim`, softmax `scale` and `heads`
    query heads (the tile: `mla.decode_tiles`): one split writing o in `dtype` (k3::LatentMLA), or the
    splits' float32 partials and lse (`splits`: k3::LatentMLASplits, combined by
    `latent_mla_combine_aot_kernel`'s node)."""
    bdv, bdr = block_dims(head_dim, v_dim)
    # The decode tile (16 heads of a token share each block of cache rows) with two pipeline stages, and
    # float32's value columns in slices of MLA_FP32_SLICE: within the 48 KB of dynamic shared memory a
    # launch gets (DEFAULT_SHARED_BYTES) at the published widths on sm_90a and sm_100a (half precision
    # 37,376 B; with three stages 55,808 B, and a whole 512-wide float32 block 73,728 B).
    tiles = decode_tiles(heads, half=dtype != "float32")
    value_slices = max(1, bdv // MLA_FP32_SLICE) if dtype == "float32" else 1
    t, t_kv = _TRITON_DTYPES[dtype], _TRITON_DTYPES[kv_dtype]
    outputs = {"o_part": "*fp32", "lse": "*fp32"} if splits else {"o": f"*{t}"}
    signature = {"q": f"*{t}", "kv": f"*{t_kv}", "cache_lengths": "*i64", "T": "i32", "C": "i32", "H": "i32",
                 **outputs}
    constexprs = {"D": head_dim, "V_DIM": v_dim, "SCALE": scale, "BLOCK_T": tiles.block_t,
                  "BLOCK_H": tiles.block_h, "BLOCK_S": tiles.block_s, "BDV": bdv, "BDR": bdr,
                  "V_SLICES": value_slices, **({"SPLIT_ROWS": SPLIT_ROWS} if splits else {})}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    fn = _latent_mla_splits_aot_kernel if splits else _latent_mla_aot_kernel
    many = "_many_heads" if tiles == DECODE_MANY_HEADS else ""
    name = f"latent_mla_{'splits_' if splits else ''}aot_{t}_kv{t_kv}_d{head_dim}_v{v_dim}{many}"
    return KernelVariant(name, fn, signature, constexprs, tiles.num_warps, tiles.num_stages)


def latent_mla_aot_launch(q_dims: Sequence[Any], kv_dims: Sequence[Any],
                          splits: bool = False) -> tuple[tuple[Any, Any, Any], list[Any]]:
    """(grid, scalar args T, C, H) from q [B, T, H, D] and kv [B, 1, C, D]: one split, or `split_count`'s
    (the partials' first dim); the dims may be ints or `tensorrt.plugin` shape expressions."""
    B, T, H, _ = q_dims
    C = kv_dims[2]
    block_t, block_h = DECODE.block_t, DECODE.block_h
    n_splits = split_count(B, T, H) if splits else 1
    return (B * ((T + block_t - 1) // block_t), (H + block_h - 1) // block_h, n_splits), [T, C, H]


def latent_mla_combine_aot_kernel(dtype: str, v_dim: int) -> KernelVariant:
    """The AOT LatentMLACombine kernel: o [B, T, H, v_dim] in `dtype` from the splits' partials."""
    t = _TRITON_DTYPES[dtype]
    signature = {"q": f"*{t}", "o_part": "*fp32", "lse": "*fp32", "n_rows": "i32", "n_splits": "i32",
                 "o": f"*{t}"}
    constexprs = {"V_DIM": v_dim, "BLOCK_V": COMBINE_BLOCK_V, "BLOCK_SPLITS": COMBINE_SPLITS}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return KernelVariant(f"latent_mla_combine_aot_{t}_v{v_dim}", _latent_mla_combine_aot_kernel, signature,
                         constexprs, COMBINE_WARPS)


def latent_mla_combine_aot_launch(part_dims: Sequence[Any]) -> tuple[tuple[Any, Any], list[Any]]:
    """(grid, scalar args n_rows, n_splits) from o_part [S, B, T, H, v_dim]: a program per (query, head)
    row and COMBINE_BLOCK_V value columns."""
    S, B, T, H, v_dim = part_dims
    n_rows = B * T * H
    return (n_rows, (v_dim + COMBINE_BLOCK_V - 1) // COMBINE_BLOCK_V), [n_rows, S]


@triton.jit
def _routed_experts_token(z, experts, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, u,
                          PACKED: tl.constexpr, L: tl.constexpr, I: tl.constexpr, E: tl.constexpr,
                          TOP_K: tl.constexpr, OFFSET: tl.constexpr, BETA: tl.constexpr,
                          LINEAR_BETA: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_I: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    # Token n's output columns l0 .. l0 + BLOCK_L over its k slots: for each slot held here, h of one
    # I block at a time (gate/up reduced over L, rounded to z's dtype as the eager op does), then its
    # share of the down projection. Every program owns its outputs: no atomics, no zeroing, and the
    # sum over the slots is in a fixed order. The gate/up work is repeated for each L block.
    n = tl.program_id(0).to(tl.int64)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    mask_l = offs_l < L
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for j in range(TOP_K):
        e = tl.load(experts + n * TOP_K + j) - OFFSET
        if (e >= 0) & (e < E):  # pairs routed to experts held elsewhere add nothing
            e = e.to(tl.int64)
            routing = tl.load(weights + n * TOP_K + j)
            for i0 in range(0, I, BLOCK_I):
                offs_i = i0 + tl.arange(0, BLOCK_I)
                mask_i = offs_i < I
                a = tl.zeros([BLOCK_I], dtype=tl.float32)
                b = tl.zeros([BLOCK_I], dtype=tl.float32)
                for k0 in range(0, L, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    x = tl.load(z + n * L + offs_k, mask=offs_k < L, other=0.0)
                    gate = _weight_tile(w1, w1_scale, e * I + offs_i, mask_i, k0, L, x.dtype, PACKED, BLOCK_I,
                                        BLOCK_K)
                    up = _weight_tile(w3, w3_scale, e * I + offs_i, mask_i, k0, L, x.dtype, PACKED, BLOCK_I,
                                      BLOCK_K)
                    xf = x.to(tl.float32)[None, :]
                    a += tl.sum(gate.to(tl.float32) * xf, axis=1)
                    b += tl.sum(up.to(tl.float32) * xf, axis=1)
                h = BETA * _tanh(a / BETA) * tl.sigmoid(a) * (LINEAR_BETA * _tanh(b / LINEAR_BETA))
                h = h.to(z.dtype.element_ty).to(tl.float32)
                down = _weight_tile(w2, w2_scale, e * L + offs_l, mask_l, i0, I, z.dtype.element_ty, PACKED,
                                    BLOCK_L, BLOCK_I)
                acc += routing * tl.sum(down.to(tl.float32) * h[None, :], axis=1)
    tl.store(u + n * L + offs_l, acc, mask=mask_l)


@triton.jit
def _routed_experts_aot_kernel(z, experts, weights, w1, w3, w2, u, L: tl.constexpr, I: tl.constexpr,
                               E: tl.constexpr, TOP_K: tl.constexpr, OFFSET: tl.constexpr,
                               BETA: tl.constexpr, LINEAR_BETA: tl.constexpr, BLOCK_L: tl.constexpr,
                               BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr):
    _routed_experts_token(z, experts, weights, w1, None, w3, None, w2, None, u, False, L, I, E, TOP_K, OFFSET,
                          BETA, LINEAR_BETA, BLOCK_L, BLOCK_I, BLOCK_K)


@triton.jit
def _routed_experts_mxfp4_aot_kernel(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                                     w2_scale, u, L: tl.constexpr, I: tl.constexpr, E: tl.constexpr,
                                     TOP_K: tl.constexpr, OFFSET: tl.constexpr, BETA: tl.constexpr,
                                     LINEAR_BETA: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_I: tl.constexpr,
                                     BLOCK_K: tl.constexpr):
    _routed_experts_token(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                          u, True, L, I, E, TOP_K, OFFSET, BETA, LINEAR_BETA, BLOCK_L, BLOCK_I, BLOCK_K)


# Output columns per program, intermediate rows per step, reduction step (a multiple of 32: MXFP4
# scale groups); sized so that no variant spills on sm_90a or sm_100a (tests/test_aot.py).
MOE_BLOCK_L, MOE_BLOCK_I, MOE_BLOCK_K = 256, 16, 64
MOE_NUM_WARPS = 4


def routed_experts_aot_kernel(dtype: str, packed: bool, L: int, I: int, E: int, top_k: int,
                              expert_offset: int, beta: float, linear_beta: float) -> KernelVariant:
    """The AOT RoutedExperts (float experts in `dtype`) or RoutedExpertsMXFP4 (int32 words) kernel for
    z in `dtype`: the model's widths L and I, the E experts held (model experts expert_offset ..),
    top_k and the SiTU betas compiled in (static in the network; an AOT scalar cannot be a float)."""
    if packed and (L % 32 or I % 32):
        raise ValueError(f"RoutedExpertsMXFP4: L={L} and I={I} must be multiples of 32")
    t = _TRITON_DTYPES[dtype]
    weight = "*i32" if packed else f"*{t}"
    names = ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale") if packed \
        else ("w1", "w3", "w2")
    signature = {"z": f"*{t}", "experts": "*i64", "weights": "*fp32", **dict.fromkeys(names, weight),
                 "u": "*fp32"}
    constexprs = {"L": L, "I": I, "E": E, "TOP_K": top_k, "OFFSET": expert_offset, "BETA": beta,
                  "LINEAR_BETA": linear_beta, "BLOCK_L": MOE_BLOCK_L, "BLOCK_I": MOE_BLOCK_I,
                  "BLOCK_K": MOE_BLOCK_K}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    fn = _routed_experts_mxfp4_aot_kernel if packed else _routed_experts_aot_kernel
    form = "mxfp4" if packed else t
    return KernelVariant(f"routed_experts_aot_{t}_w{form}_l{L}_i{I}_e{E}_k{top_k}", fn, signature, constexprs,
                         MOE_NUM_WARPS)


def routed_experts_aot_launch(z_dims: Sequence[Any], L: int) -> tuple[tuple[Any, Any], list[Any]]:
    """(grid, scalar args: none) from z [N, L]; N may be a `tensorrt.plugin` shape expression."""
    return (z_dims[0], (L + MOE_BLOCK_L - 1) // MOE_BLOCK_L), []


# Every dtype a k3 node carries (definitions.py's names, which are also `tensorrt`'s names of the data
# types) -> its AutoTuneCombination code (tensorrt/plugin/_utils.py, `_str_to_data_type`: "FP32", "FP16",
# else a trt.DataType member's name).
_AUTOTUNE_CODES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "int64": "INT64",
                   "int32": "INT32"}


# The grouped routed experts' tiles as two tactics, so that TensorRT times both for each profile (an aot_impl
# returns one kernel for a profile's shapes): tactic 2 the prefill tiles, any other (0: none chosen) decode's.
GROUPED_TACTICS = {1: "decode", 2: "prefill"}


def grouped_experts_aot_kernels(dtype: str, packed: bool, L: int, I: int, E: int,
                                betas: tuple[float, float] | None,
                                tactic: int = 1) -> tuple[KernelVariant, KernelVariant]:
    """The RoutedExpertsGateUp(MXFP4) and RoutedExpertsDown(MXFP4) kernels (k3plugins.moe's) for activations
    of `dtype` (torch's name) with the widths, the expert count and the SiTU `betas` (gate/up's; None for
    down alone) compiled in (top-k stays a scalar: the nodes see N k, not k), `tactic`'s tiles."""
    mode = GROUPED_TACTICS.get(tactic, "decode")
    tiles = moe.tile_choices(getattr(torch, dtype), packed)[mode]
    constants = {"L": L, "I": I, "E": E, **dict(zip(("BETA", "LINEAR_BETA"), betas or (), strict=False))}
    gate_up, down = moe.grouped_variants(_TRITON_DTYPES[dtype], packed, tiles, mode, constants)
    return gate_up, down


def grouped_experts_aot_grid(variant: KernelVariant, num_pairs: Any, E: int, rows: int,
                             minimum: Any = min) -> tuple[Any, int]:
    """(tiles, row blocks): moe.max_tiles' bound cdiv(N k, BLOCK_P) + min(E, N k) tiles of one expert's pairs
    (those past the rank's own exit at once) by `rows` / BLOCK_W weight rows. `minimum` takes a builder's
    expressions (tensorrt.plugin's min)."""
    block_p, block_w = variant.constexprs["BLOCK_P"], variant.constexprs["BLOCK_W"]
    return ((num_pairs + block_p - 1) // block_p + minimum(num_pairs, E), triton.cdiv(rows, block_w))


def aot_kernels(config: Any, experts_held: int) -> list[KernelVariant]:
    """Every kernel the `aot_impl`s compile for a model `config` (a k3export.config.K3Config, read by
    attribute) whose MoE nodes hold `experts_held` experts, in each float dtype: KDA's prepare and
    recurrence nodes and its one-node form, LatentMLA's split and
    combine nodes and its one-node form (the cache in the model's dtype; the tiles of a rank's few heads and
    of all the model's heads, `mla.decode_tiles`), and the routed experts as float
    tensors and as MXFP4 words: one node, and grouped (the grouping; gate/up and down in both tactics'
    tiles)."""
    L, I = config.routed_expert_hidden_size, config.moe_intermediate_size
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    kernels = []
    for dtype in _TRITON_DTYPES:
        mla = (dtype, dtype, config.latent_dim, config.kv_lora_rank, scale)
        kernels += [kda_aot_kernel(dtype, config.linear_attn_config.head_dim),
                    *kda_two_node_aot_kernels(dtype, config.linear_attn_config.head_dim,
                                              config.linear_attn_config.head_dim),
                    *{v.name: v for heads in (1, config.num_attention_heads) for splits in (False, True)
                      for v in [latent_mla_aot_kernel(*mla, heads, splits)]}.values(),
                    latent_mla_combine_aot_kernel(dtype, mla[3])]
        kernels += [routed_experts_aot_kernel(dtype, packed, L, I, experts_held, config.num_experts_per_token,
                                              0, config.activation_situ_beta,
                                              config.activation_situ_linear_beta)
                    for packed in (False, True)]
        kernels += [kernel for packed in (False, True) for tactic in GROUPED_TACTICS
                    for kernel in grouped_experts_aot_kernels(
                        dtype, packed, L, I, experts_held,
                        (config.activation_situ_beta, config.activation_situ_linear_beta), tactic)]
    return [moe.group_variant({"E": experts_held, "OFFSET": 0}), *kernels]


def shared_memory(config: Any, experts_held: int, target: str = "sm90") -> dict[str, int]:
    """The dynamic shared memory (bytes) each of `aot_kernels(config, experts_held)` asks at launch on
    `target`, by variant name: what an `aot_impl` puts in KernelLaunchParams.shared_mem. Compiles each (no GPU
    needed). A CUDA launch over 48 KB (DEFAULT_SHARED_BYTES) fails unless the kernel's limit was raised."""
    return {v.name: compile_variant(v, target).metadata.shared for v in aot_kernels(config, experts_held)}


def _dtype_names(trt: Any) -> dict[Any, str]:
    return {getattr(trt, name): name for name in _AUTOTUNE_CODES}


def output_descs(trtp: Any, trt: Any, definition: PluginDefinition, descs: Sequence[Any],
             fields: dict[str, Any]) -> tuple[Any, ...]:
    """Output descriptors from the definition; an aliased output is its input's `aliased()`."""
    names = _dtype_names(trt)
    types = {name: t for t, name in names.items()}
    shapes = definition.output_shapes([list(d.shape_expr) for d in descs], fields, int)
    dtypes = definition.output_dtypes([names[d.dtype] for d in descs])
    return tuple(descs[definition.aliased_input(i)].aliased() if definition.aliased_input(i) >= 0
                 else trtp.from_shape_expr(tuple(s), dtype=types[t])
                 for i, (s, t) in enumerate(zip(shapes, dtypes, strict=True)))


def _run(definition: PluginDefinition, names: dict[Any, str], tensors: Sequence[Any], fields: dict[str, Any],
         outputs: Sequence[Any], stream: int) -> None:
    """The JIT `impl`: `tensorrt.plugin` Tensors wrapped from their data pointers, as the IPluginV3 adapters
    do (a Tensor's `__cuda_array_interface__` raises for BF16); `names` maps TensorRT's dtypes to ours."""
    def descs(ts: Sequence[Any]) -> list[tuple[tuple[int, ...], str]]:
        return [(tuple(t.shape), names[t.dtype]) for t in ts]

    launch_from_pointers(definition, fields, descs(tensors), descs(outputs), [t.data_ptr for t in tensors],
                         [t.data_ptr for t in outputs], stream)


def _aot_result(trtp: Any, variant: KernelVariant, grid: tuple[Any, ...],
                scalars: list[Any]) -> tuple[Any, ...]:
    """What an `aot_impl` returns: kernel name, PTX, launch parameters and the scalar arguments."""
    compiled = compile_variant(variant, device_target())  # the build GPU's: sm_90a, sm_100a
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = (*grid, 1)[:3]
    params.block_x = compiled.metadata.num_warps * 32
    params.shared_mem = compiled.metadata.shared
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(s) for s in scalars])
    return compiled.metadata.name, compiled.asm["ptx"], params, extra


def type_combinations(definition: PluginDefinition, aot: bool) -> list[str]:
    """The autotune type combinations, one per choice of dtype for each group, each naming one type
    per position (a string cannot mix tied and independent positions). The AOT KDA kernel takes g
    and beta in float32 only."""
    groups = dict(definition.groups)
    if aot and definition in (KDA, KDA_PREPARE, KDA_CHUNK_RECURRENCE):
        groups["TG"] = ("float32",)
    combinations = []
    for choice in itertools.product(*groups.values()):
        dtype = dict(zip(groups, choice, strict=True))
        tensors = definition.inputs + definition.outputs
        combinations.append(", ".join(_AUTOTUNE_CODES[dtype[a.group]] for a in tensors))
    return combinations


@functools.cache
def register(trt: Any) -> dict[str, Any]:
    """Registers k3::KDA (and KDAPrepare, KDAChunkRecurrence), k3::LatentMLA (and LatentMLASplits,
    LatentMLACombine), k3::RoutedExperts and
    k3::RoutedExpertsMXFP4 with
    `tensorrt.plugin` (`trt` is full TensorRT's module; k3export.engine.flavours calls this for it).
    Returns no creators: tensorrt.plugin keeps its own.
    Once per process (cached): every build and engine activation calls this, and `tensorrt.plugin`
    refuses a second definition of an op ("already has a defintion", tensorrt/plugin/_lib.py)."""
    import tensorrt.plugin as trtp

    Desc = trtp.TensorDesc
    # What tensorrt.plugin requires an aot_impl to declare it returns (tensorrt/plugin/_validate.py,
    # `_validate_aot_impl`): kernel name, PTX, launch parameters, scalar arguments. Each aot_impl takes every
    # attribute, in the register function's order: the AOT plugin passes them all, positionally
    # (tensorrt/plugin/_plugin_class.py, `get_launch_params`), though validation allows a subset.
    AotResult = tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]
    names = _dtype_names(trt)

    @trtp.register("k3::KDA")
    def kda_desc(q: Desc, k: Desc, v: Desc, g: Desc, beta: Desc, initial_state: Desc) -> tuple[Desc, Desc]:
        return output_descs(trtp, trt, KDA, (q, k, v, g, beta, initial_state), {})

    @trtp.autotune("k3::KDA")
    def kda_autotune(q, k, v, g, beta, initial_state, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(c) for c in type_combinations(KDA, aot=True)]

    @trtp.impl("k3::KDA")
    def kda_impl(q, k, v, g, beta, initial_state, outputs, stream: int) -> None:
        _run(KDA, names, (q, k, v, g, beta, initial_state), {}, outputs, stream)

    @trtp.aot_impl("k3::KDA")
    def kda_aot(q, k, v, g, beta, initial_state, outputs, tactic: int) -> AotResult:
        head_dim = q.shape_expr[3].constant_value()  # the model's head dim: static
        grid, scalars = kda_aot_launch(list(q.shape_expr), list(v.shape_expr))
        return _aot_result(trtp, kda_aot_kernel(names[v.dtype], head_dim), grid, scalars)

    @trtp.register("k3::KDAPrepare")
    def kda_prepare_desc(q: Desc, k: Desc, v: Desc, g: Desc,
                         beta: Desc) -> tuple[Desc, Desc, Desc, Desc, Desc, Desc]:
        return output_descs(trtp, trt, KDA_PREPARE, (q, k, v, g, beta), {})

    @trtp.autotune("k3::KDAPrepare")
    def kda_prepare_autotune(q, k, v, g, beta, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(c) for c in type_combinations(KDA_PREPARE, aot=True)]

    @trtp.impl("k3::KDAPrepare")
    def kda_prepare_impl(q, k, v, g, beta, outputs, stream: int) -> None:
        _run(KDA_PREPARE, names, (q, k, v, g, beta), {}, outputs, stream)

    @trtp.aot_impl("k3::KDAPrepare")
    def kda_prepare_aot(q, k, v, g, beta, outputs, tactic: int) -> AotResult:
        variant = kda_two_node_aot_kernels(names[v.dtype], q.shape_expr[3].constant_value(),
                                           v.shape_expr[3].constant_value())[0]
        grid, scalars = kda_prepare_aot_launch(list(q.shape_expr))
        return _aot_result(trtp, variant, grid, scalars)

    @trtp.register("k3::KDAChunkRecurrence")
    def kda_chunk_recurrence_desc(q: Desc, k: Desc, v: Desc, g: Desc, beta: Desc, qg: Desc, kt: Desc, w: Desc,
                                  u: Desc, a_qk: Desc, decay_last: Desc,
                                  initial_state: Desc) -> tuple[Desc, Desc]:
        inputs = (q, k, v, g, beta, qg, kt, w, u, a_qk, decay_last, initial_state)
        return output_descs(trtp, trt, KDA_CHUNK_RECURRENCE, inputs, {})

    @trtp.autotune("k3::KDAChunkRecurrence")
    def kda_chunk_recurrence_autotune(q, k, v, g, beta, qg, kt, w, u, a_qk, decay_last, initial_state,
                                      outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(c) for c in type_combinations(KDA_CHUNK_RECURRENCE, aot=True)]

    @trtp.impl("k3::KDAChunkRecurrence")
    def kda_chunk_recurrence_impl(q, k, v, g, beta, qg, kt, w, u, a_qk, decay_last, initial_state, outputs,
                                  stream: int) -> None:
        inputs = (q, k, v, g, beta, qg, kt, w, u, a_qk, decay_last, initial_state)
        _run(KDA_CHUNK_RECURRENCE, names, inputs, {}, outputs, stream)

    @trtp.aot_impl("k3::KDAChunkRecurrence")
    def kda_chunk_recurrence_aot(q, k, v, g, beta, qg, kt, w, u, a_qk, decay_last, initial_state, outputs,
                                 tactic: int) -> AotResult:
        variant = kda_two_node_aot_kernels(names[v.dtype], q.shape_expr[3].constant_value(),
                                           v.shape_expr[3].constant_value())[1]
        grid, scalars = kda_chunk_recurrence_aot_launch(list(q.shape_expr), list(v.shape_expr), variant,
                                                        trtp.min, trtp.max)
        return _aot_result(trtp, variant, grid, scalars)

    @trtp.register("k3::LatentMLA")
    def latent_mla_desc(q: Desc, kv: Desc, cache_lengths: Desc, v_dim: int, scale: float) -> Desc:
        fields = {"v_dim": v_dim, "scale": scale}
        return output_descs(trtp, trt, LATENT_MLA, (q, kv, cache_lengths), fields)[0]

    @trtp.autotune("k3::LatentMLA")
    def latent_mla_autotune(q, kv, cache_lengths, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(c) for c in type_combinations(LATENT_MLA, aot=True)]

    @trtp.impl("k3::LatentMLA")
    def latent_mla_impl(q, kv, cache_lengths, v_dim: int, scale: float, outputs, stream: int) -> None:
        _run(LATENT_MLA, names, (q, kv, cache_lengths), {"v_dim": v_dim, "scale": scale}, outputs, stream)

    @trtp.aot_impl("k3::LatentMLA")
    def latent_mla_aot(q, kv, cache_lengths, v_dim: int, scale: float, outputs, tactic: int) -> AotResult:
        head_dim = q.shape_expr[3].constant_value()  # the latent width: static
        heads = q.shape_expr[2].constant_value()  # the rank's heads: static
        variant = latent_mla_aot_kernel(names[q.dtype], names[kv.dtype], head_dim, v_dim, scale, heads)
        grid, scalars = latent_mla_aot_launch(list(q.shape_expr), list(kv.shape_expr))
        return _aot_result(trtp, variant, grid, scalars)

    @trtp.register("k3::LatentMLASplits")
    def latent_mla_splits_desc(q: Desc, kv: Desc, cache_lengths: Desc, v_dim: int,
                               scale: float) -> tuple[Desc, Desc]:
        fields = {"v_dim": v_dim, "scale": scale}
        return output_descs(trtp, trt, LATENT_MLA_SPLITS, (q, kv, cache_lengths), fields)

    @trtp.autotune("k3::LatentMLASplits")
    def latent_mla_splits_autotune(q, kv, cache_lengths, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(c) for c in type_combinations(LATENT_MLA_SPLITS, aot=True)]

    @trtp.impl("k3::LatentMLASplits")
    def latent_mla_splits_impl(q, kv, cache_lengths, v_dim: int, scale: float, outputs, stream: int) -> None:
        _run(LATENT_MLA_SPLITS, names, (q, kv, cache_lengths), {"v_dim": v_dim, "scale": scale}, outputs,
             stream)

    @trtp.aot_impl("k3::LatentMLASplits")
    def latent_mla_splits_aot(q, kv, cache_lengths, v_dim: int, scale: float, outputs,
                              tactic: int) -> AotResult:
        head_dim = q.shape_expr[3].constant_value()  # the latent width: static
        heads = q.shape_expr[2].constant_value()  # the rank's heads: static
        variant = latent_mla_aot_kernel(names[q.dtype], names[kv.dtype], head_dim, v_dim, scale, heads,
                                        splits=True)
        grid, scalars = latent_mla_aot_launch(list(q.shape_expr), list(kv.shape_expr), splits=True)
        return _aot_result(trtp, variant, grid, scalars)

    @trtp.register("k3::LatentMLACombine")
    def latent_mla_combine_desc(q: Desc, o_part: Desc, lse: Desc) -> Desc:
        return output_descs(trtp, trt, LATENT_MLA_COMBINE, (q, o_part, lse), {})[0]

    @trtp.autotune("k3::LatentMLACombine")
    def latent_mla_combine_autotune(q, o_part, lse, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(c) for c in type_combinations(LATENT_MLA_COMBINE, aot=True)]

    @trtp.impl("k3::LatentMLACombine")
    def latent_mla_combine_impl(q, o_part, lse, outputs, stream: int) -> None:
        _run(LATENT_MLA_COMBINE, names, (q, o_part, lse), {}, outputs, stream)

    @trtp.aot_impl("k3::LatentMLACombine")
    def latent_mla_combine_aot(q, o_part, lse, outputs, tactic: int) -> AotResult:
        v_dim = o_part.shape_expr[4].constant_value()  # the value width: static
        grid, scalars = latent_mla_combine_aot_launch(list(o_part.shape_expr))
        return _aot_result(trtp, latent_mla_combine_aot_kernel(names[q.dtype], v_dim), grid, scalars)

    def routed_experts_result(z, experts, w1, packed: bool, situ_beta: float, situ_linear_beta: float,
                              expert_offset: int) -> AotResult:
        # Every width is static in the network: L (z's), I (w1's rows, or its words' count), E, k.
        L = z.shape_expr[1].constant_value()
        rows = w1.shape_expr[1].constant_value()
        variant = routed_experts_aot_kernel(names[z.dtype], packed, L, 8 * rows // L if packed else rows,
                                            w1.shape_expr[0].constant_value(),
                                            experts.shape_expr[1].constant_value(), expert_offset, situ_beta,
                                            situ_linear_beta)
        grid, scalars = routed_experts_aot_launch(list(z.shape_expr), L)
        return _aot_result(trtp, variant, grid, scalars)

    @trtp.register("k3::RoutedExperts")
    def routed_experts_desc(z: Desc, experts: Desc, weights: Desc, w1: Desc, w3: Desc, w2: Desc,
                            situ_beta: float, situ_linear_beta: float, expert_offset: int) -> Desc:
        return output_descs(trtp, trt, ROUTED_EXPERTS, (z, experts, weights, w1, w3, w2), {})[0]

    @trtp.autotune("k3::RoutedExperts")
    def routed_experts_autotune(z, experts, weights, w1, w3, w2, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(c) for c in type_combinations(ROUTED_EXPERTS, aot=True)]

    @trtp.aot_impl("k3::RoutedExperts")
    def routed_experts_aot(z, experts, weights, w1, w3, w2, situ_beta: float, situ_linear_beta: float,
                           expert_offset: int, outputs, tactic: int) -> AotResult:
        return routed_experts_result(z, experts, w1, False, situ_beta, situ_linear_beta, expert_offset)

    @trtp.register("k3::RoutedExpertsMXFP4")
    def routed_experts_mxfp4_desc(z: Desc, experts: Desc, weights: Desc, w1_packed: Desc, w1_scale: Desc,
                                  w3_packed: Desc, w3_scale: Desc, w2_packed: Desc, w2_scale: Desc,
                                  situ_beta: float, situ_linear_beta: float, expert_offset: int) -> Desc:
        tensors = (z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)
        return output_descs(trtp, trt, ROUTED_EXPERTS_MXFP4, tensors, {})[0]

    @trtp.autotune("k3::RoutedExpertsMXFP4")
    def routed_experts_mxfp4_autotune(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale,
                                      w2_packed, w2_scale, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(c) for c in type_combinations(ROUTED_EXPERTS_MXFP4, aot=True)]

    @trtp.aot_impl("k3::RoutedExpertsMXFP4")
    def routed_experts_mxfp4_aot(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                                 w2_scale, situ_beta: float, situ_linear_beta: float, expert_offset: int,
                                 outputs, tactic: int) -> AotResult:
        return routed_experts_result(z, experts, w1_packed, True, situ_beta, situ_linear_beta, expert_offset)

    def grouped_autotune(definition: PluginDefinition) -> list[Any]:
        return [trtp.AutoTuneCombination(c, tactics=list(GROUPED_TACTICS))
                for c in type_combinations(definition, aot=True)]

    def grouped_result(first: Any, pairs: Any, weight: Any, packed: bool, rows: Any,
                       betas: tuple[float, float] | None, offsets: Any, tactic: int) -> AotResult:
        # first: z (gate/up, betas given) or h (down); rows: the output's width (I or L). Every width static:
        # the first input's, the weights'.
        gate = betas is not None
        width = first.shape_expr[1].constant_value()
        out_rows = 8 * weight.shape_expr[1].constant_value() // width if packed else rows.constant_value()
        L, I = (width, out_rows) if gate else (out_rows, width)
        E = offsets.shape_expr[0].constant_value() - 1
        gate_up, down = grouped_experts_aot_kernels(names[first.dtype], packed, L, I, E, betas, tactic)
        variant = gate_up if gate else down
        num_pairs = pairs.shape_expr[0]
        grid = grouped_experts_aot_grid(variant, num_pairs, E, out_rows, trtp.min)
        # gate/up's one scalar, k = N k / N (the kernel's token of a pair); down has none.
        return _aot_result(trtp, variant, grid, [num_pairs // first.shape_expr[0]] if gate else [])

    @trtp.register("k3::RoutedExpertsGroup")
    def group_desc(experts: Desc, num_experts: int, expert_offset: int) -> tuple[Desc, Desc, Desc]:
        return output_descs(trtp, trt, ROUTED_EXPERTS_GROUP, (experts,), {"num_experts": num_experts})

    @trtp.autotune("k3::RoutedExpertsGroup")
    def group_autotune(experts, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(c) for c in type_combinations(ROUTED_EXPERTS_GROUP, aot=True)]

    @trtp.aot_impl("k3::RoutedExpertsGroup")
    def group_aot(experts, num_experts: int, expert_offset: int, outputs, tactic: int) -> AotResult:
        variant = moe.group_variant({"E": num_experts, "OFFSET": expert_offset})
        pairs = experts.shape_expr[0] * experts.shape_expr[1]
        return _aot_result(trtp, variant, (num_experts + 1, 1), [pairs])

    @trtp.register("k3::RoutedExpertsGateUp")
    def gate_up_desc(z: Desc, sorted_pairs: Desc, offsets: Desc, w1: Desc, w3: Desc, situ_beta: float,
                     situ_linear_beta: float) -> Desc:
        return output_descs(trtp, trt, ROUTED_EXPERTS_GATE_UP, (z, sorted_pairs, offsets, w1, w3), {})[0]

    @trtp.autotune("k3::RoutedExpertsGateUp")
    def gate_up_autotune(z, sorted_pairs, offsets, w1, w3, outputs) -> list[trtp.AutoTuneCombination]:
        return grouped_autotune(ROUTED_EXPERTS_GATE_UP)

    @trtp.aot_impl("k3::RoutedExpertsGateUp")
    def gate_up_aot(z, sorted_pairs, offsets, w1, w3, situ_beta: float, situ_linear_beta: float, outputs,
                    tactic: int) -> AotResult:
        return grouped_result(z, sorted_pairs, w1, False, w1.shape_expr[1], (situ_beta, situ_linear_beta),
                              offsets, tactic)

    @trtp.register("k3::RoutedExpertsGateUpMXFP4")
    def gate_up_mxfp4_desc(z: Desc, sorted_pairs: Desc, offsets: Desc, w1_packed: Desc, w1_scale: Desc,
                           w3_packed: Desc, w3_scale: Desc, situ_beta: float,
                           situ_linear_beta: float) -> Desc:
        tensors = (z, sorted_pairs, offsets, w1_packed, w1_scale, w3_packed, w3_scale)
        return output_descs(trtp, trt, ROUTED_EXPERTS_GATE_UP_MXFP4, tensors, {})[0]

    @trtp.autotune("k3::RoutedExpertsGateUpMXFP4")
    def gate_up_mxfp4_autotune(z, sorted_pairs, offsets, w1_packed, w1_scale, w3_packed, w3_scale,
                               outputs) -> list[trtp.AutoTuneCombination]:
        return grouped_autotune(ROUTED_EXPERTS_GATE_UP_MXFP4)

    @trtp.aot_impl("k3::RoutedExpertsGateUpMXFP4")
    def gate_up_mxfp4_aot(z, sorted_pairs, offsets, w1_packed, w1_scale, w3_packed, w3_scale,
                          situ_beta: float, situ_linear_beta: float, outputs, tactic: int) -> AotResult:
        return grouped_result(z, sorted_pairs, w1_packed, True, None, (situ_beta, situ_linear_beta), offsets,
                              tactic)

    @trtp.register("k3::RoutedExpertsDown")
    def down_desc(h: Desc, offsets: Desc, w2: Desc) -> Desc:
        return output_descs(trtp, trt, ROUTED_EXPERTS_DOWN, (h, offsets, w2), {})[0]

    @trtp.autotune("k3::RoutedExpertsDown")
    def down_autotune(h, offsets, w2, outputs) -> list[trtp.AutoTuneCombination]:
        return grouped_autotune(ROUTED_EXPERTS_DOWN)

    @trtp.aot_impl("k3::RoutedExpertsDown")
    def down_aot(h, offsets, w2, outputs, tactic: int) -> AotResult:
        return grouped_result(h, h, w2, False, w2.shape_expr[1], None, offsets, tactic)

    @trtp.register("k3::RoutedExpertsDownMXFP4")
    def down_mxfp4_desc(h: Desc, offsets: Desc, w2_packed: Desc, w2_scale: Desc) -> Desc:
        return output_descs(trtp, trt, ROUTED_EXPERTS_DOWN_MXFP4, (h, offsets, w2_packed, w2_scale), {})[0]

    @trtp.autotune("k3::RoutedExpertsDownMXFP4")
    def down_mxfp4_autotune(h, offsets, w2_packed, w2_scale, outputs) -> list[trtp.AutoTuneCombination]:
        return grouped_autotune(ROUTED_EXPERTS_DOWN_MXFP4)

    @trtp.aot_impl("k3::RoutedExpertsDownMXFP4")
    def down_mxfp4_aot(h, offsets, w2_packed, w2_scale, outputs, tactic: int) -> AotResult:
        return grouped_result(h, h, w2_packed, True, None, None, offsets, tactic)

    return {}
