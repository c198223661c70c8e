"""The KDA Triton kernels against the eager reference ops (run in float64 on the same inputs).

bfloat16 is not tested: the interpreter's bf16 arithmetic is silently wrong.
"""

from __future__ import annotations

import pytest
import torch
from reference import kda_inputs, rel_error

import k3export.ops as ref
import k3plugins
from k3plugins import trt_aot

C, STEPPED = trt_aot.KDA_CHUNK, trt_aot.KDA_STEP_TOKENS

# float16 inputs are rounded before both sides see them, so the recurrence's error is its float32
# arithmetic plus rounding o to float16 (relative 2^-11 per element, about 5e-4), and the float32
# state carries no rounding at all.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-5)}
# The chunked kernels' products in float16 take float16 operands (the state and the chunk's float32 terms
# rounded to float16, 2^-11 relative each) and accumulate in float32; in float32 they are float32 FMA.
CHUNKED_TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 3e-3)}


def check(kernel, reference, shape: tuple[int, ...], dtype: torch.dtype,
          tolerances: dict = TOLERANCES) -> None:
    inputs = kda_inputs(*shape, dtype, seed=sum(shape))
    o, state = kernel(*inputs)
    o_ref, state_ref = reference(*(t.double() for t in inputs))
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert state.dtype == torch.float32 and state.shape == state_ref.shape
    o_tol, state_tol = tolerances[dtype]
    assert rel_error(o, o_ref) < o_tol
    assert rel_error(state, state_ref) < state_tol


# (B, T, H, K, V): K and V not powers of two or not multiples of the V block exercise the masks; K = 36 cuts
# a lane's window of key channels (8 at BK = 64), which the kernel moves back to end at K - 1; K = 3 is
# shorter than a window (4 at BK = 32: SHORT_K, masked rows).
@pytest.mark.parametrize("shape", [(1, 1, 2, 32, 32), (2, 1, 3, 64, 48), (2, 7, 2, 48, 64),
                                   (1, 33, 1, 32, 32), (1, 1, 2, 128, 128), (2, 3, 2, 36, 24),
                                   (2, 2, 2, 3, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_recurrent_kda(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check(k3plugins.recurrent_kda, ref.recurrent_kda, shape, dtype)


# Every edge of the 16-token chunk (one token, a chunk less one, one, one more; four chunks and either side)
# and a few hundred tokens; K and V not multiples of the blocks (V = 40: one partial value block in float16,
# three in float32), and the published head dim.
@pytest.mark.parametrize("shape", [(1, 1, 2, 32, 32), (2, 15, 1, 32, 48), (1, 16, 2, 48, 40),
                                   (2, 17, 1, 64, 64), (1, 63, 1, 32, 32), (2, 64, 2, 32, 32),
                                   (1, 65, 1, 128, 128), (1, 200, 1, 48, 40)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_kda(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check(k3plugins.chunk_kda, ref.chunk_kda, shape, dtype, CHUNKED_TOLERANCES)


@pytest.mark.parametrize(("kernel", "T"), [(k3plugins.recurrent_kda, 1), (k3plugins.recurrent_kda, 5),
                                           (k3plugins.chunk_kda, 70)],
                         ids=["recurrent-1", "recurrent-5", "chunk-70"])
def test_state_updated_in_place(kernel, T: int) -> None:
    """final_state may be initial_state's buffer (TensorRT aliases them): the result is unchanged."""
    inputs = kda_inputs(2, T, 2, 32, 48, torch.float32, seed=T)
    o_ref, state_ref = ref.recurrent_kda(*(t.double() for t in inputs))
    state = inputs[5].clone()
    o = torch.full_like(inputs[2], float("nan"))
    o_out, final = kernel(*inputs[:5], state, o=o, final_state=state)
    assert o_out is o and final is state
    assert rel_error(o, o_ref) < 1e-5 and rel_error(state, state_ref) < 1e-5


@pytest.mark.parametrize("kernel", [k3plugins.recurrent_kda, k3plugins.chunk_kda], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_padded_positions_leave_the_state(kernel, dtype: torch.dtype) -> None:
    """A ragged batch right-padded to T = 70, k, beta and g zeroed at the padding as the graph does:
    each row's state and its valid outputs are those of the row run alone on its valid prefix."""
    lengths = (5, 70, 0, 64)
    q, k, v, g, beta, state = kda_inputs(len(lengths), 70, 2, 32, 32, dtype, seed=7)
    for b, n in enumerate(lengths):
        k[b, n:], g[b, n:], beta[b, n:] = 0, 0, 0
    o, final = kernel(q, k, v, g, beta, state)
    o_tol, state_tol = (CHUNKED_TOLERANCES if kernel is k3plugins.chunk_kda else TOLERANCES)[dtype]
    for b, n in enumerate(lengths):
        if n == 0:  # no valid token: the state as given
            assert torch.equal(final[b], state[b])
            continue
        row = [t[b:b + 1, :n].double() for t in (q, k, v, g, beta)]
        o_ref, state_ref = ref.recurrent_kda(*row, state[b:b + 1].double())
        assert rel_error(final[b:b + 1], state_ref) < state_tol
        assert rel_error(o[b:b + 1, :n], o_ref) < o_tol


def aot_kda(q, k, v, g, beta, initial_state, final_state=None):
    """The AOT plugin's kernel, launched as TensorRT would: inputs, int32 scalars, outputs."""
    variant = trt_aot.kda_aot_kernel(str(v.dtype).removeprefix("torch."), q.shape[-1])
    grid, scalars = trt_aot.kda_aot_launch(q.shape, v.shape)
    o = torch.full_like(v, float("nan"))
    ht = torch.full_like(initial_state, float("nan")) if final_state is None else final_state
    variant.fn[grid](q, k, v, g, beta, initial_state, *scalars, o, ht, **variant.constexprs,
                     num_warps=variant.num_warps)
    return o, ht


def aot_kda_two_nodes(q, k, v, g, beta, initial_state, final_state=None):
    """KDA as exports hold it, the AOT kernels of KDAPrepare then KDAChunkRecurrence launched as TensorRT
    would, the chunk terms between them (NaN where the prepare writes nothing: a stepped call reads none)."""
    dtype = str(v.dtype).removeprefix("torch.")
    prepare, recurrence = trt_aot.kda_two_node_aot_kernels(dtype, q.shape[-1], v.shape[-1])
    B, T, H, K = q.shape
    terms = [v.new_full((B, T, H, n), float("nan")) for n in (K, K, K, v.shape[-1], C)]
    terms.append(torch.full((B, -(-T // C), H, K), float("nan")))
    grid, scalars = trt_aot.kda_prepare_aot_launch(q.shape)
    prepare.fn[grid](q, k, v, g, beta, *scalars, *terms, **prepare.constexprs, num_warps=prepare.num_warps)
    grid, scalars = trt_aot.kda_chunk_recurrence_aot_launch(q.shape, v.shape, recurrence)
    o = torch.full_like(v, float("nan"))
    ht = torch.full_like(initial_state, float("nan")) if final_state is None else final_state
    recurrence.fn[grid](q, k, v, g, beta, *terms, initial_state, *scalars, o, ht, **recurrence.constexprs,
                        num_warps=recurrence.num_warps)
    return o, ht


AOT_LAUNCHERS = {"one-node": aot_kda, "two-nodes": aot_kda_two_nodes}


def aot_tolerances(T: int) -> dict:
    """A call of at most KDA_STEP_TOKENS steps the recurrence in every dtype: its state never passes through a
    float16 product, so it holds float32's bound (the chunked path's, rounded to float16, is about 3e-4)."""
    return TOLERANCES if T <= trt_aot.KDA_STEP_TOKENS else CHUNKED_TOLERANCES


# Every edge of the AOT kernel's chunk: one token (decode), the most tokens stepped (a verify call) and one
# more, a chunk less one, one chunk, one more, four chunks and either side, a few hundred tokens; K and V not
# multiples of the blocks (K = 36 cuts the stepped path's window of 16 key channels); the published head dim.
AOT_SHAPES = [(2, 1, 2, 32, 32), (1, 1, 2, 128, 128), (2, STEPPED, 2, 48, 40), (2, STEPPED - 1, 2, 36, 24),
              (1, STEPPED + 1, 2, 32, 48), (1, C - 1, 2, 32, 48), (2, C, 1, 48, 32), (1, C + 1, 2, 32, 32),
              (2, 3 * C + 5, 1, 64, 40), (1, 4 * C - 1, 1, 32, 32), (1, 4 * C, 1, 32, 32),
              (1, 4 * C + 1, 1, 128, 128), (1, 200, 1, 48, 40)]


@pytest.mark.parametrize("shape", AOT_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("launcher", AOT_LAUNCHERS)
def test_aot_kernel(launcher: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """The AOT kernels the KDA aot_impls embed (the one-node KDA's; KDAPrepare's and KDAChunkRecurrence's),
    against the eager op (float64), final state included."""
    check(AOT_LAUNCHERS[launcher], ref.recurrent_kda, shape, dtype, aot_tolerances(shape[1]))


# KDAChunkRecurrence's step mappings (kda_chunk_recurrence_aot_launch): (B, T, H, K, V) and the value columns
# a program: 16 where the stepped call's (row, head) pairs x 16-column blocks fit in 132 programs (the
# published 12 heads at batch 1; K = 34 cuts a lane's window of 4 key channels, K = 1 is shorter than one:
# NARROW_SHORT_K), else 64 (36 pairs x 4 blocks of V = 64 are 144; K = 36 cuts a window of 16, K = 5 is
# shorter than one).
STEP_MAPPINGS = [((1, 1, 12, 128, 128), 16), ((2, STEPPED, 3, 34, 40), 16), ((1, 2, 2, 1, 24), 16),
                 ((3, 1, 12, 32, 64), 64), ((3, STEPPED, 12, 36, 64), 64), ((3, 2, 12, 5, 64), 64)]


@pytest.mark.parametrize(("shape", "columns"), STEP_MAPPINGS, ids=str)
def test_aot_step_mappings(shape: tuple[int, ...], columns: int) -> None:
    """A stepped KDAChunkRecurrence call in each mapping its grid selects (float16), against the eager op."""
    B, T, H, K, V = shape
    recurrence = trt_aot.kda_two_node_aot_kernels("float16", K, V)[1]
    grid, _ = trt_aot.kda_chunk_recurrence_aot_launch([B, T, H, K], [B, T, H, V], recurrence)
    assert grid == (B * H, -(-V // columns))
    check(aot_kda_two_nodes, ref.recurrent_kda, shape, torch.float16)


@pytest.mark.parametrize(("kernel", "dtype"), [(aot_kda, torch.float16), (k3plugins.chunk_kda, torch.float16),
                                               (k3plugins.chunk_kda, torch.float32)],
                         ids=["aot", "chunk-float16", "chunk-float32"])
def test_chunked_kernels_steep_gates(kernel, dtype: torch.dtype) -> None:
    """The chunked kernels with chunks whose gates sum far below -80 (exp(-G) would overflow float32 if
    factored) next to mild ones: they take the differences there, as the eager op does, and stay finite and
    within their bound."""
    inputs = list(kda_inputs(1, 3 * C + 2, 2, 32, 32, dtype, seed=3))
    inputs[3][:, C:2 * C] = -30.0  # a whole chunk at -30 a token: its gates sum to -480
    inputs[3][:, 2 * C + 3, 0] = -1000.0  # one channel of one token all but erases its state
    o, state = kernel(*inputs)
    o_ref, state_ref = ref.recurrent_kda(*(t.double() for t in inputs))
    assert o.isfinite().all() and state.isfinite().all()
    o_tol, state_tol = CHUNKED_TOLERANCES[dtype]
    assert rel_error(o, o_ref) < o_tol and rel_error(state, state_ref) < state_tol


@pytest.mark.parametrize("T", [1, C + 3], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("launcher", AOT_LAUNCHERS)
def test_aot_kernel_state_in_place(launcher: str, dtype: torch.dtype, T: int) -> None:
    """TensorRT aliases the final state to the initial state: one buffer for both."""
    inputs = kda_inputs(2, T, 2, 32, 48, dtype, seed=5)
    o_ref, state_ref = ref.recurrent_kda(*(t.double() for t in inputs))
    state = inputs[5].clone()
    o, final = AOT_LAUNCHERS[launcher](*inputs[:5], state, final_state=state)
    assert final is state
    o_tol, state_tol = aot_tolerances(T)[dtype]
    assert rel_error(o, o_ref) < o_tol and rel_error(state, state_ref) < state_tol


@pytest.mark.parametrize("T", [1, STEPPED, 2 * C + 3], ids=["decode", "verify", "prefill"])
@pytest.mark.parametrize("launcher", AOT_LAUNCHERS)
def test_aot_kernel_ragged_rows(launcher: str, T: int) -> None:
    """Rows right-padded as the graph pads them (k, beta and g zeroed), float16: each row's state and valid
    outputs are those of the row run alone on its valid prefix; a row with no token keeps its state
    exactly."""
    lengths = sorted({0, 1, T // 2, T})
    q, k, v, g, beta, state = kda_inputs(len(lengths), T, 2, 32, 32, torch.float16, seed=T)
    for b, n in enumerate(lengths):
        k[b, n:], g[b, n:], beta[b, n:] = 0, 0, 0
    o, final = AOT_LAUNCHERS[launcher](q, k, v, g, beta, state)
    o_tol, state_tol = aot_tolerances(T)[torch.float16]
    for b, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(final[b], state[b])
            continue
        o_ref, state_ref = ref.recurrent_kda(*(t[b:b + 1, :n].double() for t in (q, k, v, g, beta)),
                                             state[b:b + 1].double())
        assert rel_error(final[b:b + 1], state_ref) < state_tol
        assert rel_error(o[b:b + 1, :n], o_ref) < o_tol
