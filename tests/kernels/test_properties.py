"""Property-based tests (hypothesis) of the Triton launchers, run by Triton's interpreter in float32,
against the eager ops (`torch.ops.k3.kda`, `torch.ops.k3.latent_mla`) run in float64 on the same inputs.

Draws as in tests/test_properties.py: random shapes within small limits, T at the chunk's edges, decays at
the lower bound (g near -5), beta near 0 and 1; for latent MLA, per-row cache lengths (an empty cache and a
full one among them), the decode (split-KV) and prefill kernels, and near one-hot softmaxes. The
interpreter is slow: few examples, small sizes.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import kda_inputs, rel_error
from torch import Tensor

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
import k3plugins
from k3plugins import mla

CHUNK = k3plugins.kda.CHUNK_SIZE


@st.composite
def kda_cases(draw, lengths: st.SearchStrategy[int], max_rows: int, max_k: int) -> dict:
    """Shapes with B * H <= max_rows (the interpreter's cost grows with it), and the drawn regimes."""
    B = draw(st.integers(1, max_rows))
    return {"B": B, "T": draw(lengths), "H": draw(st.integers(1, max_rows // B)),
            "K": draw(st.integers(1, max_k)), "V": draw(st.integers(1, 48)),
            "seed": draw(st.integers(0, 2**16)),
            "decay": draw(st.sampled_from(["mild", "lower_bound", "mixed", "none"])),
            "beta": draw(st.sampled_from(["uniform", "near_0", "near_1"]))}


def kda_case_inputs(case: dict) -> tuple[Tensor, ...]:
    """tests/reference.py's valid float32 inputs (k L2-normed, q scaled) with the drawn decays and
    betas: g stays in (-5, 0] and beta in (0, 1)."""
    q, k, v, g, beta, state = kda_inputs(case["B"], case["T"], case["H"], case["K"], case["V"],
                                         torch.float32, seed=case["seed"])
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    near = 1e-3 * (1 - torch.rand(g.shape, generator=gen))  # in (0, 1e-3]
    if case["decay"] == "lower_bound":
        g = -5 * (1 - near)
    elif case["decay"] == "mixed":  # per channel, steep next to almost none
        g = torch.where(torch.rand(g.shape, generator=gen) < 0.5, -5 * (1 - near), -near)
    elif case["decay"] == "none":
        g = torch.zeros_like(g)
    small = 1e-3 * (1 - torch.rand(beta.shape, generator=gen))
    if case["beta"] == "near_0":
        beta = small
    elif case["beta"] == "near_1":
        beta = 1 - small
    return q, k, v, g, beta, state


def eager_kda(*inputs: Tensor) -> tuple[Tensor, Tensor]:
    return torch.ops.k3.kda(*(t.double() for t in inputs))


# The recurrent kernel multiplies decays step by step as the contract reads: float32 rounding only
# (measured up to 3e-7 over 40 draws).
RECURRENT_BOUND = 1e-5
# The chunked kernel, like the eager chunked form, takes exp(G_i - G_j) from the within-chunk
# cumulative sum G of g, whose float32 absolute error grows with |G| (up to 16 x 5 at the lower
# bound): the bound tests/test_properties.py states for the eager chunked form in float32
# (the kernel measured up to 8.3e-7 over 40 draws).
CHUNK_BOUND = 5e-5


@settings(max_examples=12, deadline=None)
@given(case=kda_cases(st.one_of(st.just(1), st.integers(1, 9)), max_rows=4, max_k=128))
def test_recurrent_kda_matches_eager(case: dict) -> None:
    inputs = kda_case_inputs(case)
    o, state = k3plugins.recurrent_kda(*inputs)
    o_ref, state_ref = eager_kda(*inputs)
    assert o.dtype == state.dtype == torch.float32
    assert o.shape == o_ref.shape and state.shape == state_ref.shape
    assert rel_error(o, o_ref) < RECURRENT_BOUND and rel_error(state, state_ref) < RECURRENT_BOUND


@settings(max_examples=6, deadline=None)
@given(case=kda_cases(st.one_of(st.sampled_from([1, CHUNK, CHUNK + 1]), st.integers(2, 2 * CHUNK + 3)),
                      max_rows=2, max_k=64))
def test_chunk_kda_matches_eager(case: dict) -> None:
    inputs = kda_case_inputs(case)
    o, state = k3plugins.chunk_kda(*inputs)
    o_ref, state_ref = eager_kda(*inputs)
    assert o.dtype == state.dtype == torch.float32
    assert o.shape == o_ref.shape and state.shape == state_ref.shape
    assert rel_error(o, o_ref) < CHUNK_BOUND and rel_error(state, state_ref) < CHUNK_BOUND


@settings(max_examples=4, deadline=None)
@given(case=kda_cases(st.sampled_from([CHUNK, CHUNK + 1, 80]), max_rows=1, max_k=32),
       valid=st.lists(st.integers(0, 80), min_size=2, max_size=2), chunked=st.booleans())
def test_kda_padded_rows_keep_their_state(case: dict, valid: list[int], chunked: bool) -> None:
    """The launchers' ragged-batch contract: a row right-padded with k, beta and g zeroed past its
    valid length ends in the state (and has the valid outputs) of that row run alone on its prefix."""
    rows = [kda_case_inputs({**case, "seed": case["seed"] + b}) for b in range(len(valid))]
    inputs = [torch.cat(parts) for parts in zip(*rows, strict=True)]
    q, k, v, g, beta, state = inputs
    T = q.shape[1]
    for b, n in enumerate(valid):
        k[b, n:], g[b, n:], beta[b, n:] = 0, 0, 0
    o, final = (k3plugins.chunk_kda if chunked else k3plugins.recurrent_kda)(*inputs)
    for b, n in enumerate(min(n, T) for n in valid):
        if n == 0:
            assert torch.equal(final[b], state[b])  # no valid token: the state as given
            continue
        o_ref, state_ref = eager_kda(*(t[b:b + 1, :n] for t in (q, k, v, g, beta)), state[b:b + 1])
        assert rel_error(final[b:b + 1], state_ref) < CHUNK_BOUND
        assert rel_error(o[b:b + 1, :n], o_ref) < CHUNK_BOUND
        assert torch.isfinite(o[b]).all()  # padded positions: finite, values unspecified


@st.composite
def mla_cases(draw) -> dict:
    """Per-row cache lengths within a capacity C (above the decode split size at times, so decode
    splits the cache), T on both sides of the decode/prefill switch, and the (v_dim, rope) widths of
    the kernels' two smaller block families."""
    T = draw(st.sampled_from([1, 2, mla.DECODE_MAX_T, mla.DECODE_MAX_T + 1, 65]))
    C = draw(st.integers(T, 300 if T <= mla.DECODE_MAX_T else 100))
    B = draw(st.integers(1, 3))
    v_dims, ropes = draw(st.sampled_from([((17, 32), (1, 16)), ((65, 128), (17, 32))]))
    v_dim = draw(st.integers(*v_dims))
    # Each row's length + T fits the capacity; the ends are drawn more often.
    room = st.one_of(st.just(0), st.just(C - T), st.integers(0, C - T))
    return {"B": B, "T": T, "H": draw(st.integers(1, 4)), "C": C, "v_dim": v_dim,
            "D": v_dim + draw(st.integers(*ropes)),
            "cache_lengths": draw(st.lists(room, min_size=B, max_size=B)),
            "sharp": draw(st.booleans()), "seed": draw(st.integers(0, 2**16))}


@settings(max_examples=15, deadline=None)
@given(case=mla_cases())
def test_latent_mla_matches_eager(case: dict) -> None:
    B, T, C, D, v_dim = case["B"], case["T"], case["C"], case["D"], case["v_dim"]
    gen = torch.Generator().manual_seed(case["seed"])
    q = torch.randn(B, T, case["H"], D, generator=gen)
    kv = torch.randn(B, 1, C, D, generator=gen)
    cache_lengths = torch.tensor(case["cache_lengths"], dtype=torch.int64)
    scale = (10.0 if case["sharp"] else 1.0) * D**-0.5
    # The eager op's contract in float64 on the same values; then the rows past each row's own
    # length + T are made NaN for the kernel, which must not read them.
    o_ref = torch.ops.k3.latent_mla(q.double(), kv.double(), cache_lengths, v_dim, scale)
    for b, length in enumerate(case["cache_lengths"]):
        kv[b, 0, length + T:] = float("nan")
    o = k3plugins.latent_mla(q, kv, cache_lengths, v_dim, scale)
    assert o.dtype == torch.float32 and o.shape == o_ref.shape
    assert rel_error(o, o_ref) < 1e-5  # float32 rounding; measured up to 6e-7 over 40 draws
