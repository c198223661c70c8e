"""The custom ops the model calls through `torch.ops.k3.*`; importing registers them."""

from k3export.ops.kda import chunk_kda, kda, recurrent_kda
from k3export.ops.mla import latent_mla, tensor_scatter

__all__ = ["chunk_kda", "kda", "latent_mla", "recurrent_kda", "tensor_scatter"]
