"""The custom ops the model calls through `torch.ops.k3.*` (importing registers them), and the MXFP4
format (mxfp4.py) that the routed-experts op decodes."""

from k3export.ops.collectives import all_reduce
from k3export.ops.kda import chunk_kda, kda, kda_chunk_recurrence, kda_prepare, recurrent_kda
from k3export.ops.mla import latent_mla, latent_mla_combine, latent_mla_splits, tensor_scatter
from k3export.ops.moe import routed_experts, routed_experts_mxfp4

__all__ = ["all_reduce", "chunk_kda", "kda", "kda_chunk_recurrence", "kda_prepare", "latent_mla",
           "latent_mla_combine", "latent_mla_splits", "recurrent_kda", "routed_experts",
           "routed_experts_mxfp4", "tensor_scatter"]
