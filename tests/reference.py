"""Independent references and input generators shared by the tests."""

import torch


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm of the difference over the norm of the reference, over the whole tensor."""
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def kda_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, seed: int = 0):
    """Valid KDA op inputs: k L2-normed, beta in (0, 1), g in (-5, 0], q scaled by K^-0.5."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) * K**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -5 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) ** 4  # mostly mild decay
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    state = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    gate_dtype = state_dtype
    return (q.to(dtype), k.to(dtype), v.to(dtype), g.to(gate_dtype), beta.to(gate_dtype),
            state.to(state_dtype))
