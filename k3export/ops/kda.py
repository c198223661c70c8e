"""KDA (Kimi Delta Attention) recurrence: the reference math behind `torch.ops.k3.kda`.

Contract, per batch b and head h, with S the [K, V] state:
    S <- diag(exp(g_t)) S;  u = v_t - S^T k_t;  S <- S + beta_t k_t u^T;  o_t = S^T q_t
q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V].
Returns o [B, T, H, V] in v's dtype and the final state in initial_state's dtype.
State math runs in float32 (float64 when any input is float64, for tight reference tests).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from k3export.errors import UserError

CHUNK_SIZE = 64
# Width of the blocks whose decays are factored against one reference token (_intra_chunk_scores).
SUB_CHUNK = 16


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """Token by token, exactly as the contract reads: the naive reference."""
    dtype, out_dtype = _compute_dtype(q, k, v, g, beta, initial_state), v.dtype
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    state = initial_state.to(dtype)
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None]
        u = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + beta[:, t, :, None, None] * k[:, t, :, :, None] * u[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    o = torch.stack(outputs, dim=1)
    return o.to(out_dtype), state.to(initial_state.dtype)


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
              chunk_size: int = CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """Chunked form (UT transform): within a chunk of C tokens, with G the cumulative sum of g,
        A_kk[i,j] = beta_i sum_d k_i k_j exp(G_i - G_j)  (j < i)
        T = (I + A_kk)^-1 diag(beta);  W = T (exp(G) * K);  U = T V
    and across chunks, carrying S:
        V' = U - W S;  O = (Q * exp(G)) S + tril(A_qk) V';  S <- exp(G_C) S + (K exp(G_C - G))^T V'
    Everything but the state pass runs for all chunks and heads at once: only three matmuls per
    chunk are sequential. chunk_size must be a power of two, at least SUB_CHUNK.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype, out_dtype = _compute_dtype(q, k, v, g, beta, initial_state), v.dtype
    C = chunk_size
    if C < SUB_CHUNK or C & (C - 1):
        raise UserError(f"chunk_kda: chunk_size {C}: expected a power of two >= {SUB_CHUNK}")
    pad = (-T) % C
    N = (T + pad) // C

    def chunked(x: Tensor) -> Tensor:
        """[B, T, H, ...] -> [N, B * H, C, ...], chunk-major so that the state pass reads each chunk
        contiguously. Padding tokens have k = 0, beta = 0 and g = 0: they leave the state untouched."""
        x = torch.nn.functional.pad(x.to(dtype), (0, 0) * (x.dim() - 2) + (0, pad))
        x = x.unflatten(1, (N, C)).movedim(3, 1)  # [B, H, N, C, ...]
        return x.movedim(2, 0).reshape(N, B * H, C, *x.shape[4:])

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    G = g.cumsum(dim=2)
    A_qk, A_kk = _intra_chunk_scores(q, k, G)
    # UT transform, W and U together: [W | U] = (I + diag(beta) A_kk)^-1 diag(beta) [exp(G) K | V].
    decay = G.exp()
    rhs = beta[..., None] * torch.cat([decay * k, v], -1)
    WU = _unit_lower_inverse(beta[..., None] * A_kk) @ rhs
    W, U = WU[..., :K], WU[..., K:]
    QG = q * decay
    G_last = G[:, :, -1:]
    K_tail = ((G_last - G).exp() * k).transpose(-1, -2).contiguous()  # [N, BH, K, C]: decay to the chunk end
    state_decay = G_last.exp().transpose(-1, -2)  # [N, BH, K, 1]

    state = initial_state.to(dtype).flatten(0, 1)  # [BH, K, V]
    V_new = torch.empty_like(U)
    O = torch.empty_like(U)
    for n in range(N):
        torch.sub(U[n], W[n] @ state, out=V_new[n])
        torch.bmm(QG[n], state, out=O[n])
        state = torch.baddbmm(state_decay[n] * state, K_tail[n], V_new[n])
    o = torch.baddbmm(O.flatten(0, 1), A_qk.flatten(0, 1), V_new.flatten(0, 1))
    o = o.view(N, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), state.view(B, H, K, V).to(initial_state.dtype)


def _diagonal_blocks(x: Tensor, size: int) -> Tensor:
    """The diagonal size x size blocks of matrices x [..., C, C], as a view [..., C/size, size, size]."""
    n = x.shape[-1] // size
    return x.unflatten(-1, (n, size)).unflatten(-3, (n, size)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _unit_lower_inverse(L: Tensor) -> Tensor:
    """(I + L)^-1 for strictly lower triangular L [..., C, C] (C a power of two), by doubling:
    [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]] for every diagonal block of one size at
    once. A few batched matmuls instead of one LAPACK solve per matrix, which stalls when other
    processes hold the cores."""
    C = L.shape[-1]
    inverse = torch.eye(C, dtype=L.dtype, device=L.device).expand_as(L).clone()
    size = 2
    while size <= C:
        h = size // 2
        blocks, inverse_blocks = _diagonal_blocks(L, size), _diagonal_blocks(inverse, size)
        inverse_blocks[..., h:, :h] = -(inverse_blocks[..., h:, h:] @ blocks[..., h:, :h]
                                        @ inverse_blocks[..., :h, :h])
        size *= 2
    return inverse


def _intra_chunk_scores(q: Tensor, k: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """A_qk (j <= i) and A_kk (j < i) of every chunk: sum_d x_i[d] k_j[d] exp(G_i[d] - G_j[d]),
    x = q or k, as [.., C, C] with zeros above the diagonal. No [C, C, K] tensor is built.

    exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j) with r the first token of i's sub-chunk of
    SUB_CHUNK tokens, so each row block is one matmul. G falls along a chunk (g <= 0), so both
    factors are <= 1 for j before the sub-chunk (where they may underflow to 0 only when the
    true product is below that too); inside it exp(G_r - G_j) grows up to exp(SUB_CHUNK x the
    largest decay per step), e^75 at the published lower bound of -5. Where a sub-chunk decays
    more than the dtype can hold, its diagonal block is formed from the differences instead."""
    C, S = q.shape[-2], SUB_CHUNK
    A_qk = q.new_zeros(*q.shape[:-1], C)
    A_kk = q.new_zeros(*q.shape[:-1], C)
    for a in range(0, C, S):
        ref = G[..., a:a + 1, :]
        row_decay = (G[..., a:a + S, :] - ref).exp()
        rows = torch.cat([q[..., a:a + S, :] * row_decay, k[..., a:a + S, :] * row_decay], -2)
        cols = k[..., :a + S, :] * (ref - G[..., :a + S, :]).exp()
        scores = rows @ cols.transpose(-1, -2)
        A_qk[..., a:a + S, :a + S] = scores[..., :S, :]
        A_kk[..., a:a + S, :a + S] = scores[..., S:, :]
    blocks = G.unflatten(-2, (C // S, S))
    span = (blocks[..., 0, :] - blocks[..., -1, :]).amax()
    if span > math.log(torch.finfo(G.dtype).max) - 8:
        _exact_diagonal_blocks(q, k, G, A_qk, A_kk)
    return A_qk.tril(), A_kk.tril(-1)


def _exact_diagonal_blocks(q: Tensor, k: Tensor, G: Tensor, A_qk: Tensor, A_kk: Tensor) -> None:
    """Overwrites the diagonal sub-chunk blocks of A_qk and A_kk with exp(G_i - G_j) formed from
    the differences, masked to j <= i before exponentiating: for decays too steep to factor."""
    S = SUB_CHUNK
    qb, kb, Gb = (x.unflatten(-2, (-1, S)) for x in (q, k, G))  # [..., C/S, S, K]
    causal = torch.ones(S, S, dtype=torch.bool, device=G.device).tril()
    diff = Gb[..., :, None, :] - Gb[..., None, :, :]
    decayed_k = diff.masked_fill(~causal[..., None], float("-inf")).exp() * kb[..., None, :, :]
    qk = torch.einsum("...id,...ijd->...ij", qb, decayed_k)
    kk = torch.einsum("...id,...ijd->...ij", kb, decayed_k)
    for s in range(Gb.shape[-3]):
        A_qk[..., s * S:(s + 1) * S, s * S:(s + 1) * S] = qk[..., s, :, :]
        A_kk[..., s * S:(s + 1) * S, s * S:(s + 1) * S] = kk[..., s, :, :]


@torch.library.custom_op("k3::kda", mutates_args=())
def kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
        initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """Decode (T = 1) runs the recurrence; prefill runs the chunked form."""
    step = recurrent_kda if q.shape[1] == 1 else chunk_kda
    return step(q, k, v, g, beta, initial_state)


@kda.register_fake
def _(q, k, v, g, beta, initial_state):
    return v.new_empty(v.shape), initial_state.new_empty(initial_state.shape)
