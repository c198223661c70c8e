"""KDA (Kimi Delta Attention) recurrence: the reference math behind `torch.ops.k3.kda`.

Contract, per batch b and head h, with S the [K, V] state:
    S <- diag(exp(g_t)) S;  u = v_t - S^T k_t;  S <- S + beta_t k_t u^T;  o_t = S^T q_t
q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V].
Returns o [B, T, H, V] in v's dtype and the final state in initial_state's dtype.
State math runs in float32 (float64 when any input is float64, for tight reference tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_SIZE = 64


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
    """
    T = q.shape[1]
    dtype, out_dtype = _compute_dtype(q, k, v, g, beta, initial_state), v.dtype
    C = chunk_size
    pad = (-T) % C
    # Padding tokens have k = 0, beta = 0 and g = 0: they leave the state untouched.
    q, k, v, g = (torch.nn.functional.pad(t.to(dtype), (0, 0, 0, 0, 0, pad)).transpose(1, 2)
                  for t in (q, k, v, g))
    beta = torch.nn.functional.pad(beta.to(dtype), (0, 0, 0, pad)).transpose(1, 2)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    eye = torch.eye(C, dtype=dtype, device=q.device)

    state = initial_state.to(dtype)
    outputs = []
    for start in range(0, T + pad, C):
        qc, kc, vc, gc = (t[:, :, start:start + C] for t in (q, k, v, g))
        bc = beta[:, :, start:start + C]
        G = gc.cumsum(dim=2)
        # exp(G_i - G_j) from the difference, masked to j <= i before exponentiating.
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]
        decay = diff.masked_fill(~causal[:, :, None], float("-inf")).exp()
        A_kk = bc[..., None] * torch.einsum("bhid,bhjd,bhijd->bhij", kc, kc, decay) * strict
        A_qk = torch.einsum("bhid,bhjd,bhijd->bhij", qc, kc, decay)
        T_mat = torch.linalg.solve_triangular(eye + A_kk, torch.diag_embed(bc), upper=False,
                                              unitriangular=True)
        W = T_mat @ (G.exp() * kc)
        U = T_mat @ vc
        V_new = U - W @ state
        outputs.append((qc * G.exp()) @ state + A_qk @ V_new)
        G_last = G[:, :, -1:]
        state = G_last.exp().transpose(-1, -2) * state \
            + ((G_last - G).exp() * kc).transpose(-1, -2) @ V_new
    o = torch.cat(outputs, dim=2)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), state.to(initial_state.dtype)


@torch.library.custom_op("k3::kda", mutates_args=())
def kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
        initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """Decode (T = 1) runs the recurrence; prefill runs the chunked form."""
    step = recurrent_kda if q.shape[1] == 1 else chunk_kda
    return step(q, k, v, g, beta, initial_state)


@kda.register_fake
def _(q, k, v, g, beta, initial_state):
    return v.new_empty(v.shape), initial_state.new_empty(initial_state.shape)
