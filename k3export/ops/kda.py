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

CHUNK_SIZE = 16
# Token-head rows whose chunk terms are formed at once (measured fastest at 2048-4096 for 8 and
# 96 heads: fewer pay per-op overhead, more page faults).
BLOCK_ROWS = 4096


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


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """Chunked form (UT transform): within a chunk of C tokens, with G the cumulative sum of g,
        A_kk[i,j] = beta_i sum_d k_i k_j exp(G_i - G_j)  (j < i)
        T = (I + A_kk)^-1 diag(beta);  W = T (exp(G) * K);  U = T V
    and across chunks, carrying S:
        V' = U - W S;  O = (Q * exp(G)) S + tril(A_qk) V';  S <- exp(G_C) S + (K exp(G_C - G))^T V'
    The state pass costs the same per token whatever C is; the rest grows with C, so chunks are
    short: 16 tokens, few enough that exp(G_i - G_j) factors as exp(G_i) exp(-G_j) at the published
    gate bound (_chunk_terms). Chunks go in blocks of about BLOCK_ROWS token-head rows: the terms
    of a block's chunks are formed at once (all heads too), then the state passes through them,
    three matmuls a chunk. Blocks keep the temporaries small, so that memory is reused instead of
    mapped afresh (measured: a fifth of the time went to page faults with the whole sequence at once).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype, out_dtype = _compute_dtype(q, k, v, g, beta, initial_state), v.dtype
    C = CHUNK_SIZE
    pad = (-T) % C
    N, BH = (T + pad) // C, B * H

    def chunked(x: Tensor) -> Tensor:
        """[B, T, H, ...] -> [N, B * H, C, ...], chunk-major: a view of the input where the layout
        allows (so never written; _chunk_terms copies a block at a time). Padding tokens have
        k = 0, beta = 0 and g = 0: they leave the state untouched."""
        x = x.to(dtype)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        x = x.unflatten(1, (N, C)).movedim(3, 1)  # [B, H, N, C, ...]
        return x.movedim(2, 0).reshape(N, BH, C, *x.shape[4:])

    q, k, v, g = (chunked(t) for t in (q, k, v, g))
    beta = chunked(beta)[..., None]
    o = torch.empty(N, BH, C, V, dtype=dtype)
    # The pass carries S transposed ([V, K]) so that the decayed keys enter the update as they lie
    # (measured: a transposed [K, C] operand, or transposing them first, costs more than this); a
    # copy always, as it is updated in place.
    state = initial_state.to(dtype).flatten(0, 1).mT.clone(memory_format=torch.contiguous_format)
    chunks_per_block = max(1, BLOCK_ROWS // (BH * C))
    for first in range(0, N, chunks_per_block):
        block = slice(first, first + chunks_per_block)
        terms = _chunk_terms(q[block], k[block], v[block], g[block], beta[block])
        QG, W, U, K_tail, decay_last, A_qk = (x.unflatten(0, (-1, BH)) for x in terms)
        V_new = torch.empty_like(U)
        for n in range(U.shape[0]):
            torch.baddbmm(U[n], W[n], state.mT, alpha=-1, out=V_new[n])
            torch.bmm(QG[n], state.mT, out=o[first + n])
            state.mul_(decay_last[n]).baddbmm_(V_new[n].mT, K_tail[n])
        o[block].flatten(0, 1).baddbmm_(A_qk.flatten(0, 1), V_new.flatten(0, 1))
    o = o.view(N, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), state.mT.reshape(B, H, K, V).contiguous().to(initial_state.dtype)


def _chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """What the state pass reads of chunks [.., BH, C, K] (beta [.., BH, C, 1]; views of the
    inputs), as [M = .. x BH, ...]: Q exp(G), W, U, the keys decayed to the chunk's end, exp(G_C)
    [M, 1, K] and tril(A_qk). Three-dimensional, so that matmuls take transposed operands as they
    lie (with a fourth dimension torch copies them); the first op on each input makes the copy."""
    C = q.shape[-2]
    G = g.cumsum(dim=-2).flatten(0, 1)
    decay = G.exp()  # exp(G_i): decay since the chunk's start, <= 1
    QKG = torch.stack([q, k], -3).flatten(0, 1)  # [M, 2, C, K]
    # exp(G_i - G_j) = exp(G_i) exp(-G_j) in the scores, and exp(G_C) exp(-G_j) in the keys decayed
    # to the chunk's end. exp(-G_j) grows along the chunk, up to e^80 in 16 steps at the published
    # bound of -5 (e^88 overflows float32); a chunk that decays further is formed from differences.
    K_grown = QKG[:, 1] / decay
    QKG.mul_(decay[:, None])  # [Q exp(G); K exp(G)]
    scores = QKG.flatten(1, 2) @ K_grown.mT  # [M, 2C, C]: sum_d x_i k_j exp(G_i - G_j), x = q, k
    decay_last = decay[:, -1:]
    K_tail = K_grown.mul_(decay_last)  # k_j exp(G_C - G_j)
    steep = G.amin((1, 2)) < -(math.log(torch.finfo(G.dtype).max) - 8)
    if steep.any():
        scores[steep], K_tail[steep] = _from_differences(*(x.flatten(0, 1)[steep] for x in (q, k)), G[steep])
    A_qk, A_kk = scores[:, :C].tril(), scores[:, C:].tril(-1)
    # UT transform: T = (I + diag(beta) A_kk)^-1 diag(beta);  W = T (exp(G) K);  U = T V.
    beta = beta.flatten(0, 1)
    T = _unit_lower_inverse(A_kk.mul_(beta)).mul_(beta.mT)
    QG, KG = QKG.unbind(1)
    return QG, T @ KG, T @ v.flatten(0, 1), K_tail, decay_last, A_qk


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


def _from_differences(q: Tensor, k: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """The scores [.., 2C, C] and the keys decayed to the chunk's end [.., C, K] of chunks [.., C, K]
    that decay too steeply to factor: exp(G_i - G_j) formed from the differences, masked to j <= i
    before exponentiating."""
    C = G.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    decays = (G[..., :, None, :] - G[..., None, :, :]).masked_fill_(~causal[..., None], -math.inf).exp_()
    scores = torch.einsum("...xid,...ijd->...xij", torch.stack([q, k], -3), decays * k[..., None, :, :])
    return scores.flatten(-3, -2), k * (G[..., -1:, :] - G).exp()


@torch.library.custom_op("k3::kda", mutates_args=())
def kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
        initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """Decode (T = 1) runs the recurrence; prefill runs the chunked form."""
    step = recurrent_kda if q.shape[1] == 1 else chunk_kda
    return step(q, k, v, g, beta, initial_state)


@kda.register_fake
def _(q, k, v, g, beta, initial_state):
    return v.new_empty(v.shape), initial_state.new_empty(initial_state.shape)


# The exported graph runs kda as two nodes (k3export/onnx/ops.py): the chunks' state-free terms, then the
# recurrence over them, so that an engine's AOT kernels run prefill as two launches (an AOT plugin is one
# launch with no workspace: the terms are graph tensors between the two). These are the two nodes' references
# (the parsed network's evaluator calls them), in the kernels' layout: token rows [B, T, H, ...], chunks of
# CHUNK_SIZE tokens from the first.


@torch.library.custom_op("k3::kda_prepare", mutates_args=())
def kda_prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                beta: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(qg, kt, w [B, T, H, K], u [B, T, H, V], a_qk [B, T, H, CHUNK_SIZE], in v's dtype; decay_last
    [B, n_chunks, H, K], float32): chunk_kda's Q exp(G), keys decayed to the chunk's end, W, U, tril(A_qk) and
    exp(G_C) (_chunk_terms)."""
    B, T, H, K = q.shape
    C, dtype = CHUNK_SIZE, _compute_dtype(q, k, v, g, beta)
    N = -(-T // C)

    def chunked(x: Tensor) -> Tensor:  # [B, T, H, X] -> [N * B * H, C, X]
        x = torch.nn.functional.pad(x.to(dtype), (0, 0, 0, 0, 0, N * C - T))
        return x.unflatten(1, (N, C)).permute(1, 0, 3, 2, 4).reshape(N * B * H, C, x.shape[-1])

    terms = _chunk_terms(*(chunked(x)[None] for x in (q, k, v, g, beta[..., None])))
    QG, W, U, K_tail, decay_last, A_qk = terms

    def tokens(x: Tensor) -> Tensor:  # [N * B * H, C, X] -> [B, T, H, X]
        x = x.view(N, B, H, C, x.shape[-1]).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, x.shape[-1])
        return x[:, :T].to(v.dtype)

    return (*(tokens(x) for x in (QG, K_tail, W, U, A_qk)),
            decay_last.view(N, B, H, K).transpose(0, 1).float())


@kda_prepare.register_fake
def _(q, k, v, g, beta):
    B, T, H, K = q.shape
    x = q.new_empty(B, T, H, K, dtype=v.dtype)
    return (x, x.clone(), x.clone(), v.new_empty(v.shape), v.new_empty(B, T, H, CHUNK_SIZE),
            g.new_empty(B, -(-T // CHUNK_SIZE), H, K, dtype=torch.float32))


@torch.library.custom_op("k3::kda_chunk_recurrence", mutates_args=())
def kda_chunk_recurrence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, qg: Tensor, kt: Tensor,
                         w: Tensor, u: Tensor, a_qk: Tensor, decay_last: Tensor,
                         initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """kda's (o, final_state) from kda_prepare's terms, chunk by chunk:
        V' = U - W S;  O = qg S + a_qk V';  S <- decay_last S + kt^T V'
    A decode call (T = 1) steps the recurrence from the token inputs instead, as kda does."""
    if q.shape[1] == 1:
        return recurrent_kda(q, k, v, g, beta, initial_state)
    dtype = _compute_dtype(qg, u, initial_state)
    qg, kt, w, u, a_qk = (x.to(dtype).transpose(1, 2) for x in (qg, kt, w, u, a_qk))  # [B, H, T, ...]
    state = initial_state.to(dtype)
    o = torch.empty_like(u)
    for n, first in enumerate(range(0, q.shape[1], CHUNK_SIZE)):
        rows = slice(first, first + CHUNK_SIZE)
        V_new = u[:, :, rows] - w[:, :, rows] @ state
        o[:, :, rows] = qg[:, :, rows] @ state + a_qk[:, :, rows, :V_new.shape[2]] @ V_new
        state = decay_last[:, n, :, :, None].to(dtype) * state + kt[:, :, rows].mT @ V_new
    return o.transpose(1, 2).to(v.dtype), state.to(initial_state.dtype)


@kda_chunk_recurrence.register_fake
def _(q, k, v, g, beta, qg, kt, w, u, a_qk, decay_last, initial_state):
    return v.new_empty(v.shape), initial_state.new_empty(initial_state.shape)
