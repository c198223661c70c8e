"""The decode cache: what each layer carries from one forward call to the next.

KDA layers carry the recurrent state (float32 always) and the short convolutions' last
kernel-1 inputs; MLA layers carry the latent rows [c | k_r] in a buffer of fixed capacity
[B, 1, capacity, latent], of which each row's first `lengths[b]` are valid. The AttnRes bank is
per token and needs no cache across time.

Batches are right-padded: a call takes `input_lengths[b]` valid tokens of row b out of `seq`.
Every backend writes all `seq` new latent rows (padding included) at rows lengths[b] .., so a
request must fit `lengths[b] + seq <= capacity`; the rows past a row's length are never read as
keys and the next call overwrites them. A row whose length is 0 starts a fresh sequence: whoever
reuses a row (the caller, `reset_rows`) zeroes its KDA state and conv tails.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from k3export.config import K3Config
from k3export.errors import UserError


@dataclass
class KDACache:
    kda_state: Tensor  # [B, H, K, V] float32
    q_conv: Tensor  # [B, kernel - 1, H * K] model dtype
    k_conv: Tensor
    v_conv: Tensor


@dataclass
class MLACache:
    mla_latent: Tensor  # [B, 1, capacity, kv_lora_rank + qk_rope_head_dim] model dtype


LayerCache = KDACache | MLACache


@dataclass
class K3Cache:
    """Every layer's cache (index j for the j-th layer run) and the tokens each row holds."""

    layers: list[LayerCache]
    lengths: Tensor  # [B] int64, the same for every layer

    @property
    def capacity(self) -> int:
        """Latent rows each MLA layer can hold per sequence (0 when no layer is MLA)."""
        return next((c.mla_latent.shape[2] for c in self.layers if isinstance(c, MLACache)), 0)


def empty_layer_cache(config: K3Config, layer: int, batch: int, capacity: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> LayerCache:
    """Zero state and conv tails (KDA), or a zero latent buffer of `capacity` rows (MLA)."""
    if config.is_mla(layer):
        return MLACache(torch.zeros(batch, 1, capacity, config.latent_dim, dtype=dtype, device=device))
    lac = config.linear_attn_config
    tail = (batch, lac.short_conv_kernel_size - 1, lac.num_heads * lac.head_dim)
    state = torch.zeros(batch, lac.num_heads, lac.head_dim, lac.head_dim, dtype=torch.float32, device=device)
    return KDACache(state, *(torch.zeros(tail, dtype=dtype, device=device) for _ in range(3)))


def empty_cache(config: K3Config, batch: int, capacity: int, dtype: torch.dtype,
                device: torch.device | str = "cpu", layers: range | None = None) -> K3Cache:
    """A cache for `batch` fresh sequences of up to `capacity` tokens, for `layers` (default all)."""
    layers = layers or range(config.num_hidden_layers)
    return K3Cache([empty_layer_cache(config, i, batch, capacity, dtype, device) for i in layers],
                   torch.zeros(batch, dtype=torch.int64, device=device))


def reset_rows(cache: K3Cache, rows: list[int]) -> K3Cache:
    """The cache with `rows` made fresh sequences: KDA state and conv tails zeroed, lengths 0.
    Their old latent rows stay: a length of 0 makes them invisible."""
    layers = []
    for layer_cache in cache.layers:
        tensors = cache_tensors(layer_cache)
        if isinstance(layer_cache, KDACache):
            tensors = {name: t.index_fill(0, torch.tensor(rows), 0) for name, t in tensors.items()}
        layers.append(type(layer_cache)(**tensors))
    return K3Cache(layers, cache.lengths.index_fill(0, torch.tensor(rows), 0))


def check_request(cache_lengths: Tensor, input_lengths: Tensor, seq: int, capacity: int) -> None:
    """Refuses a call that would write past a row's capacity, or whose lengths are not per-row
    counts in range, before anything runs (ONNX Runtime and the engines would fail or write out
    of bounds later, with less to say)."""
    cache_lengths, input_lengths = cache_lengths.tolist(), input_lengths.tolist()
    if len(cache_lengths) != len(input_lengths):
        raise UserError(f"cache_lengths has {len(cache_lengths)} rows and input_lengths "
                        f"{len(input_lengths)}: expected one of each per sequence in the batch")
    for row, (held, new) in enumerate(zip(cache_lengths, input_lengths, strict=True)):
        if not 0 <= new <= seq:
            raise UserError(f"input_lengths[{row}] = {new}: expected 0 <= input_lengths <= seq = {seq} "
                            "(rows are right-padded to seq)")
        if held < 0:
            raise UserError(f"cache_lengths[{row}] = {held}: expected a token count >= 0")
        if held + seq > capacity:
            raise UserError(
                f"request refused: row {row} holds {held} cached tokens and this call writes {seq} "
                f"(padding included), {held + seq} > the cache capacity {capacity}; export with a "
                "larger --capacity, or end the sequence")


def cache_tensors(layer_cache: LayerCache) -> dict[str, Tensor]:
    """A layer's cache as named tensors (field name -> tensor), in a fixed order."""
    return {f.name: getattr(layer_cache, f.name) for f in fields(layer_cache)}
