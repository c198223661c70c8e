"""GPU check of the k3plugins Triton kernels: parity with the eager ops, timings, one table.

Written for the lent H200 (torch 2.11, triton 3.6, no TensorRT, nothing downloadable); runs from the
source tree, not an install, and imports only `k3export.ops` (torch) and `k3plugins` (torch, triton,
numpy):

    tools/gpu_check                      # the wrapper sets PYTHONPATH=.:plugins and runs this file
    tools/gpu_check --dry-run            # the planned rows, byte and FLOP counts; no GPU needed
    tools/gpu_check --only mla --dtypes bfloat16 --budget 120
    tools/gpu_check --estimate           # tools/kernel_estimate.py's rows, timed beside its estimate
    PYTHONPATH=.:plugins python3 tools/gpu_check.py ...   # the same without the wrapper

On the device tool: `run` with command `tools/gpu_check` and timeout_s about 560 (add
`carry: [".whl"]` when the fla wheel lies there, see 5.). The table and JSON come back under $OUT.

What it does (about 3 to 6 minutes on an H200; it starts no more of the largest rows after --budget
seconds, default 360, and no row at all after --budget + 90):
1. Measures the ceilings: copy bandwidth (a 2 GiB device-to-device copy, bytes read plus written)
   and the rate of an 8192^3 torch.matmul in bf16 and in fp32 (TF32 off).
2. Runs each kernel on fresh random valid inputs (KDA: k L2-normed, beta in (0, 1), g in (-5, 0],
   q scaled by K^-0.5, a random float32 initial state; MLA: standard normal q and cache) and the
   eager op on the same values in float64 on the GPU: `recurrent_kda` and `chunk_kda` against
   k3export.ops.recurrent_kda / chunk_kda, `latent_mla` decode and prefill against
   torch.ops.k3.latent_mla; up to the published shapes (KDA H=96, K=V=128; MLA H=96, D=576,
   v_dim=512, scale=192^-0.5), in float32, float16 and bfloat16. MLA rows have ragged cache
   lengths (row b sees (B - b) / B of the row's S rows) in a cache of capacity 2 S whose rows past
   each row's length are NaN, so a kernel that read past its row's length returns NaN.
3. Runs the TensorRT plugins' enqueue body, k3plugins.trt.launch_from_pointers, on raw device
   pointers (into NaN-filled output buffers, on a side stream; KDA's final state into its initial
   state's own buffer, as TensorRT aliases them), and the ahead-of-time compiled KDA, LatentMLA and
   routed-experts kernels that k3plugins.trt_aot's aot_impls embed (for this GPU: sm_90a on an
   H200, PTX 8.7), launched directly, each op as an export holds it (the routed experts: the group,
   gate/up and down nodes in the tactic of the rank's own pairs, then the graph's sum in torch).
4. Times each with triton.testing.do_bench (median; the L2 is flushed before each run) and prints
   ONE table: relative error (norm of the difference over the norm of the reference, the largest
   over a row's outputs: o and the final state for KDA), ms, GB/s and TFLOP/s from the counts in
   `cost`, and %ceil: the row's floor over its time, the floor being the larger of bytes over the
   copy bandwidth and FLOPs over the matrix rate that applies (`floor_ms`). So decode rows are
   mostly measured against the copy bandwidth and prefill rows against the matrix rate; the column
   `ceil` says which.
5. The routed experts (k3plugins.moe) at the published widths (L=3584, I=3072, k=16; MXFP4 experts
   with all E=896 in memory, float experts with E=128 to bound memory, 59 GB in bf16 at 896): decode
   (N = 1, 4, 16 tokens) and prefill-sized batches (N = 512, 8192), against the eager op in float64,
   and the RoutedExpertsMXFP4 plugin's enqueue body at decode (plugin:MoE_MXFP4). The routing is a
   fixed draw per row (distinct experts per token), so the bytes are exact: the chosen experts'
   weights (each distinct expert read once) plus z, u and the routing. Decode rows are bound by
   reading those weights; their %ceil is the fraction of the measured copy bandwidth, and a note
   line gives it against the H200's nominal 4.8 TB/s too. NOT YET RUN on a GPU (written where none
   is): the MoE rows' timings will be the first measurement of the kernel's speed.
6. The anchor: where flash-linear-attention's `fla` imports, or its wheel (fla_core-*.whl, pure
   Python) can be installed from tools/wheels, shared/wheels, .whl or --wheels (pip --no-index
   --no-deps into a temporary folder), times fla.ops.kda's chunk_kda beside our chunk_kda at
   T >= 1000 and its fused_recurrent_kda beside our recurrent_kda (decode) on the same inputs (the same
   [B, T, H, K] layout and natural-log per-channel gate; our q is already scaled, so scale=1.0) in
   --fla-dtypes (default bfloat16), and prints ours / fla. fla autotunes on its first call per kernel
   and dtype: that counts in the elapsed time, not in its timings.

Exit status: 1 if any row's error exceeds its tolerance (TOLERANCE below), is NaN, or the row raised;
2 if there is no CUDA device; the whole table is printed first either way. With $OUT set (the device
tool) or --out DIR, the table and a JSON of every row are written there too.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda"  # where inputs are drawn (a CPU smoke test of the glue may set "cpu")
DTYPES = ("float32", "float16", "bfloat16")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NAMES = {**{v: k for k, v in TORCH_DTYPES.items()}, torch.int64: "int64", torch.int32: "int32",
         torch.uint8: "uint8"}
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# Relative-error bounds against the float64 reference on the same (rounded) inputs. Every product in
# the kernels is a float32 FMA ("ieee") dot or a half-precision tensor-core dot with float32
# accumulation, never TF32, so float32 is held tight; half rows lose bits where the kernels round
# (the attention weights before P V, the outputs).
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}

# The published shapes.
KDA_H, KDA_K, KDA_V = 96, 128, 128
CHUNK = 16  # chunk_kda's chunk length (k3plugins.kda.CHUNK_SIZE)
MLA_H, MLA_D, MLA_VDIM = 96, 576, 512
MLA_SCALE = 192 ** -0.5
MOE_L, MOE_I, MOE_K = 3584, 3072, 16  # routed_expert_hidden_size, moe_intermediate_size, top-k
MOE_E = {"moe_mxfp4": 896, "moe": 128}  # experts in memory: all 896 packed; 128 of them as floats
H200_NOMINAL_GBS = 4800.0  # HBM3e, the data sheet's figure
MOE_BETAS = (4.0, 25.0)  # SiTU-GLU's beta and linear beta

# Leads for the dry run's planned bound (an H200's nominal copy bandwidth and dense bf16 rate; fp32 a
# guess): the GPU run measures them.
NOMINAL_CEILINGS = {"copy": 4300.0, "bf16": 790.0, "fp32": 50.0}  # GB/s, TFLOP/s, TFLOP/s
GRACE_S = 90  # past --budget + GRACE_S no further row starts
FLA_MIN_T = 1000  # the anchor runs where a chunked prefill is long enough to matter
# fla autotunes each kernel of its forward pass (some 80 configurations to compile) on its first call
# per dtype: a dtype not yet tuned starts only this long before the budget runs out.
FLA_TUNE_S = 180
WHEEL_DIRS = ("tools/wheels", "shared/wheels", ".whl")


@dataclass(frozen=True)
class Case:
    """One row: a kernel at one shape and dtype."""

    kernel: str  # recurrent_kda | chunk_kda | mla_decode | mla_prefill | moe | moe_mxfp4 | plugin:KDA |
    #              plugin:LatentMLA | plugin:MoE_MXFP4 | aot:recurrent_kda | aot:latent_mla | aot:moe |
    #              aot:moe_mxfp4
    dtype: str  # of q, k, v (KDA) or q, kv (MLA)
    B: int  # batch; for the MoE rows the tokens N
    T: int
    S: int = 0  # MLA cache rows of the longest row, the T new ones included; 0 for KDA
    gate_dtype: str | None = None  # KDA g and beta; None: the row's dtype
    big: bool = False  # among the largest: not started once the time budget is spent
    heads: int = 0  # KDA or MLA heads; 0: the published 96
    held: int = 0  # MoE: experts held (a rank's, routed as kernel_estimate.moe_routing); 0: MOE_E's
    full: bool = False  # MLA: every row sees S rows (else ragged, mla_lengths)

    @property
    def H(self) -> int:
        return self.heads or (KDA_H if self.is_kda else MLA_H)

    @property
    def shape(self) -> str:
        if self.is_moe:
            return f"N{self.B} E{self.experts}"
        return (f"B{self.B} T{self.T}" + (f" S{self.S}" if self.S else "")
                + (f" H{self.heads}" if self.heads else ""))

    @property
    def is_moe(self) -> bool:
        return "moe" in self.kernel.lower()

    @property
    def packed(self) -> bool:
        return "mxfp4" in self.kernel.lower()

    @property
    def experts(self) -> int:
        return self.held or MOE_E["moe_mxfp4" if self.packed else "moe"]

    @property
    def is_kda(self) -> bool:
        return "kda" in self.kernel.lower()

    @property
    def chunked(self) -> bool:
        """KDA through the chunked kernels (the plugin picks them for T > 1, as torch.ops.k3.kda)."""
        return self.kernel == "chunk_kda" or (self.kernel == "plugin:KDA" and self.T > 1)

    @property
    def matrix(self) -> str:
        """The arithmetic ceiling that applies: KDA's products are float32 FMAs whatever the input
        dtype (the fp32 matmul rate, TF32 off); MLA's half-precision dots run on the tensor cores,
        where fp16 and bf16 share one rate."""
        return "fp32" if self.is_kda or self.dtype == "float32" else "bf16"


def plan(dtypes: Sequence[str]) -> list[Case]:
    """Every row, grouped by kernel and shape, dtype innermost."""
    kda_recurrent = [(1, 1), (8, 1), (64, 1), (1, 64)]  # (B, T): decode steps, and 64 steps in one launch
    kda_chunk = [(B, T) for B in (1, 8) for T in (1, 64, 1000, 4096)]  # ragged T = 1000 included
    mla_decode = [(B, 1, S) for B in (1, 16) for S in (1024, 8192, 65536)] + [(16, 4, 8192)]
    # Prefill with T = S, and a 512-token chunk after 3584 cached rows.
    mla_prefill = [(1, 512, 512), (1, 4096, 4096), (1, 512, 4096)]
    cases: list[Case] = []

    def add(kernel: str, B: int, T: int, S: int = 0, gate: str | None = None, big: bool = False) -> None:
        cases.extend(Case(kernel, d, B, T, S, gate, big) for d in dtypes)

    for B, T in kda_recurrent:
        add("recurrent_kda", B, T, big=B == 64)
    for B, T in kda_chunk:
        add("chunk_kda", B, T, big=T == 4096)
    for B, T, S in mla_decode:
        add("mla_decode", B, T, S, big=S == 65536)
    for B, T, S in mla_prefill:
        add("mla_prefill", B, T, S, big=T == 4096)
    # The plugin path at modest sizes, g and beta kept float32 as a half-precision model may.
    add("plugin:KDA", 2, 1, gate="float32")
    add("plugin:KDA", 2, 200, gate="float32")
    add("plugin:LatentMLA", 4, 1, 2048)
    add("plugin:LatentMLA", 1, 256, 256)
    for kernel in ("moe", "moe_mxfp4"):
        for N in (1, 4, 16, 512, 8192):  # decode, then prefill-sized batches
            add(kernel, N, 1, big=N == 8192)
    add("plugin:MoE_MXFP4", 4, 1)
    add("aot:recurrent_kda", 8, 16, gate="float32")  # the AOT kernel takes float32 g and beta
    add("aot:latent_mla", 4, 1, 2048)  # decode: the split node, then the combine node
    add("aot:latent_mla", 1, 256, 256)
    for kernel in ("aot:moe", "aot:moe_mxfp4"):  # the grouped nodes: decode, and a prefill chunk
        for N in (4, 512):
            add(kernel, N, 1)
    return cases


def floor_ms(c: Case, ceilings: dict[str, float]) -> tuple[str, float]:
    """The row's floor: the larger of bytes over copy bandwidth and FLOPs over the matrix rate, and
    which ceiling sets it. Decode is mostly memory-bound and prefill compute-bound, but not always:
    96 query heads share MLA's one latent cache, which puts its decode near the bf16 ridge, and
    float32 rows run at the much lower fp32 rate."""
    nbytes, flops = cost(c)
    memory, compute = nbytes / ceilings["copy"] / 1e6, flops / ceilings[c.matrix] / 1e9
    return ("copy", memory) if memory >= compute else (c.matrix, compute)


def cost(c: Case) -> tuple[float, float]:
    """(bytes, FLOPs) of one call. Bytes are the fewest a call must move: each input read once,
    each output written once, no intermediates. FLOPs count a multiply-add as two."""
    e = TORCH_DTYPES[c.dtype].itemsize
    if c.is_moe:
        pairs = int((moe_routing(c) < c.experts).sum())  # the (token, slot) pairs on experts held
        return moe_weight_bytes(c) + c.B * (MOE_L * (e + 4) + MOE_K * 12), 2 * pairs * 3 * MOE_I * MOE_L
    if c.is_kda:
        H, K, V = c.H, KDA_K, KDA_V
        eg = TORCH_DTYPES[c.gate_dtype or c.dtype].itemsize
        tokens = c.B * c.T * H
        state = c.B * H * K * V * 4  # float32
        # The state read and written; per token q, k, g [K], v, o [V] and beta.
        nbytes = 2 * state + tokens * (2 * K * e + K * eg + 2 * V * e + eg)
        if c.chunked:
            # Per chunk of C tokens and head: A_qk, A_kk and W = UT (exp(G) K) (6 C^2 K); U = UT V
            # and A_qk V' (4 C^2 V); V' = U - W S, the state update and (Q exp(G)) S (6 C K V); the
            # forward substitution for UT (~2/3 C^3). A partial last chunk counts as a whole one.
            C, n_chunks = CHUNK, -(-c.T // CHUNK)
            flops = c.B * H * n_chunks * (6 * C * C * K + 4 * C * C * V + 6 * C * K * V + 2 * C ** 3 / 3)
        else:
            # Per token and head: the decay, S^T k, the rank-one update and S^T q (~7 K V).
            flops = 7 * tokens * K * V
        return nbytes, flops
    # MLA: each row's visible cache read once for all heads, q and o. Query t of row b sees
    # lengths[b] + t + 1 rows.
    lengths = mla_lengths(c)
    nbytes = e * (sum(n + c.T for n in lengths) * MLA_D + c.B * c.T * c.H * (MLA_D + MLA_VDIM))
    pairs = sum(c.T * n + c.T * (c.T + 1) // 2 for n in lengths)
    flops = 2 * c.H * pairs * (MLA_D + MLA_VDIM)  # causal Q K^T over D, then P V over v_dim
    return nbytes, flops


def moe_routing(c: Case) -> Tensor:
    """experts [N, k] (CPU): distinct experts per token, a fixed draw per row so that `cost` counts
    the experts actually read."""
    if c.held:  # a rank's share: 2 of each token's 16 slots on the experts held (the estimate's rows)
        from kernel_estimate import moe_routing as rank_routing

        return torch.tensor(rank_routing(c.B))
    gen = torch.Generator().manual_seed(c.B)
    return torch.rand(c.B, c.experts, generator=gen).topk(MOE_K, dim=1).indices


def moe_weight_bytes(c: Case) -> int:
    """The chosen experts' weights: w1, w3 and w2 of each distinct expert, read once."""
    per_weight = MOE_I * MOE_L * (17 / 32 if c.packed else TORCH_DTYPES[c.dtype].itemsize)  # MXFP4: 4.25 bits
    return int((moe_routing(c).unique() < c.experts).sum() * 3 * per_weight)


def mla_lengths(c: Case) -> list[int]:
    """Ragged cache lengths: row 0 holds S - T rows before the call, row b (B - b) / B of that (every row
    S - T for a `full` case)."""
    return [(c.S - c.T) * (1 if c.full else (c.B - b)) // (1 if c.full else c.B) for b in range(c.B)]


@dataclass
class Result:
    case: Case
    status: str = "skipped"  # ok | FAIL | ERROR | skipped
    err: float | None = None  # relative error, the largest over the row's outputs
    max_abs: float | None = None
    ms: float | None = None
    fla_ms: float | None = None
    fla_err: float | None = None
    note: str = ""


class Trial(NamedTuple):
    """A prepared row: `check` launches and returns the outputs to compare with `reference`; `bench`
    launches on the current stream for timing; `anchor` is fla's kernel of the same op on the same inputs."""

    check: Callable[[], Sequence[Tensor]]
    bench: Callable[[], Any]
    reference: Sequence[Tensor]
    anchor: Callable[[], Sequence[Tensor]] | None
    input_bytes: int


# ---- inputs and references ----

def kda_inputs(c: Case, gen: torch.Generator) -> list[Tensor]:
    """q, k, v, g, beta, initial_state: drawn in float32, then rounded to the row's dtypes."""
    B, T, H, K, V = c.B, c.T, c.H, KDA_K, KDA_V

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, device=gen.device, generator=gen)

    dtype, gate = TORCH_DTYPES[c.dtype], TORCH_DTYPES[c.gate_dtype or c.dtype]
    q = randn(B, T, H, K) * K ** -0.5
    k = torch.nn.functional.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    g = -5 * torch.rand(B, T, H, K, device=gen.device, generator=gen)  # (-5, 0]
    beta = torch.sigmoid(randn(B, T, H))  # (0, 1)
    h0 = randn(B, H, K, V)  # not zeros: the carried state must matter
    return [q.to(dtype), k.to(dtype), v.to(dtype), g.to(gate), beta.to(gate), h0]


def kda_reference(op: Callable[..., tuple[Tensor, Tensor]], inputs: Sequence[Tensor]) -> list[Tensor]:
    # Float64 inputs make the eager ops compute in float64.
    return list(op(*(t.double() for t in inputs)))


def mla_inputs(c: Case, gen: torch.Generator) -> list[Tensor]:
    """q, the cache kv [B, 1, 2 S, D] (NaN past each row's cache_lengths + T) and cache_lengths."""
    dtype = TORCH_DTYPES[c.dtype]
    q = torch.randn(c.B, c.T, c.H, MLA_D, device=gen.device, generator=gen)
    kv = torch.randn(c.B, 1, 2 * c.S, MLA_D, device=gen.device, generator=gen).to(dtype)
    lengths = mla_lengths(c)
    for b, n in enumerate(lengths):
        kv[b, 0, n + c.T:] = float("nan")
    return [q.to(dtype), kv, torch.tensor(lengths, dtype=torch.int64, device=gen.device)]


def moe_inputs(c: Case, gen: torch.Generator) -> list[Tensor]:
    """z, experts, weights (renormalised), then w1, w3, w2 (float) or their packed and scale tensors
    (random uint8 bytes as the checkpoint holds them, for the eager op; moe_kernel_inputs views them as
    the kernels' words; scales 2^-8 .. 2^-5 keep the products in range). Weights are scaled by
    1/sqrt(fan-in)."""
    dtype = TORCH_DTYPES[c.dtype]
    E, I, L = c.experts, MOE_I, MOE_L
    z = torch.randn(c.B, L, device=gen.device, generator=gen).to(dtype)
    experts = moe_routing(c).to(gen.device)
    weights = torch.rand(c.B, MOE_K, device=gen.device, generator=gen)
    weights = weights / weights.sum(1, keepdim=True)
    tensors = []
    for out_dim, in_dim in ((I, L), (I, L), (L, I)):
        if c.packed:
            tensors.append(torch.randint(0, 256, (E, out_dim, in_dim // 2), device=gen.device, generator=gen,
                                         dtype=torch.uint8))
            tensors.append(torch.randint(119, 123, (E, out_dim, in_dim // 32), device=gen.device,
                                         generator=gen, dtype=torch.uint8))
        else:
            w = torch.empty(E, out_dim, in_dim, device=gen.device, dtype=dtype)
            for e in range(E):  # one expert at a time: no float32 copy of the whole stack
                w[e] = torch.randn(out_dim, in_dim, device=gen.device, generator=gen) * in_dim ** -0.5
            tensors.append(w)
    return [z, experts, weights, *tensors]


def moe_kernel_inputs(c: Case, inputs: Sequence[Tensor]) -> list[Tensor]:
    """The inputs as the kernels and the plugin take them: packed experts as int32 words (views of
    the same bytes, k3export/ops/mxfp4.py "Words"); the eager reference keeps the uint8 bytes."""
    from k3plugins import moe

    return [*inputs[:3], *map(moe.words, inputs[3:])] if c.packed else list(inputs)


def moe_reference(c: Case, inputs: Sequence[Tensor]) -> list[Tensor]:
    # A float64 z makes the eager op run in float64, one used expert at a time (its weights cast
    # or dequantised per expert, never the whole stack).
    op = torch.ops.k3.routed_experts_mxfp4 if c.packed else torch.ops.k3.routed_experts
    z, experts, weights, *tensors = inputs
    return [op(z.double(), experts, weights.double(), *tensors, *MOE_BETAS)]


def mla_reference(q: Tensor, kv: Tensor, cache_lengths: Tensor) -> list[Tensor]:
    """torch.ops.k3.latent_mla in float64, one row at a time on its own valid rows (the op reads up
    to the longest row, and the rows past a row's length are NaN), a group of heads at a time so
    that the float64 scores stay near 2 GB (prefill at T = S = 4096 would need 13 GB at once)."""
    _, T, H, _ = q.shape
    rows = []
    for b, n in enumerate(cache_lengths.tolist()):
        q64, kv64 = q[b:b + 1].double(), kv[b:b + 1, :, :n + T].double()
        group = max(1, min(H, int(2e9 // (8 * T * (n + T)))))
        parts = [torch.ops.k3.latent_mla(q64[:, :, h:h + group], kv64, cache_lengths[b:b + 1], MLA_VDIM,
                                         MLA_SCALE) for h in range(0, H, group)]
        rows.append(torch.cat(parts, dim=2))
    return [torch.cat(rows)]


# ---- the launches under test ----

def native_trial(c: Case, gen: torch.Generator, fla_kernel: Callable[..., Any] | None) -> Trial:
    import k3plugins
    from k3export import ops

    if c.is_moe:
        from k3plugins import moe

        inputs = moe_inputs(c, gen)
        reference = moe_reference(c, inputs)
        launch = moe.routed_experts_mxfp4 if c.packed else moe.routed_experts
        kernel_inputs = moe_kernel_inputs(c, inputs)

        def run_moe() -> Sequence[Tensor]:
            return (launch(*kernel_inputs, *MOE_BETAS),)

        return Trial(run_moe, run_moe, reference, None, sum(t.nbytes for t in inputs))
    if c.is_kda:
        inputs = kda_inputs(c, gen)
        launcher, op = ((k3plugins.chunk_kda, ops.chunk_kda) if c.kernel == "chunk_kda"
                        else (k3plugins.recurrent_kda, ops.recurrent_kda))
        reference = kda_reference(op, inputs)

        def run() -> Sequence[Tensor]:
            return launcher(*inputs)

        anchor = fla_anchor(fla_kernel, inputs) if fla_kernel is not None else None
    else:
        inputs = mla_inputs(c, gen)
        reference = mla_reference(*inputs)

        def run() -> Sequence[Tensor]:
            return (k3plugins.latent_mla(*inputs, MLA_VDIM, MLA_SCALE),)

        anchor = None
    return Trial(run, run, reference, anchor, sum(t.nbytes for t in inputs))


def fla_anchor(fla_kernel: Callable[..., Any], inputs: Sequence[Tensor]) -> Callable[[], Sequence[Tensor]]:
    """fla's chunk_kda or fused_recurrent_kda on our inputs. fused_recurrent_kda writes the final state into
    the initial state's buffer (as our plugins do): the anchor runs after our kernel's check and timing, its
    first call (the one compared) starts from the state as given, and the later calls time the same work."""
    q, k, v, g, beta, h0 = inputs

    def run() -> Sequence[Tensor]:
        # Our q is already scaled by K^-0.5, so fla must not scale it again; no autograd records.
        with torch.no_grad():
            return fla_kernel(q, k, v, g, beta, scale=1.0, initial_state=h0, output_final_state=True)

    return run


def plugin_trial(c: Case, gen: torch.Generator) -> Trial:
    """The IPluginV3 enqueue body on raw pointers: descriptors and output buffers made from the
    definition as TensorRT would (output shapes and dtypes from the input ones), outputs NaN-filled
    so that an unwritten element shows, checked on a side stream as TensorRT's own."""
    import numpy as np

    from k3plugins.definitions import KDA, LATENT_MLA, ROUTED_EXPERTS_MXFP4
    from k3plugins.trt import launch_from_pointers

    if c.is_moe:
        definition = ROUTED_EXPERTS_MXFP4
        fields = definition.parse_fields({"situ_beta": np.array([MOE_BETAS[0]], dtype=np.float32),
                                          "situ_linear_beta": np.array([MOE_BETAS[1]], dtype=np.float32)})
        inputs = moe_inputs(c, gen)
        reference = moe_reference(c, inputs)
        inputs = moe_kernel_inputs(c, inputs)  # the plugin's int32 words
    elif c.is_kda:
        definition, fields = KDA, {}
        inputs = kda_inputs(c, gen)
        reference = kda_reference(torch.ops.k3.kda, inputs)
    else:
        definition = LATENT_MLA
        # As TensorRT's parser hands ONNX attributes over: one-element int32 / float32 arrays.
        fields = LATENT_MLA.parse_fields({"v_dim": np.array([MLA_VDIM], dtype=np.int32),
                                          "scale": np.array([MLA_SCALE], dtype=np.float32)})
        inputs = mla_inputs(c, gen)
        reference = mla_reference(*inputs)
    in_descs = [(tuple(t.shape), NAMES[t.dtype]) for t in inputs]
    out_dims = definition.output_shapes([d for d, _ in in_descs], fields, int)
    out_dtypes = definition.output_dtypes([n for _, n in in_descs])
    out_descs = [(tuple(d), n) for d, n in zip(out_dims, out_dtypes, strict=True)]
    # An aliased output (KDA's final state) is its input's buffer, as TensorRT hands it over.
    outputs = [inputs[definition.aliased_input(i)] if definition.aliased_input(i) >= 0
               else torch.full(d, float("nan"), dtype=TORCH_DTYPES[n], device="cuda")
               for i, (d, n) in enumerate(out_descs)]
    saved = [t.clone() for t in inputs]  # an in-place launch overwrites its aliased input
    in_ptrs, out_ptrs = [t.data_ptr() for t in inputs], [t.data_ptr() for t in outputs]
    side = torch.cuda.Stream()

    def launch(stream: int) -> None:
        launch_from_pointers(definition, fields, in_descs, out_descs, in_ptrs, out_ptrs, stream)

    def check() -> Sequence[Tensor]:
        for t, s in zip(inputs, saved, strict=True):
            t.copy_(s)
        side.wait_stream(torch.cuda.current_stream())  # the inputs and NaN fills are done
        launch(side.cuda_stream)
        side.synchronize()
        return [t.clone() for t in outputs]

    def bench() -> None:
        launch(torch.cuda.current_stream().cuda_stream)  # do_bench's events are on this stream

    return Trial(check, bench, reference, None, sum(t.nbytes for t in inputs))


def aot_trial(c: Case, gen: torch.Generator) -> Trial:
    """A kernel as trt_aot's aot_impl compiles it (triton.compile for this GPU, PTX 8.7), with its
    grid and scalars from the *_aot_launch functions, launched through Triton's CompiledKernel into
    NaN-filled outputs; KDA and LatentMLA as an export holds them, two nodes each (KDAPrepare then
    KDAChunkRecurrence, the chunk terms between them; LatentMLA's split node then its combine node);
    the routed experts as their grouped nodes (moe_aot_launches)."""
    from k3export import ops
    from k3plugins.aot import compile_variant, device_target
    from k3plugins.trt_aot import (
        KDA_CHUNK,
        kda_chunk_recurrence_aot_launch,
        kda_prepare_aot_launch,
        kda_two_node_aot_kernels,
        latent_mla_aot_kernel,
        latent_mla_aot_launch,
        latent_mla_combine_aot_kernel,
        latent_mla_combine_aot_launch,
    )

    finish: Callable[[], Sequence[Tensor]] | None = None  # the outputs after the launches, if not `outputs`
    if c.is_moe:
        raw = moe_inputs(c, gen)
        reference = moe_reference(c, raw)
        inputs = moe_kernel_inputs(c, raw)
        launches, finish = moe_aot_launches(c, inputs)
    elif c.is_kda:
        inputs = kda_inputs(c, gen)
        q, v, h0 = inputs[0], inputs[2], inputs[5]
        reference = kda_reference(ops.recurrent_kda, inputs)
        prepare, recurrence = kda_two_node_aot_kernels(c.dtype, KDA_K, KDA_V)
        B, T, H, K = q.shape
        terms = [v.new_full((B, T, H, n), float("nan")) for n in (K, K, K, KDA_V, KDA_CHUNK)]
        terms.append(torch.full((B, -(-T // KDA_CHUNK), H, K), float("nan"), device="cuda"))
        grid, scalars = kda_prepare_aot_launch(list(q.shape))
        recurrence_grid, _ = kda_chunk_recurrence_aot_launch(list(q.shape), list(v.shape), recurrence)
        outputs = [torch.full_like(v, float("nan")), torch.full_like(h0, float("nan"))]
        launches = [(prepare, grid, [*inputs[:5], *scalars, *terms]),
                    (recurrence, recurrence_grid, [*inputs[:5], *terms, h0, *scalars, *outputs])]
    else:
        inputs = mla_inputs(c, gen)
        q, kv, _ = inputs
        reference = mla_reference(*inputs)
        variant = latent_mla_aot_kernel(c.dtype, c.dtype, MLA_D, MLA_VDIM, MLA_SCALE, q.shape[2], splits=True)
        grid, scalars = latent_mla_aot_launch(list(q.shape), list(kv.shape), splits=True)
        o_part = torch.full((grid[2], *q.shape[:3], MLA_VDIM), float("nan"), device="cuda")
        lse = torch.full(o_part.shape[:4], float("nan"), device="cuda")
        combine = latent_mla_combine_aot_kernel(c.dtype, MLA_VDIM)
        combine_grid, combine_scalars = latent_mla_combine_aot_launch(list(o_part.shape))
        outputs = [q.new_full((*q.shape[:3], MLA_VDIM), float("nan"))]
        launches = [(variant, grid, [*inputs, *scalars, o_part, lse]),
                    (combine, combine_grid, [q, o_part, lse, *combine_scalars, *outputs])]
    compiled = [(compile_variant(v, device_target()), v, g, args) for v, g, args in launches]

    def run() -> Sequence[Tensor]:
        # Every parameter in the kernel's order: inputs, scalars and outputs as an AOT launch passes them,
        # the constexprs where they stand (Triton's launcher takes and ignores them).
        for kernel, launched, launch_grid, args in compiled:
            given = iter(args)
            constexprs = launched.constexprs
            kernel[(*launch_grid, 1, 1)[:3]](*(constexprs[n] if n in constexprs else next(given)
                                               for n in launched.fn.arg_names))
        return finish() if finish else outputs

    return Trial(run, run, reference, None, sum(t.nbytes for t in inputs))


def moe_aot_launches(c: Case, inputs: Sequence[Tensor]) -> tuple[list[tuple[Any, Any, list[Any]]],
                                                                    Callable[[], Sequence[Tensor]]]:
    """The routed experts as an export holds them for full TensorRT: the RoutedExpertsGroup,
    RoutedExpertsGateUp(MXFP4) and RoutedExpertsDown(MXFP4) nodes as their aot_impls compile and grid
    them (trt_aot.grouped_experts_aot_kernels / _grid; scalars N k, then k), in the tactic of the rank's
    own pairs (what tools/kernel_estimate.py's AOT rows assume TensorRT picks), their outputs NaN-filled;
    then the graph's standard-op sum (Gather, Where, Mul, ReduceSum) in torch. Returns the launches and
    the sum."""
    from k3plugins import moe
    from k3plugins.trt_aot import GROUPED_TACTICS, grouped_experts_aot_grid, grouped_experts_aot_kernels

    z, experts, weights, *expert_weights = inputs
    E, pairs = c.experts, experts.numel()
    mode = moe.tile_mode(int((experts < E).sum()), E)
    tactic = next(t for t, m in GROUPED_TACTICS.items() if m == mode)
    gate_up, down = grouped_experts_aot_kernels(c.dtype, c.packed, MOE_L, MOE_I, E, MOE_BETAS, tactic)
    nan = float("nan")
    grouping = [torch.full((pairs,), -7, dtype=torch.int32, device="cuda"),
                torch.full((E + 1,), -7, dtype=torch.int32, device="cuda"),
                torch.full(tuple(experts.shape), -7, dtype=torch.int32, device="cuda")]
    h = torch.full((pairs, MOE_I), nan, dtype=z.dtype, device="cuda")
    y = torch.full((pairs, MOE_L), nan, device="cuda")
    # Each projection's tensors: (packed, scale) words, or the float weights alone.
    w1, w3, w2 = (expert_weights[i:i + 2] if c.packed else expert_weights[i // 2:i // 2 + 1]
                  for i in (0, 2, 4))
    launches = [(moe.group_variant({"E": E, "OFFSET": 0}), (E + 1,), [experts, pairs, *grouping]),
                (gate_up, grouped_experts_aot_grid(gate_up, pairs, E, MOE_I),
                 [z, *grouping[:2], *w1, *w3, pairs // c.B, h]),
                (down, grouped_experts_aot_grid(down, pairs, E, MOE_L), [h, grouping[1], *w2, y])]

    def weighted_sum() -> Sequence[Tensor]:
        slots = grouping[2].long()
        held = slots >= 0
        rows = y[slots.clamp(min=0)]  # [N, k, L]; a slot held elsewhere gathers a row nobody wrote
        return [torch.where(held[..., None], weights[..., None] * rows, 0.0).sum(1)]

    return launches, weighted_sum


# ---- measuring ----

def rel_err(out: Tensor, ref: Tensor) -> tuple[float, float]:
    diff = out.double() - ref
    return (diff.norm() / ref.norm()).item(), diff.abs().max().item()


def bench_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def poison_allocator(nbytes: int) -> None:
    """Best effort at poisoning outputs the launchers allocate themselves (torch.empty): free torch's
    cache, then take and free NaN-filled blocks, so the launchers' outputs and scratch are carved
    from memory that reads NaN where a kernel fails to write."""
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    large = torch.full((min(nbytes, free // 2) // 4,), float("nan"), device="cuda")
    small = [torch.full((1 << 18,), float("nan"), device="cuda") for _ in range(16)]  # the < 1 MB pool
    del large, small


def measure_ceilings() -> dict[str, float]:
    """Copy bandwidth in GB/s and matmul rates in TFLOP/s, on random data (zeros run faster)."""
    return {"copy": _copy_gbs(), "bf16": _matmul_tflops(torch.bfloat16),
            "fp32": _matmul_tflops(torch.float32)}


def _copy_gbs() -> float:
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB, many times the L2
    dst = torch.empty_like(src)
    return 2 * src.nbytes / bench_ms(lambda: dst.copy_(src)) / 1e6  # bytes read plus written


def _matmul_tflops(dtype: torch.dtype, n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
    return 2 * n ** 3 / bench_ms(lambda: a @ b) / 1e9


def check_case(c: Case, index: int, seed: int, fla_kernel: Callable[..., Any] | None) -> Result:
    import k3export.ops  # noqa: F401  (registers torch.ops.k3.*, the references)

    result = Result(c)
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(seed * 1_000_003 + index)  # fresh inputs for every row
    if c.kernel.startswith("plugin:"):
        trial = plugin_trial(c, gen)
    elif c.kernel.startswith("aot:"):
        trial = aot_trial(c, gen)
    else:
        trial = native_trial(c, gen, fla_kernel)
    poison_allocator(6 * trial.input_bytes)  # about what chunk_kda allocates (its intermediates)
    outputs = trial.check()
    torch.cuda.synchronize()
    errors = [rel_err(o, r) for o, r in zip(outputs, trial.reference, strict=True)]
    result.err = max(e for e, _ in errors) if all(e == e for e, _ in errors) else float("nan")
    result.max_abs = max(m for _, m in errors)
    del outputs
    result.ms = bench_ms(trial.bench)
    # NaN compares false, so a NaN error fails too.
    result.status = "ok" if result.err <= TOLERANCE[c.dtype] else "FAIL"
    if trial.anchor is not None:
        try:
            fla_out = trial.anchor()  # autotunes on its first call per dtype
            torch.cuda.synchronize()
            result.fla_err = max(rel_err(o, r)[0] for o, r in zip(fla_out, trial.reference, strict=True))
            del fla_out
            result.fla_ms = bench_ms(trial.anchor)
        except Exception as exc:  # the anchor is information: it never fails the row
            result.note = f"fla: {type(exc).__name__}: {exc}"
            traceback.print_exc()
    return result


# ---- fla, the anchor ----

def load_fla(extra_dirs: Sequence[str]) -> tuple[dict[str, Callable[..., Any]] | None, str]:
    """fla.ops.kda's kernels by the name of ours they stand beside, installing its wheel (and einops', if
    missing) from a wheel folder when fla does not import; or None and why."""
    try:
        return _import_fla()
    except Exception as exc:  # ImportError, or whatever fla's import-time device probing raises
        reason = f"{type(exc).__name__}: {exc}"
    wheels = find_wheels(extra_dirs)
    fla_wheels = [w for w in wheels if w.name.startswith("fla_core-")]
    if not fla_wheels:
        return None, f"skipped: fla does not import ({reason}) and no fla_core wheel under {list(WHEEL_DIRS)}"
    install = fla_wheels[-1:]
    if importlib.util.find_spec("einops") is None:
        install += [w for w in wheels if w.name.startswith("einops-")][-1:]
    target = Path(tempfile.gettempdir()) / "gpu_check_site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--upgrade", "--target", str(target), *map(str, install)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        names = [w.name for w in install]
        return None, f"skipped: pip install of {names} failed: {done.stderr.strip()[-300:]}"
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    try:
        kernels, version = _import_fla()
        return kernels, f"{version} (installed from {install[0].parent})"
    except Exception as exc:
        return None, f"skipped: installed {[w.name for w in install]} but fla does not import: {exc}"


def _import_fla() -> tuple[dict[str, Callable[..., Any]], str]:
    import fla
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    return ({"chunk_kda": chunk_kda, "recurrent_kda": fused_recurrent_kda},
            f"fla {getattr(fla, '__version__', '?')}")


def find_wheels(extra_dirs: Sequence[str]) -> list[Path]:
    dirs = [ROOT / d for d in WHEEL_DIRS] + [Path(d) for d in extra_dirs]
    return [w for d in dirs if d.is_dir() for w in sorted(d.glob("*.whl"))]


# ---- the table ----

HEADER = (f"{'kernel':<17} {'shape':<15} {'dtype':<5} {'rel err':>8} {'tol':>6} {'ms':>9} {'GB/s':>7} "
          f"{'TFLOP/s':>7} {'ceil':>4} {'%ceil':>6} {'fla ms':>8} {'ours/fla':>8} status")


def _num(x: float | None, fmt: str, width: int) -> str:
    return f"{x:{width}{fmt}}" if x is not None else " " * (width - 1) + "-"


def table_row(r: Result, ceilings: dict[str, float]) -> str:
    c = r.case
    nbytes, flops = cost(c)
    gbs = tflops = frac = ratio = None
    ceiling, floor = floor_ms(c, ceilings)
    if r.ms:
        gbs, tflops, frac = nbytes / r.ms / 1e6, flops / r.ms / 1e9, 100 * floor / r.ms
    if r.ms and r.fla_ms:
        ratio = r.ms / r.fla_ms
    status = r.status + (f" ({r.note})" if r.note and r.status == "skipped" else "")
    return (f"{c.kernel:<17} {c.shape:<15} {SHORT[c.dtype]:<5} {_num(r.err, '.1e', 8)} "
            f"{TOLERANCE[c.dtype]:>6.0e} {_num(r.ms, '.4f', 9)} {_num(gbs, '.0f', 7)} "
            f"{_num(tflops, '.2f', 7)} {ceiling:>4} {_num(frac, '.1f', 6)} "
            f"{_num(r.fla_ms, '.4f', 8)} {_num(ratio, '.2f', 8)} {status}")


def print_plan(cases: Sequence[Case], fla_dtypes: Sequence[str]) -> None:
    print(f"{len(cases)} rows planned; tolerances {TOLERANCE}")
    print(f"floors from the leads {NOMINAL_CEILINGS} (GB/s, TFLOP/s); the GPU run measures them")
    print(f"{'kernel':<17} {'shape':<15} {'dtype':<5} {'tol':>6} {'MB':>9} {'GFLOP':>9} {'floor ms':>9} "
          f"{'ceil':>4} big  fla")
    for c in cases:
        nbytes, flops = cost(c)
        ceiling, floor = floor_ms(c, NOMINAL_CEILINGS)
        fla = "yes" if wants_fla(c, fla_dtypes) else ""
        print(f"{c.kernel:<17} {c.shape:<15} {SHORT[c.dtype]:<5} {TOLERANCE[c.dtype]:>6.0e} "
              f"{nbytes / 1e6:>9.1f} {flops / 1e9:>9.2f} {floor:>9.4f} {ceiling:>4} "
              f"{'yes' if c.big else '':<4} {fla}")
    spec = importlib.util.find_spec("fla")
    wheels = [w.name for w in find_wheels([])]
    print(f"fla importable: {spec is not None}; wheels found: {wheels or 'none'}")


# ---- --estimate: tools/kernel_estimate.py's rows, timed ----

def estimate_plan(machine: str) -> list[tuple[Case, Any]]:
    """kernel_estimate's rows as Cases (bfloat16), each with its estimate on `machine` (a MACHINES key; the
    kernels are compiled on first use, $K3_KERNEL_CACHE keeps them). An op whose rows fail is left out."""
    import kernel_estimate

    pairs = []
    for op, build in kernel_estimate.OPS.items():
        try:
            rows = build()
        except Exception as exc:  # one op's rewrite must not stop the others' timings
            print(f"--estimate: {op} rows left out: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        for row in rows:
            fields = dict(row.case)
            est = kernel_estimate.estimate(row, kernel_estimate.MACHINES[machine])
            case = Case(fields.pop("kernel"), "bfloat16", **fields, big=est.time_s > 0.01 or row.bytes > 2e9)
            pairs.append((case, est))
    return pairs


def estimate_machine(device_name: str) -> str:
    """The kernel_estimate machine of a GPU by its name (an H100's figures where none fits)."""
    return next((key for key in ("b200", "h200") if key in device_name.lower()), "h100")


ESTIMATE_HEADER = (f"{'op':<4} {'form':<4} {'shape':<44} {'est us':>10} {'meas us':>10} {'meas/est':>8} "
                   f"{'%bound est':>10} {'%bound meas':>11} status")


def estimate_lines(pairs: Sequence[tuple[Case, Any]], results: dict[Case, Result]) -> list[str]:
    """The estimate beside the measurement, a row each; % bound = the row's HBM / tensor-core bound over
    the estimated, then the measured time."""
    lines = [ESTIMATE_HEADER, "-" * len(ESTIMATE_HEADER)]
    for case, est in pairs:
        r = results.get(case)
        ms = r.ms if r else None
        measured = ms * 1e3 if ms else None
        ratio = measured / (est.time_s * 1e6) if measured else None
        bound = 100 * est.bound_s * 1e6 / measured if measured else None
        status = r.status + (f" ({r.note})" if r.note else "") if r else "-"
        lines.append(f"{est.row.op:<4} {est.row.form:<4} {est.row.shape[:44]:<44} {est.time_s * 1e6:>10.1f} "
                     f"{_num(measured, '.1f', 10)} {_num(ratio, '.2f', 8)} {est.percent:>10.3g} "
                     f"{_num(bound, '.3g', 11)} {status}")
    return lines


def wants_fla(c: Case, fla_dtypes: Sequence[str]) -> bool:
    long_enough = c.kernel == "recurrent_kda" or (c.kernel == "chunk_kda" and c.T >= FLA_MIN_T)
    return long_enough and c.dtype in fla_dtypes


# ---- main ----

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the planned rows and exit; no GPU needed")
    p.add_argument("--estimate", action="store_true",
                   help="time tools/kernel_estimate.py's rows (bfloat16) and print its estimate beside")
    p.add_argument("--machine", default="",
                   help="kernel_estimate machine for --estimate (default: the GPU's)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated subset of %(default)s")
    p.add_argument("--only", default="", help="comma-separated substrings of kernel names to keep")
    p.add_argument("--budget", type=float, default=360.0,
                   help="seconds after which the largest rows are skipped (all rows after budget + 90)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fla", action="store_true", help="skip the fla anchor")
    p.add_argument("--fla-dtypes", default="bfloat16",
                   help="dtypes of the fla anchor (each autotunes on its first call, 1 to 3 minutes)")
    p.add_argument("--wheels", action="append", default=[], help="another folder holding the fla_core wheel")
    p.add_argument("--out", default=os.environ.get("OUT"),
                   help="folder for gpu_check.txt and gpu_check.json (default $OUT)")
    args = p.parse_args(argv)
    for name in ("dtypes", "fla_dtypes"):
        values = [d for d in getattr(args, name).split(",") if d]
        unknown = set(values) - set(DTYPES)
        if unknown:
            p.error(f"--{name.replace('_', '-')}: unknown {sorted(unknown)}; choose from {DTYPES}")
        setattr(args, name, list(dict.fromkeys(values)))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    if args.estimate:
        machine = args.machine or estimate_machine(torch.cuda.get_device_name() if torch.cuda.is_available()
                                                   else "")
        estimates = estimate_plan(machine)
        print(f"--estimate: {len(estimates)} rows, estimated for kernel_estimate's {machine}", flush=True)
    else:
        estimates = []
    cases = [c for c in ([c for c, _ in estimates] if args.estimate else plan(args.dtypes))
             if not args.only or any(s in c.kernel for s in args.only.split(","))]
    # The imports the GPU run needs, so that a dry run proves them too.
    import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
    import k3plugins.trt  # noqa: F401  (k3plugins and the plugin adapters)

    if args.dry_run:
        print_plan(cases, [] if args.no_fla else args.fla_dtypes)
        if estimates:
            print("\n".join(estimate_lines(estimates, {})))
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 would run the kernels in Triton's interpreter: unset it", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--dry-run prints the plan)", file=sys.stderr)
        return 2

    import triton

    # The references are float64; keep torch's float32 matmuls (the fp32 ceiling) off TF32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.cuda.get_device_name()
    print(f"{device}; torch {torch.__version__}, triton {triton.__version__}; {len(cases)} rows", flush=True)
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings['copy']:.0f} GB/s, bf16 matmul {ceilings['bf16']:.0f} TFLOP/s, "
          f"fp32 matmul {ceilings['fp32']:.1f} TFLOP/s", flush=True)
    fla_kernels, fla_status = (None, "skipped: --no-fla") if args.no_fla else load_fla(args.wheels)
    print(f"anchor: {fla_status}", flush=True)

    results = {c: Result(c) for c in cases}
    # Small rows first, the largest last: those are what the time budget drops.
    order = [c for c in cases if not c.big] + [c for c in cases if c.big]
    context_lost = False
    fla_tuned: set[tuple[str, str]] = set()  # (kernel, dtype) fla has autotuned
    for index, c in enumerate(order):
        elapsed = time.monotonic() - start
        r = results[c]
        if context_lost:
            r.note = "CUDA context lost"
            continue
        if elapsed > args.budget + GRACE_S or (c.big and elapsed > args.budget):
            r.note = "time budget"
            continue
        fla = fla_kernels[c.kernel] if fla_kernels and wants_fla(c, args.fla_dtypes) else None
        fla_note = ""
        if fla is not None and (c.kernel, c.dtype) not in fla_tuned and elapsed > args.budget - FLA_TUNE_S:
            fla, fla_note = None, "fla: no time left to autotune"
        try:
            results[c] = r = check_case(c, index, args.seed, fla)
            r.note = r.note or fla_note
            if r.fla_ms is not None:
                fla_tuned.add((c.kernel, c.dtype))
        except Exception as exc:  # one failing kernel must not stop the others
            r.status, r.note = "ERROR", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:  # a sticky CUDA error (illegal address, ...): no later launch can run
                context_lost = True
        print(f"[{time.monotonic() - start:6.1f}s] {c.kernel} {c.shape} {SHORT[c.dtype]}: {r.status}"
              + (f" err {r.err:.2e} {r.ms:.4f} ms" if r.ms is not None else "")
              + (f" ({r.note})" if r.note else ""), flush=True)

    elapsed = time.monotonic() - start
    bad = [r for r in results.values() if r.status in ("FAIL", "ERROR")]
    skipped = [r for r in results.values() if r.status == "skipped"]
    # Notes first, the table last: the device tool returns the end of the output.
    lines = []
    for r in bad + [r for r in results.values() if r.note and r.status == "ok"]:
        errors = f"err {r.err:.3e} max abs {r.max_abs:.3e} " if r.err is not None else ""
        row = f"{r.case.kernel} {r.case.shape} {SHORT[r.case.dtype]}"
        lines.append(f"{r.status}: {row}: {errors}{r.note}"[:160])
    for r in results.values():
        if r.case.is_moe and r.ms and r.case.B <= 16:
            weights_gbs = moe_weight_bytes(r.case) / r.ms / 1e6
            lines.append(f"{r.case.kernel} {r.case.shape} {SHORT[r.case.dtype]}: chosen experts' weights "
                         f"{moe_weight_bytes(r.case) / 1e6:.0f} MB at {weights_gbs:.0f} GB/s: "
                         f"{100 * weights_gbs / ceilings['copy']:.0f}% of the measured copy bandwidth, "
                         f"{100 * weights_gbs / H200_NOMINAL_GBS:.0f}% of the H200's nominal 4.8 TB/s")
    fla_errs = [r.fla_err for r in results.values() if r.fla_err is not None]
    if fla_errs:
        lines.append(f"fla's own rel err against the reference (information): {min(fla_errs):.1e} "
                     f"to {max(fla_errs):.1e}")
    lines += [f"{device}: copy {ceilings['copy']:.0f} GB/s, bf16 {ceilings['bf16']:.0f} TFLOP/s, "
              f"fp32 {ceilings['fp32']:.1f} TFLOP/s (measured); anchor {fla_status}"[:300],
              f"KDA H={KDA_H} K=V={KDA_K}; MLA H={MLA_H} D={MLA_D} v_dim={MLA_VDIM} scale=192^-0.5; "
              f"MoE L={MOE_L} I={MOE_I} k={MOE_K}, N tokens, E experts in memory; "
              f"%ceil: floor / ms, the floor set by copy or the matrix rate (ceil); ours/fla: ms / fla ms",
              HEADER, "-" * len(HEADER)]
    lines += [table_row(results[c], ceilings) for c in cases]
    if estimates:  # the model's estimate beside the measurement: the first GPU run calibrates it
        lines += estimate_lines(estimates, results)
    lines.append(f"{len(cases) - len(bad) - len(skipped)} ok, {len(bad)} failed, {len(skipped)} skipped; "
                 f"tolerances {TOLERANCE}; elapsed {elapsed:.0f} s")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.txt").write_text(text + "\n")
        rows = [{**asdict(r), "bytes": cost(r.case)[0], "flops": cost(r.case)[1]} for r in results.values()]
        (out / "gpu_check.json").write_text(json.dumps(
            {"device": device, "torch": torch.__version__, "triton": triton.__version__,
             "ceilings": ceilings, "anchor": fla_status, "tolerance": TOLERANCE, "elapsed_s": elapsed,
             "rows": rows}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
