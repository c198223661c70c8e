"""A synthetic checkpoint in the published Kimi-K3 layout, written from one of our models.

Names, dtypes, packing and sharding follow the published checkpoint (see docs/architecture.md,
"The published checkpoint"), so tests can prove the loader on it:
- every language-model tensor under `language_model.`; two fake vision-tower tensors and one
  projector tensor beside them, which loaders must skip;
- bfloat16, except float32 for the short convs ([C, 1, W]), A_log, dt_bias, o_norm and the
  router's correction bias; A_log zero-padded from the head count to head_dim entries (the
  published one holds 96 heads in 128 = head_dim; for k3-tiny that is 2 heads in 32);
- routed experts as MXFP4 (`experts.{e}.w1.weight_packed` + `.weight_scale`, mxfp4.quantize's
  rounding) or as plain bfloat16 (`experts.{e}.w1.weight`);
- one shard per layer (layer i in shard i + 1), then the globals, the projector, the vision
  tower, as `model-{i:05d}-of-{n:06d}.safetensors` with `model.safetensors.index.json`;
- a multimodal config.json: the text config under `text_config` with its quantization_config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from k3export.artifacts import write_atomic
from k3export.model import K3ForCausalLM
from k3export.ops import mxfp4
from k3export.weights.checkpoint import (
    EXPERT_WEIGHT,
    LAYER_NAME,
    MXFP4_FORMAT,
    PUBLISHED_PREFIX,
    checkpoint_slots,
    write_index,
    write_shard,
)

FLOAT32_SUFFIXES = ("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")

# compressed-tensors' MXFP4 scheme as the published text_config carries it; only routed experts
# are packed (the ignore list keeps attention, shared experts, dense MLP and lm_head in bf16).
QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {
        "format": MXFP4_FORMAT, "input_activations": None, "output_activations": None,
        "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                    "group_size": mxfp4.GROUP, "num_bits": 4, "observer": "minmax", "observer_kwargs": {},
                    "scale_dtype": "torch.uint8", "strategy": "group", "symmetric": True,
                    "type": "float", "zp_dtype": None}}},
    "format": MXFP4_FORMAT, "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


def fake_vision_tensors(seed: int = 0) -> dict[str, Tensor]:
    """Stand-ins for the vision tower and projector: tensors a text loader must skip and count."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "vision_tower.patch_embed.proj.weight": torch.randn(16, 3, 2, 2, generator=gen).bfloat16(),
        "vision_tower.encoder.blocks.0.norm0.weight": torch.ones(16, dtype=torch.bfloat16),
        "mm_projector.proj.0.weight": torch.randn(64, 16, generator=gen).bfloat16(),
    }


def published_tensors(model: K3ForCausalLM, experts: Literal["mxfp4", "bf16"]) -> dict[str, Tensor]:
    """Our model's language-model tensors under the published names, layouts and dtypes."""
    lac = model.config.linear_attn_config
    out: dict[str, Tensor] = {}
    for name, slot in checkpoint_slots(model).items():
        tensor = slot.target.detach()
        name = PUBLISHED_PREFIX + name
        if experts == "mxfp4" and EXPERT_WEIGHT.fullmatch(name):
            out[f"{name}_packed"], out[f"{name}_scale"] = mxfp4.quantize(tensor)
            continue
        if name.endswith(".A_log"):
            tensor = torch.cat([tensor, tensor.new_zeros(lac.head_dim - lac.num_heads)])
        dtype = torch.float32 if name.endswith(FLOAT32_SUFFIXES) else torch.bfloat16
        out[name] = tensor.to(dtype).contiguous()
    return out


def write_published(model: K3ForCausalLM, directory: str | Path,
                    experts: Literal["mxfp4", "bf16"] = "mxfp4") -> list[Path]:
    """Writes the model as a published-layout checkpoint (module docstring); returns the files."""
    directory = Path(directory)
    layers = model.config.num_hidden_layers
    shards: list[dict[str, Tensor]] = [{} for _ in range(layers + 3)]
    for name, tensor in published_tensors(model, experts).items():
        layer = LAYER_NAME.match(name.removeprefix(PUBLISHED_PREFIX))
        shards[int(layer[1]) if layer else layers][name] = tensor
    for name, tensor in fake_vision_tensors().items():
        shards[layers + 1 if name.startswith("mm_projector.") else layers + 2][name] = tensor
    files: dict[str, str] = {}
    written = []
    for i, tensors in enumerate(shards):
        path = write_shard(directory / f"model-{i + 1:05d}-of-{len(shards):06d}.safetensors", tensors)
        files.update(dict.fromkeys(tensors, path.name))
        written.append(path)
    written.append(write_index(directory, files, sum(t.nbytes for s in shards for t in s.values())))
    text_config = model.config.to_dict() | {"model_type": "kimi_linear",
                                            "architectures": ["KimiLinearForCausalLM"],
                                            "torch_dtype": "bfloat16"}
    if experts == "mxfp4":
        text_config["quantization_config"] = QUANTIZATION_CONFIG
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
              "dtype": "bfloat16", "tie_word_embeddings": False, "text_config": text_config,
              "vision_config": {"hidden_size": 16}}
    write_atomic(directory / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    return [*written, directory / "config.json"]
