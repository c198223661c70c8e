"""K3Config: the model configuration, with the published Hugging Face field names.

Configuration is data: presets are plain dictionaries, files are JSON. Reading accepts the
published multimodal config.json (the language model under `text_config`) and the
DeepSeek-style aliases; writing produces a flat text config that reads back identically.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3export.errors import UserError


class ConfigError(UserError):
    """An invalid configuration: the message names the source, the field and the expectation."""


@dataclass
class LinearAttnConfig:
    """KDA settings (`linear_attn_config`); `full_attn_layers` are 1-based MLA layer indices."""

    full_attn_layers: list[int]
    # The complement of full_attn_layers, as published configs also list it; filled if absent.
    kda_layers: list[int] | None = None
    num_heads: int = 96
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    # -5.0: g = lb * sigmoid(exp(A_log) * (f + dt_bias)) (published K3);
    # None: g = -exp(A_log) * softplus(f + dt_bias) (Kimi Linear).
    gate_lower_bound: float | None = -5.0
    use_full_rank_gate: bool = True


@dataclass
class K3Config:
    linear_attn_config: LinearAttnConfig
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    # Gated latent MLA (no rotary embedding anywhere).
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # Eps of q_a_layernorm / kv_a_layernorm; None means rms_norm_eps (sglang), the HF file uses 1e-6.
    mla_norm_eps: float | None = None
    # Dense first layers and the latent MoE.
    first_k_dense_replace: int = 1
    intermediate_size: int = 33792
    moe_intermediate_size: int = 3072
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    # SiTU-GLU: [b1 tanh(a/b1) sigmoid(a)] * [b2 tanh(b/b2)]; config scalars, not parameters.
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    attn_res_block_size: int = 12
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    torch_dtype: str = "bfloat16"
    model_type: str = "kimi_linear"

    def __post_init__(self) -> None:
        if isinstance(self.linear_attn_config, dict):
            self.linear_attn_config = _build(LinearAttnConfig, self.linear_attn_config,
                                             "linear_attn_config.")
        lac = self.linear_attn_config
        if lac.kda_layers is None and isinstance(lac.full_attn_layers, list):
            lac.kda_layers = [i for i in range(1, self.num_hidden_layers + 1)
                              if i not in lac.full_attn_layers]
        self.validate()

    # -- derived quantities -------------------------------------------------------------
    @property
    def mla_layers(self) -> list[int]:
        """0-based indices of the MLA layers; every other layer is KDA."""
        return [i - 1 for i in self.linear_attn_config.full_attn_layers]

    def is_mla(self, layer: int) -> bool:
        return layer + 1 in self.linear_attn_config.full_attn_layers

    def is_dense(self, layer: int) -> bool:
        return layer < self.first_k_dense_replace

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached MLA latent row: [c | k_r]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mla_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def shared_expert_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def mla_eps(self) -> float:
        return self.rms_norm_eps if self.mla_norm_eps is None else self.mla_norm_eps

    def first_layers(self, count: int) -> K3Config:
        """This model's first `count` layers as a model of its own: the same widths and layer pattern
        (the smaller models that tests and measurements run at these widths)."""
        data = self.to_dict()
        data["num_hidden_layers"] = count
        pattern = data["linear_attn_config"]
        for kind in ("full_attn_layers", "kda_layers"):
            pattern[kind] = [i for i in pattern[kind] if i <= count]  # 1-based
        return K3Config.from_dict(data)

    # -- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        def fail(name: str, expected: str) -> None:
            raise ConfigError(f"field '{name}' = {_get(self, name)!r}: expected {expected}")

        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
            "moe_intermediate_size", "num_experts", "num_experts_per_token",
            "routed_expert_hidden_size", "attn_res_block_size", "linear_attn_config.num_heads",
            "linear_attn_config.head_dim", "linear_attn_config.short_conv_kernel_size",
        ]
        for name in positive:
            value = _get(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(name, "a positive integer")
            # Far beyond any model this tool can export; a typo (an extra digit, bytes for counts).
            largest = {"vocab_size": 1 << 24, "num_hidden_layers": 4096}.get(name, 1 << 20)
            if value > largest:
                fail(name, f"at most {largest:,}")
        for name in ["qk_rope_head_dim", "num_shared_experts", "first_k_dense_replace"]:
            value = _get(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                fail(name, "a non-negative integer")
        lac = self.linear_attn_config
        if lac.short_conv_kernel_size < 2:
            fail("linear_attn_config.short_conv_kernel_size", "at least 2 (a causal conv over past tokens)")
        if self.num_experts_per_token > self.num_experts:
            fail("num_experts_per_token", f"at most num_experts ({self.num_experts})")
        if self.first_k_dense_replace > self.num_hidden_layers:
            fail("first_k_dense_replace", f"at most num_hidden_layers ({self.num_hidden_layers})")
        layers = lac.full_attn_layers
        if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
            fail("linear_attn_config.full_attn_layers", "a list of 1-based layer indices")
        bad = [i for i in layers if not 1 <= i <= self.num_hidden_layers]
        if bad:
            fail("linear_attn_config.full_attn_layers",
                 f"1-based indices in 1..{self.num_hidden_layers} (num_hidden_layers); got {bad}")
        if len(set(layers)) != len(layers):
            fail("linear_attn_config.full_attn_layers", "no repeated layer index")
        if sorted(set(lac.kda_layers) | set(layers)) != list(range(1, self.num_hidden_layers + 1)) \
                or set(lac.kda_layers) & set(layers):
            fail("linear_attn_config.kda_layers", "the layers not in full_attn_layers (1-based)")
        if lac.num_heads * lac.head_dim % self.num_attention_heads:
            fail("linear_attn_config.num_heads", "KDA channels divisible by num_attention_heads")
        if lac.gate_lower_bound is not None and not lac.gate_lower_bound < 0:
            fail("linear_attn_config.gate_lower_bound", "a negative number, or null for softplus")
        if not lac.use_full_rank_gate:
            fail("linear_attn_config.use_full_rank_gate", "true (the low-rank gate is not supported)")
        for name in ["rms_norm_eps", "activation_situ_beta", "activation_situ_linear_beta",
                     "routed_scaling_factor"]:
            value = _get(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                fail(name, "a positive number")
        if self.mla_norm_eps is not None and not self.mla_norm_eps > 0:
            fail("mla_norm_eps", "a positive number or null")
        required = {
            "mla_use_nope": True, "mla_use_output_gate": True, "latent_moe_use_norm": True,
            "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
            "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "hidden_act": "situ",
            "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        }
        for name, value in required.items():
            if _get(self, name) != value:
                fail(name, f"{value!r} (the only value K3 uses and k3export implements)")
        if self.torch_dtype not in ("float32", "float16", "bfloat16"):
            fail("torch_dtype", "one of float32, float16, bfloat16")

    # -- reading and writing ------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str) -> K3Config:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset '{name}': expected one of {', '.join(PRESETS)}")
        return cls.from_dict(PRESETS[name], source=f"preset {name}")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> K3Config:
        """Reads a text config; a multimodal config with `text_config` is unwrapped."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        if isinstance(data.get("text_config"), dict):
            data = data["text_config"]
            source = f"{source} (text_config)"
        data = dict(data)
        for alias, name in ALIASES.items():
            if alias in data:
                if name in data and data[name] != data[alias]:
                    raise ConfigError(f"{source}: fields '{alias}' and '{name}' disagree")
                data[name] = data.pop(alias)
        if not isinstance(data.get("linear_attn_config"), dict):
            raise ConfigError(f"{source}: field 'linear_attn_config': expected an object "
                              "with full_attn_layers")
        unknown = _unknown(cls, data, "") + _unknown(LinearAttnConfig, data["linear_attn_config"],
                                                      "linear_attn_config.")
        if unknown:
            log.warning("%s: unknown fields, ignored: %s", source, ", ".join(unknown))
        try:
            return _build(cls, data, "")
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> K3Config:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # a binary file is not UTF-8
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, path: str | Path) -> None:
        from k3export.artifacts import write_atomic

        write_atomic(Path(path), (json.dumps(self.to_dict(), indent=2) + "\n").encode())


ALIASES = {
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
}


def _get(config: K3Config, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


# What each annotation accepts (bool is not an int here, though Python says it is).
_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "list[int]": ("a list of integers",
                  lambda v: isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                        for i in v)),
    "LinearAttnConfig": ("an object", lambda v: isinstance(v, (dict, LinearAttnConfig))),
}

# Keys of published and Hugging Face configs that k3export reads no meaning from, on purpose:
# bookkeeping, tokenizer ids, attention details that K3 fixes (no rotary, MLA/KDA heads as given),
# and the quantization block (read by the checkpoint loader). Other unknown keys are warned about.
IGNORED_KEYS = {
    "architectures", "auto_map", "transformers_version", "initializer_range", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "rope_theta",
    "rope_scaling", "attention_dropout", "attention_bias", "num_key_value_heads", "head_dim",
    "dtype", "quantization_config", "moe_layer_freq", "scoring_func", "norm_topk_prob",
    "use_grouped_topk", "mlp_bias", "pretraining_tp", "tokenizer_class", "text_config",
    "vision_config", "media_placeholder_token_id", "ignore_index", "name_or_path", "_name_or_path",
    "torchscript", "return_dict", "output_hidden_states", "output_attentions", "kv_heads",
}
log = logging.getLogger("k3export")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """Builds a dataclass from the known keys of `data`, each checked against its annotation
    (a missing required key is an error; from_dict warns about unknown ones)."""
    fields = dataclasses.fields(cls)
    missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in data]
    if missing:
        raise ConfigError(f"field '{prefix}{missing[0]}' is missing")
    for f in fields:
        if f.name not in data or (data[f.name] is None and "None" in f.type):
            continue
        expected, accepts = _TYPES[f.type.removesuffix(" | None")]
        if not accepts(data[f.name]):
            raise ConfigError(f"field '{prefix}{f.name}' = {json.dumps(data[f.name])}: expected {expected}"
                              + (" or null" if "None" in f.type else ""))
    return cls(**{f.name: data[f.name] for f in fields if f.name in data})


def _unknown(cls: type, data: dict[str, Any], prefix: str) -> list[str]:
    known = {f.name for f in dataclasses.fields(cls)} | IGNORED_KEYS | set(ALIASES)
    return [prefix + key for key in sorted(set(data) - known)]


def _schedule(num_layers: int, period: int, extra: tuple[int, ...] = ()) -> list[int]:
    """1-based MLA layers: every `period`-th layer, plus `extra`."""
    return sorted(set(range(period, num_layers + 1, period)) | set(extra))


PRESETS: dict[str, dict[str, Any]] = {
    # The published model: 93 layers, MLA at 4, 8, ..., 92 and the trailing 93.
    "kimi-k3": {"linear_attn_config": {"full_attn_layers": _schedule(93, 4, (93,))}},
    # The design text's variant (docs/architecture.md, last section): 92 layers = 23 x [KDA, KDA, KDA, MLA].
    "k3-seed": {
        "num_hidden_layers": 92,
        "linear_attn_config": {"full_attn_layers": _schedule(92, 4)},
    },
    # Tests: every feature at toy width. 2 macrocycles + trailing MLA (9 layers), AttnRes
    # blocks of 3 (4 banked blocks), top-2 of 8 experts, expert widths multiples of 32 (MXFP4).
    "k3-tiny": {
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 9,
        "num_attention_heads": 2,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 2,
        "routed_expert_hidden_size": 32,
        "attn_res_block_size": 3,
        "torch_dtype": "float32",
        "linear_attn_config": {
            "full_attn_layers": _schedule(9, 4, (9,)),
            "num_heads": 2,
            "head_dim": 32,
        },
    },
    # Benchmarks: a few hundred MB of bf16 weights, the published layer schedule pattern.
    "k3-small": {
        "vocab_size": 32768,
        "hidden_size": 1024,
        "num_hidden_layers": 9,
        "num_attention_heads": 8,
        "q_lora_rank": 256,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "intermediate_size": 4096,
        "moe_intermediate_size": 512,
        "num_experts": 32,
        "num_experts_per_token": 4,
        "num_shared_experts": 2,
        "routed_expert_hidden_size": 512,
        "attn_res_block_size": 3,
        "linear_attn_config": {
            "full_attn_layers": _schedule(9, 4, (9,)),
            "num_heads": 8,
            "head_dim": 64,
        },
    },
}
