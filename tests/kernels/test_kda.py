"""The KDA Triton kernels against the eager reference ops (run in float64 on the same inputs).

bfloat16 is not tested: the interpreter's bf16 arithmetic is silently wrong.
"""

from __future__ import annotations

import pytest
import torch
from reference import kda_inputs, rel_error

import k3export.ops as ref
import k3plugins

# float16 inputs are rounded before both sides see them, so the kernel's error is its float32
# arithmetic plus rounding o to float16 (relative 2^-11 per element, about 5e-4), and the float32
# state carries no rounding at all.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-5)}


def check(kernel, reference, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    inputs = kda_inputs(*shape, dtype, seed=sum(shape))
    o, state = kernel(*inputs)
    o_ref, state_ref = reference(*(t.double() for t in inputs))
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert state.dtype == torch.float32 and state.shape == state_ref.shape
    o_tol, state_tol = TOLERANCES[dtype]
    assert rel_error(o, o_ref) < o_tol
    assert rel_error(state, state_ref) < state_tol


# (B, T, H, K, V): K and V not powers of two or not multiples of the V block exercise the masks.
@pytest.mark.parametrize("shape", [(1, 1, 2, 32, 32), (2, 1, 3, 64, 48), (2, 7, 2, 48, 64),
                                   (1, 33, 1, 32, 32), (1, 1, 2, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_recurrent_kda(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check(k3plugins.recurrent_kda, ref.recurrent_kda, shape, dtype)


# Ragged T (not a multiple of the 64-token chunk), several chunks, and one case at K = V = 128.
@pytest.mark.parametrize("shape", [(1, 20, 1, 32, 32), (2, 64, 2, 32, 32), (1, 150, 2, 48, 40),
                                   (2, 100, 1, 64, 64), (1, 70, 1, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_kda(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check(k3plugins.chunk_kda, ref.chunk_kda, shape, dtype)


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
    o_tol, state_tol = TOLERANCES[dtype]
    for b, n in enumerate(lengths):
        if n == 0:  # no valid token: the state as given
            assert torch.equal(final[b], state[b])
            continue
        row = [t[b:b + 1, :n].double() for t in (q, k, v, g, beta)]
        o_ref, state_ref = ref.recurrent_kda(*row, state[b:b + 1].double())
        assert rel_error(final[b:b + 1], state_ref) < state_tol
        assert rel_error(o[b:b + 1, :n], o_ref) < o_tol
