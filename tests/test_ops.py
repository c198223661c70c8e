"""The two custom ops: KDA's chunked fast path against its token-by-token recurrence, and the
latent attention op against a per-head softmax attention written here."""

import importlib

import pytest
import torch
from reference import kda_inputs, rel_error

from k3export.ops import chunk_kda, recurrent_kda
from k3export.ops.kda import CHUNK_SIZE

kda_module = importlib.import_module("k3export.ops.kda")  # the package's `kda` is the op


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize(("B", "T", "H"), [(1, 1, 1), (2, 63, 2), (1, 64, 3), (2, 150, 2)])
def test_chunk_matches_recurrent(dtype, tol, B, T, H):
    inputs = kda_inputs(B, T, H, 32, 24, dtype)
    o_ref, s_ref = recurrent_kda(*inputs)
    o, s = chunk_kda(*inputs)
    assert o.dtype == inputs[2].dtype and s.dtype == inputs[5].dtype
    assert rel_error(o, o_ref) < tol
    assert rel_error(s, s_ref) < tol


@pytest.mark.parametrize("T", [1, 15, 16, 17, 64, 200])
@pytest.mark.parametrize("decay", ["mild", "lower_bound", "steep", "one_steep_chunk"])
def test_chunk_matches_recurrent_at_boundaries_and_decays(T, decay):
    """Chunk boundaries (T = 1, a chunk less one, one chunk, one past it, several) and decays at
    the published lower bound of -5 per step (the factored products reach e^80) and beyond it: -20
    per step, too steep to factor in float32, so every chunk is formed from differences; and one
    chunk of one row and head at -15 per step among mild ones, formed from differences alone."""
    q, k, v, g, beta, state = kda_inputs(2, T, 2, 32, 24, torch.float64, seed=T)
    gen = torch.Generator().manual_seed(T)
    if decay == "lower_bound":
        g = -5 + 1e-3 * torch.rand(g.shape, generator=gen, dtype=torch.float64)
    elif decay == "steep":
        g = -20 * torch.rand(g.shape, generator=gen, dtype=torch.float64)
    elif decay == "one_steep_chunk":
        g = g.clone()
        g[1, CHUNK_SIZE:2 * CHUNK_SIZE, 0] = -15.0
    inputs = (q, k, v, g, beta, state)
    o_ref, s_ref = recurrent_kda(*inputs)
    o, s = chunk_kda(*inputs)
    assert rel_error(o, o_ref) < 1e-13 and rel_error(s, s_ref) < 1e-13
    o, s = chunk_kda(*(t.float() for t in inputs))
    assert rel_error(o, o_ref) < 1e-5 and rel_error(s, s_ref) < 1e-5
    assert o.isfinite().all() and s.isfinite().all()


@pytest.mark.parametrize(("K", "V"), [(16, 8), (1, 8), (16, 1)])
def test_chunk_kda_leaves_its_inputs_and_returns_a_contiguous_state(K, V):
    """The chunked layout is a view of the inputs where it can be (B = 1, whole chunks), and the
    state is updated in place, transposed (with K or V = 1 its transpose is already contiguous):
    the inputs must come back unchanged, the final state as [B, H, K, V]."""
    inputs = kda_inputs(1, 2 * CHUNK_SIZE, 2, K, V, torch.float32)
    copies = [t.clone() for t in inputs]
    _, s = chunk_kda(*inputs)
    assert all(torch.equal(t, c) for t, c in zip(inputs, copies, strict=True))
    assert s.shape == (1, 2, K, V) and s.is_contiguous()


@pytest.mark.parametrize("chunks_per_block", [1, 3])
def test_chunk_kda_blocks_of_chunks(monkeypatch, chunks_per_block):
    """The chunk terms are formed a block of chunks at a time and the state carried across blocks:
    blocks of 1 and of 3 chunks (the last one short) give the recurrence's result."""
    inputs = kda_inputs(2, 7 * CHUNK_SIZE + 5, 2, 16, 8, torch.float64)
    monkeypatch.setattr(kda_module, "BLOCK_ROWS", chunks_per_block * 2 * 2 * CHUNK_SIZE)  # B x H = 4
    o_ref, s_ref = recurrent_kda(*inputs)
    o, s = chunk_kda(*inputs)
    assert rel_error(o, o_ref) < 1e-13 and rel_error(s, s_ref) < 1e-13


def test_recurrent_matches_written_out_delta_rule():
    """The recurrence itself, one head at a time with explicit matrices."""
    q, k, v, g, beta, state = kda_inputs(1, 5, 2, 4, 3, torch.float64)
    o, final = recurrent_kda(q, k, v, g, beta, state)
    for h in range(2):
        S = state[0, h].clone()
        for t in range(5):
            S = torch.diag(g[0, t, h].exp()) @ S
            u = v[0, t, h] - S.T @ k[0, t, h]
            S = S + beta[0, t, h] * torch.outer(k[0, t, h], u)
            torch.testing.assert_close(o[0, t, h], S.T @ q[0, t, h])
        torch.testing.assert_close(final[0, h], S)


def test_kda_op_dispatch_and_chunk_boundary_state():
    """The registered op agrees with the recurrence for T = 1 and T > 1; splitting a sequence
    at any point and carrying the state gives the same result."""
    inputs = kda_inputs(2, 100, 2, 32, 32, torch.float32)
    o_ref, s_ref = recurrent_kda(*inputs)
    o, s = torch.ops.k3.kda(*inputs)
    assert rel_error(o, o_ref) < 1e-5 and rel_error(s, s_ref) < 1e-5
    first = [t[:, :37] for t in inputs[:5]]
    o1, s1 = torch.ops.k3.kda(*first, inputs[5])
    o2, s2 = torch.ops.k3.kda(*[t[:, 37:] for t in inputs[:5]], s1)
    assert rel_error(torch.cat([o1, o2], 1), o_ref) < 1e-5 and rel_error(s2, s_ref) < 1e-5


@pytest.mark.parametrize("T", [1, 5, CHUNK_SIZE, CHUNK_SIZE + 1, 3 * CHUNK_SIZE + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kda_as_two_nodes(T, dtype):
    """kda as the export writes it, kda_prepare's terms then kda_chunk_recurrence (the network evaluator's
    references), against the recurrence in float64, final state included: decode steps from the token
    inputs, a partial chunk, one, one more, several."""
    inputs = kda_inputs(2, T, 2, 16, 8, dtype, seed=T)
    terms = torch.ops.k3.kda_prepare(*inputs[:5])
    assert [t.dtype for t in terms] == [dtype] * 5 + [torch.float32]
    assert terms[5].shape == (2, -(-T // CHUNK_SIZE), 2, 16)
    o, s = torch.ops.k3.kda_chunk_recurrence(*inputs[:5], *terms, inputs[5])
    o_ref, s_ref = recurrent_kda(*[t.double() for t in inputs])
    o_tol, s_tol = (1e-5, 1e-5) if dtype == torch.float32 else (3e-3, 3e-3)  # the terms rounded to float16
    assert o.dtype == dtype and rel_error(o, o_ref) < o_tol and rel_error(s, s_ref) < s_tol


def test_kda_half_precision_inputs():
    """float16 q/k/v with float32 gates: the state stays float32, output in v's dtype.

    The reference runs in float64 on the same (float16-exact) inputs, so the only error is the
    float32 math plus rounding o to float16 (unit roundoff 4.9e-4; measured 2e-4 relative)."""
    inputs = kda_inputs(1, 80, 2, 32, 32, torch.float16)
    o, s = torch.ops.k3.kda(*inputs)
    assert o.dtype == torch.float16 and s.dtype == torch.float32
    o_ref, s_ref = recurrent_kda(*[t.double() for t in inputs])
    assert rel_error(o, o_ref) < 1e-3 and rel_error(s, s_ref) < 1e-5


@pytest.mark.parametrize(("T", "C", "lengths"), [(1, 1, (0, 0)), (1, 300, (299, 17)), (7, 7, (0, 0)),
                                                 (5, 40, (35, 3))])
def test_latent_mla_matches_per_head_attention(T, C, lengths):
    """Row b's T new rows sit at cache_lengths[b] ..; rows past them are garbage never read."""
    B, H, D, v_dim, scale = 2, 3, 48, 32, 0.2
    gen = torch.Generator().manual_seed(T * 1000 + C)
    q = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    kv = torch.randn(B, 1, C, D, generator=gen, dtype=torch.float64)
    o = torch.ops.k3.latent_mla(q, kv, torch.tensor(lengths), v_dim, scale)
    for b in range(B):
        for t in range(T):
            visible = lengths[b] + t + 1
            for h in range(H):
                p = torch.softmax(scale * kv[b, 0, :visible] @ q[b, t, h], dim=0)
                torch.testing.assert_close(o[b, t, h], p @ kv[b, 0, :visible, :v_dim])
