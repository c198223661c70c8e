"""The K3 stack: embedding, decoder layers (KDA or MLA, then dense FFN or latent MoE), block
AttnRes along depth, final norm and LM head. Parameter names are the published checkpoint's.

    p = embed; bank = []
    for each layer l:
        h = p if not bank else Mix(bank + [p])             # self_attention_res_*
        if l starts a block: bank.append(p); p = None
        a = Attn(input_layernorm(h)); p = a if p is None else p + a
        h = Mix(bank + [p])                                  # mlp_res_*
        p = p + FFN(post_attention_layernorm(h))
    logits = lm_head(norm(Mix(bank + [p])))                  # output_attn_res_*

Every call takes a right-padded batch: `input_lengths[b]` valid tokens of row b out of T, on top
of `cache.lengths[b]` cached ones (see cache.py). Positions past a row's valid tokens compute
finite values that no valid position reads; their logits are to be ignored.
"""

from __future__ import annotations

import zlib

import torch
from torch import Tensor, nn

from k3export.config import K3Config
from k3export.model.attnres import attn_res_mix
from k3export.model.cache import K3Cache, LayerCache, check_request, empty_cache
from k3export.model.kda import KimiDeltaAttention
from k3export.model.layers import RMSNorm, SituMLP
from k3export.model.mla import LatentMLA
from k3export.model.moe import LatentMoE


def last_positions(input_lengths: Tensor) -> Tensor:
    """Each row's last valid position; 0 for a row with no new tokens (an idle row in a batch,
    whose logits are then to be ignored)."""
    return (input_lengths - 1).clamp(min=0)


def _res_proj(config: K3Config, dtype: torch.dtype | None) -> nn.Linear:
    return nn.Linear(config.hidden_size, 1, bias=False, dtype=dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, index: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.index = index
        self.starts_block = index % config.attn_res_block_size == 0
        self.is_mla = config.is_mla(index)
        self.is_dense = config.is_dense(index)
        self.input_layernorm = RMSNorm(D, eps, dtype)
        self.post_attention_layernorm = RMSNorm(D, eps, dtype)
        self.self_attention_res_norm = RMSNorm(D, eps, dtype)
        self.self_attention_res_proj = _res_proj(config, dtype)
        self.mlp_res_norm = RMSNorm(D, eps, dtype)
        self.mlp_res_proj = _res_proj(config, dtype)
        self.self_attn = LatentMLA(config, dtype) if self.is_mla else KimiDeltaAttention(config, dtype)
        if self.is_dense:
            self.mlp = SituMLP(D, config.intermediate_size, config.activation_situ_beta,
                               config.activation_situ_linear_beta, dtype)
        else:
            self.block_sparse_moe = LatentMoE(config, dtype)

    @property
    def ffn(self) -> nn.Module:
        return self.mlp if self.is_dense else self.block_sparse_moe

    def forward(self, bank: list[Tensor], partial: Tensor, cache: LayerCache, cache_lengths: Tensor,
                input_lengths: Tensor) -> tuple[list[Tensor], Tensor, LayerCache]:
        h = attn_res_mix([*bank, partial], self.self_attention_res_proj,
                         self.self_attention_res_norm) if bank else partial
        if self.starts_block:
            bank = [*bank, partial]
        a, cache = self.self_attn(self.input_layernorm(h), cache, cache_lengths, input_lengths)
        partial = a if self.starts_block else partial + a
        h = attn_res_mix([*bank, partial], self.mlp_res_proj, self.mlp_res_norm)
        partial = partial + self.ffn(self.post_attention_layernorm(h))
        return bank, partial, cache


class K3Model(nn.Module):
    """The decoder, named `model` in checkpoints."""

    def __init__(self, config: K3Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.output_attn_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.output_attn_res_proj = _res_proj(config, dtype)


class K3ForCausalLM(nn.Module):
    def __init__(self, config: K3Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype or getattr(torch, config.torch_dtype)
        self.model = K3Model(config, self.dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=self.dtype)

    def forward(self, input_ids: Tensor, cache: K3Cache | None = None, input_lengths: Tensor | None = None,
                last_logits: bool = False) -> tuple[Tensor, K3Cache]:
        """input_ids [B, T] (row b valid up to input_lengths[b], default all T) -> logits [B, T, vocab]
        (or [B, vocab] at each row's last valid token with `last_logits`) and the cache after these
        tokens. Without a cache, the rows start fresh in a cache of capacity T."""
        B, T = input_ids.shape
        if cache is None:
            cache = self.empty_cache(B, capacity=T)
        if input_lengths is None:
            input_lengths = torch.full((B,), T, dtype=torch.int64, device=input_ids.device)
        check_request(cache.lengths, input_lengths, T, cache.capacity if self.config.mla_layers else T)
        bank, partial, layers = self.run_layers([], self.model.embed_tokens(input_ids), cache.layers,
                                                range(len(self.model.layers)), cache.lengths, input_lengths)
        logits = self.head(bank, partial, last_positions(input_lengths) if last_logits else None)
        return logits, K3Cache(layers, cache.lengths + input_lengths)

    def run_layers(self, bank: list[Tensor], partial: Tensor, cache: list[LayerCache], layers: range,
                   cache_lengths: Tensor,
                   input_lengths: Tensor) -> tuple[list[Tensor], Tensor, list[LayerCache]]:
        """Runs `layers` from the AttnRes state (bank, partial); cache[j] is layers[j]'s."""
        new_cache = []
        for layer, layer_cache in zip(layers, cache, strict=True):
            bank, partial, layer_cache = self.model.layers[layer](bank, partial, layer_cache, cache_lengths,
                                                                  input_lengths)
            new_cache.append(layer_cache)
        return bank, partial, new_cache

    def head(self, bank: list[Tensor], partial: Tensor, positions: Tensor | None = None) -> Tensor:
        """Logits [B, T, vocab] from the AttnRes state, or [B, vocab] at positions[b] of each row."""
        if positions is not None:
            # Select before the mix, norm and LM head: they are per token.
            def at(x: Tensor) -> Tensor:
                return torch.gather(x, 1, positions[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]

            bank, partial = [at(x) for x in bank], at(partial)
        m = self.model
        h = attn_res_mix([*bank, partial], m.output_attn_res_proj, m.output_attn_res_norm)
        return self.lm_head(m.norm(h))

    def parts(self, layers: range) -> list[nn.Module]:
        """The submodules that running `layers` uses: those layers, the embedding if they start at
        layer 0, and the output mix, final norm and LM head if they end at the last layer."""
        m = self.model
        parts: list[nn.Module] = [m.layers[i] for i in layers]
        if layers.start == 0:
            parts.append(m.embed_tokens)
        if layers.stop == len(m.layers):
            parts += [m.output_attn_res_norm, m.output_attn_res_proj, m.norm, self.lm_head]
        return parts

    def empty_cache(self, batch: int, capacity: int) -> K3Cache:
        """Fresh rows for up to `capacity` tokens each, on the weights' device."""
        return empty_cache(self.config, batch, capacity, self.dtype, self.lm_head.weight.device)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded random weights that keep activations near unit scale: matrices draw
        N(0, 1/fan_in), the embedding N(0, 1), norms are ones; decay parameters give per-step
        decays around exp(-0.4), so state persists over tens of tokens.

        Each parameter draws from its own generator, seeded from `seed` and its name, so a model
        holding only some layers (the rest on the meta device) gets the same values for them, and
        a rank of a split model (k3export.model.parallel.split_model) its part of the unsplit
        model's: each parameter is drawn whole, one at a time, and the rank's part kept."""
        split = getattr(self, "tensor_parallel", None)
        kept = split.kept if split else {}
        for name, param in self.named_parameters():
            if param.device.type == "meta":
                continue
            # Within the generator's 64 bits for every seed the CLI takes (0..2**63-1); the same
            # values as before for seeds below 9e12, where the sum never reached 2**63.
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            part = kept.get(name)
            shape = part.shape if part else param.shape
            if name.endswith("A_log"):
                value = torch.empty(shape).uniform_(0.5, 2.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                value = torch.empty(shape).uniform_(-4.0, -1.0, generator=gen)
            elif name.endswith("e_score_correction_bias"):
                value = torch.randn(shape, generator=gen) * 0.1
            elif param.dim() == 1:
                value = torch.ones(shape)
            elif name.endswith("embed_tokens.weight"):
                value = torch.randn(shape, generator=gen)
            else:
                value = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
            param.copy_(value[part.index] if part else value)
