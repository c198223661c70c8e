"""Triton kernels for the K3 custom ops; imports only torch, triton and numpy."""

from __future__ import annotations

from k3plugins import kda, mla, moe
from k3plugins.kda import chunk_kda, recurrent_kda
from k3plugins.mla import latent_mla
from k3plugins.trt import register
from k3plugins.variants import KernelVariant


def kernel_variants() -> list[KernelVariant]:
    """Every kernel variant the launchers can pick, for ahead-of-time compilation."""
    return kda.kernel_variants() + mla.kernel_variants() + moe.kernel_variants()


__all__ = ["KernelVariant", "chunk_kda", "kernel_variants", "latent_mla", "recurrent_kda", "register"]
