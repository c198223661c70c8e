"""The decode cache: what each layer carries from one forward call to the next.

KDA layers carry the recurrent state (float32 always) and the short convolutions' last
kernel-1 inputs; MLA layers carry the latent rows [c | k_r], one per token seen.
The AttnRes bank is per token and needs no cache across time.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from k3export.config import K3Config


@dataclass
class KDACache:
    kda_state: Tensor  # [B, H, K, V] float32
    q_conv: Tensor  # [B, kernel - 1, H * K] model dtype
    k_conv: Tensor
    v_conv: Tensor


@dataclass
class MLACache:
    mla_latent: Tensor  # [B, S, kv_lora_rank + qk_rope_head_dim] model dtype


LayerCache = KDACache | MLACache
K3Cache = list[LayerCache]


def empty_cache(config: K3Config, batch: int, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> K3Cache:
    """A cache for sequences with no past: zero states and conv tails, no latent rows."""
    lac = config.linear_attn_config
    channels = lac.num_heads * lac.head_dim
    tail = (batch, lac.short_conv_kernel_size - 1, channels)
    cache: K3Cache = []
    for layer in range(config.num_hidden_layers):
        if config.is_mla(layer):
            cache.append(MLACache(torch.zeros(batch, 0, config.latent_dim, dtype=dtype, device=device)))
        else:
            state = torch.zeros(batch, lac.num_heads, lac.head_dim, lac.head_dim,
                                dtype=torch.float32, device=device)
            cache.append(KDACache(state, *(torch.zeros(tail, dtype=dtype, device=device)
                                           for _ in range(3))))
    return cache


def cache_tensors(layer_cache: LayerCache) -> dict[str, Tensor]:
    """A layer's cache as named tensors (field name -> tensor), in a fixed order."""
    return {f.name: getattr(layer_cache, f.name) for f in fields(layer_cache)}
