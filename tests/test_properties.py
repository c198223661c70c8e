"""Property-based tests (hypothesis) of the two eager ops against independent references written here:
the chunked KDA (`chunk_kda`, and `torch.ops.k3.kda`, which dispatches to it or to the recurrence) against
the contract's token recurrence, and `torch.ops.k3.latent_mla` against a plain softmax attention.

Draws: random shapes within small limits, T at the chunk's edges (1, 15, 16, 17), decays at the lower bound
(g near -5), mixed steep and mild decays, no decay, chunks that decay past float32's steep-chunk threshold,
beta near 0 and near 1. float64 must agree to
rounding; float32 within the bounds stated beside each test.
"""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from reference import kda_inputs, rel_error
from torch import Tensor

from k3export.ops import chunk_kda
from k3export.ops.kda import CHUNK_SIZE as CHUNK

# T at the chunk's edges and beyond, and anything else up to a little over eight chunks.
lengths = st.one_of(st.sampled_from([1, CHUNK - 1, CHUNK, CHUNK + 1]), st.integers(1, 8 * CHUNK + 3))
FAST = settings(max_examples=25, deadline=None)


@st.composite
def kda_cases(draw) -> dict:
    return {"B": draw(st.integers(1, 2)), "T": draw(lengths), "H": draw(st.integers(1, 3)),
            "K": draw(st.integers(1, 40)), "V": draw(st.integers(1, 24)),
            "seed": draw(st.integers(0, 2**16)),
            "decay": draw(st.sampled_from(["mild", "lower_bound", "mixed", "none", "steep_chunk"])),
            "beta": draw(st.sampled_from(["uniform", "near_0", "near_1"]))}


def kda_case_inputs(case: dict) -> tuple[Tensor, ...]:
    """tests/reference.py's valid inputs (k L2-normed, q scaled) in float64, with the drawn decays
    and betas: g stays in (-5, 0] and beta in (0, 1)."""
    q, k, v, g, beta, state = kda_inputs(case["B"], case["T"], case["H"], case["K"], case["V"],
                                         torch.float64, seed=case["seed"])
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    near = 1e-3 * (1 - torch.rand(g.shape, generator=gen, dtype=torch.float64))  # in (0, 1e-3]
    if case["decay"] == "lower_bound":
        g = -5 * (1 - near)
    elif case["decay"] == "mixed":  # per channel, steep next to almost none
        steep = torch.rand(g.shape, generator=gen) < 0.5
        g = torch.where(steep, -5 * (1 - near), -near)
    elif case["decay"] == "none":
        g = torch.zeros_like(g)
    elif case["decay"] == "steep_chunk":
        # A chunk's decay sums to between -81 and -97 (past the bound of -5 a token), around float32's
        # exp(-G) overflow at 88.7, which the chunked form's steep-chunk threshold keeps a margin of 8
        # from (k3export/ops/kda.py): a threshold past the overflow (-89.7 or -92.7 tried) gives inf.
        g = -(81 + 16 * torch.rand(g.shape, generator=gen, dtype=torch.float64)) / CHUNK
    small = 1e-3 * (1 - torch.rand(beta.shape, generator=gen, dtype=torch.float64))
    if case["beta"] == "near_0":
        beta = small
    elif case["beta"] == "near_1":
        beta = 1 - small
    return q, k, v, g, beta, state


def token_recurrence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     state: Tensor) -> tuple[Tensor, Tensor]:
    """The op's documented contract in float64, one token and one (batch, head) at a time:
    S <- diag(exp(g_t)) S;  u = v_t - S^T k_t;  S <- S + beta_t k_t u^T;  o_t = S^T q_t."""
    q, k, v, g, beta, S = (t.double() for t in (q, k, v, g, beta, state))
    S = S.clone()
    o = torch.empty(v.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            for t in range(q.shape[1]):
                S[b, h] = g[b, t, h].exp()[:, None] * S[b, h]
                u = v[b, t, h] - S[b, h].T @ k[b, t, h]
                S[b, h] += beta[b, t, h] * torch.outer(k[b, t, h], u)
                o[b, t, h] = S[b, h].T @ q[b, t, h]
    return o, S


@FAST
@given(case=kda_cases())
def test_chunk_kda_float64_matches_token_recurrence(case: dict) -> None:
    inputs = kda_case_inputs(case)
    o_ref, state_ref = token_recurrence(*inputs)
    for run in (chunk_kda, torch.ops.k3.kda):
        o, state = run(*inputs)
        assert o.dtype == state.dtype == torch.float64
        assert o.shape == o_ref.shape and state.shape == state_ref.shape
        # Same math in another order: rounding only (measured below 1e-14).
        assert rel_error(o, o_ref) < 1e-11
        assert rel_error(state, state_ref) < 1e-11


# float32 throughout (the state too), against float64 on the same float32-rounded inputs. The
# chunked form's float32 error is dominated by G, the within-chunk cumulative sum of g: its
# absolute error grows with |G| (up to C x 5 at the lower bound), and exp(G_i - G_j) turns it
# into a relative error of the decays. Measured up to 1.1e-5 relative over 600 draws with 64-token
# chunks (now 16; the float32 recurrence: below 2e-7); 5e-5 leaves a 4x margin.
FLOAT32_BOUND = 5e-5


@FAST
@given(case=kda_cases())
def test_chunk_kda_float32_within_bound(case: dict) -> None:
    inputs = tuple(t.float() for t in kda_case_inputs(case))
    o_ref, state_ref = token_recurrence(*inputs)
    for run in (chunk_kda, torch.ops.k3.kda):
        o, state = run(*inputs)
        assert o.dtype == state.dtype == torch.float32
        assert torch.isfinite(o).all() and torch.isfinite(state).all()
        assert rel_error(o, o_ref) < FLOAT32_BOUND
        assert rel_error(state, state_ref) < FLOAT32_BOUND


@FAST
@given(case=kda_cases())
def test_chunk_kda_float32_steep_chunks(case: dict) -> None:
    """Chunks whose decay sums to between -81 and -97, where the steep-chunk threshold's margin decides
    (the drawn kinds rarely fill a chunk there): finite, and within the float32 bound."""
    case = {**case, "decay": "steep_chunk", "T": max(case["T"], CHUNK)}
    inputs = tuple(t.float() for t in kda_case_inputs(case))
    o_ref, state_ref = token_recurrence(*inputs)
    o, state = chunk_kda(*inputs)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    assert rel_error(o, o_ref) < FLOAT32_BOUND and rel_error(state, state_ref) < FLOAT32_BOUND


@settings(max_examples=15, deadline=None)
@given(case=kda_cases(), split=st.floats(0, 1))
def test_kda_state_carries_across_calls(case: dict, split: float) -> None:
    """The state is the whole of the recurrence's memory: running a sequence in two calls, the first
    call's final state the second's initial state, gives the outputs and final state of one call."""
    assume(case["T"] > 1)
    inputs = kda_case_inputs(case)
    cut = 1 + round(split * (case["T"] - 2))  # both parts non-empty
    o_all, state_all = torch.ops.k3.kda(*inputs)
    o1, state1 = torch.ops.k3.kda(*(t[:, :cut] for t in inputs[:5]), inputs[5])
    o2, state2 = torch.ops.k3.kda(*(t[:, cut:] for t in inputs[:5]), state1)
    assert rel_error(torch.cat([o1, o2], dim=1), o_all) < 1e-11 and rel_error(state2, state_all) < 1e-11


@st.composite
def mla_cases(draw) -> dict:
    """B rows with their own cache lengths, T new rows each, within a capacity that leaves some rows
    past the longest row unused; D = v_dim + a rope slot."""
    B, v_dim = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    T = draw(st.one_of(st.sampled_from([1, 64, 65]), st.integers(1, 20)))
    cache_lengths = draw(st.lists(st.integers(0, 80), min_size=B, max_size=B))
    return {"B": B, "T": T, "H": draw(st.integers(1, 4)), "v_dim": v_dim,
            "D": v_dim + draw(st.integers(0, 24)), "cache_lengths": cache_lengths,
            "spare": draw(st.integers(0, 5)), "sharp": draw(st.booleans()),
            "seed": draw(st.integers(0, 2**16))}


def mla_case_inputs(case: dict, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, float]:
    """q, the cache kv [B, 1, C, D] and cache_lengths; rows past max(cache_lengths) + T are NaN (the
    op reads only up to there). A sharp case scales the scores up to near one-hot softmaxes."""
    B, T, D = case["B"], case["T"], case["D"]
    lengths = torch.tensor(case["cache_lengths"], dtype=torch.int64)
    used = int(lengths.max()) + T
    gen = torch.Generator().manual_seed(case["seed"])
    q = torch.randn(B, T, case["H"], D, generator=gen, dtype=torch.float64)
    kv = torch.randn(B, 1, used + case["spare"], D, generator=gen, dtype=torch.float64)
    kv[:, :, used:] = float("nan")
    scale = (10.0 if case["sharp"] else 1.0) * D**-0.5
    return q.to(dtype), kv.to(dtype), lengths, scale


def softmax_attention(q: Tensor, kv: Tensor, cache_lengths: Tensor, v_dim: int, scale: float) -> Tensor:
    """The op's contract in float64, one (row, query token, head) at a time: query t of row b
    attends to cache rows j <= cache_lengths[b] + t with softmax(scale * q . kv[j]); the values
    are kv[j, :v_dim]."""
    B, T, H, _ = q.shape
    o = torch.empty(B, T, H, v_dim, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            keys = kv[b, 0, :int(cache_lengths[b]) + t + 1].double()
            for h in range(H):
                p = torch.softmax(scale * (keys @ q[b, t, h].double()), dim=0)
                o[b, t, h] = p @ keys[:, :v_dim]
    return o


@settings(max_examples=30, deadline=None)
@given(case=mla_cases(), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_latent_mla_matches_softmax_attention(case: dict, dtype: torch.dtype) -> None:
    q, kv, cache_lengths, scale = mla_case_inputs(case, dtype)
    o = torch.ops.k3.latent_mla(q, kv, cache_lengths, case["v_dim"], scale)
    o_ref = softmax_attention(q, kv, cache_lengths, case["v_dim"], scale)
    assert o.dtype == dtype and o.shape == o_ref.shape
    # float64: rounding only. float32: a softmax-weighted mean of float32 rows over at most ~170
    # keys, measured below 1e-6 relative; 1e-5 leaves a margin.
    assert rel_error(o, o_ref) < (1e-12 if dtype == torch.float64 else 1e-5)

