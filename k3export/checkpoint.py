"""Weights in and out as safetensors (never pickle), under the published checkpoint's names.

The model holds the routed experts stacked ([E, ...] per projection); checkpoints hold one
tensor per expert (`...experts.{e}.w1.weight`). `checkpoint_slots` is the one place where the
two meet. Large checkpoints are sharded with a `model.safetensors.index.json` beside them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from k3export.artifacts import atomic_path, write_atomic
from k3export.config import K3Config
from k3export.model import K3ForCausalLM

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 4 << 30
_STACKED_EXPERTS = re.compile(r"(.*\.experts)\.(w[123])")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: the message names the file and tensors."""


def checkpoint_slots(model: nn.Module) -> dict[str, tuple[Tensor, int | None]]:
    """Checkpoint name -> (parameter, expert index or None) for every tensor of the model."""
    slots: dict[str, tuple[Tensor, int | None]] = {}
    for name, param in model.named_parameters():
        stacked = _STACKED_EXPERTS.fullmatch(name)
        if stacked:
            for e in range(param.shape[0]):
                slots[f"{stacked[1]}.{e}.{stacked[2]}.weight"] = (param, e)
        else:
            slots[name] = (param, None)
    return slots


def _slot_tensor(param: Tensor, expert: int | None) -> Tensor:
    return param if expert is None else param[expert]


def save_checkpoint(model: nn.Module, directory: str | Path,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Writes the model's weights (and its config.json when it has a config); returns the files.

    One `model.safetensors` when it fits in max_shard_bytes, else numbered shards and an index."""
    directory = Path(directory)
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    slots = checkpoint_slots(model)
    for name, (param, expert) in slots.items():
        size = _slot_tensor(param, expert).nbytes
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    if len(shards) == 1:
        names = [SINGLE_NAME]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written = []
    for file_name, shard in zip(names, shards, strict=True):
        # Clones: safetensors refuses views that share storage (the per-expert slices).
        tensors = {n: _slot_tensor(*slots[n]).detach().clone().contiguous() for n in shard}
        path = directory / file_name
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        written.append(path)
    if len(shards) > 1:
        total = sum(_slot_tensor(p, e).nbytes for p, e in slots.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, shard in zip(names, shards, strict=True) for n in shard}}
        write_atomic(directory / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
        written.append(directory / INDEX_NAME)
    config = getattr(model, "config", None)
    if config is not None:
        config.to_json(directory / "config.json")
        written.append(directory / "config.json")
    return written


def weight_map(directory: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, from the index or the single file."""
    directory = Path(directory)
    index_path = directory / INDEX_NAME
    if index_path.exists():
        try:
            entries = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: expected JSON with a 'weight_map' object ({e})") from None
        return {name: directory / file for name, file in entries.items()}
    single = directory / SINGLE_NAME
    if not single.exists():
        raise CheckpointError(f"{directory}: no {INDEX_NAME} or {SINGLE_NAME}")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


@torch.no_grad()
def load_checkpoint(model: nn.Module, directory: str | Path) -> None:
    """Copies every tensor into the model (cast to the parameter's dtype), one file at a time.

    Raises CheckpointError naming every missing, unexpected and mis-shaped tensor; the model
    may then be partly loaded and should be discarded."""
    slots = checkpoint_slots(model)
    files: dict[Path, list[str]] = {}
    for name, path in weight_map(directory).items():
        files.setdefault(path, []).append(name)
    unexpected: list[str] = []
    misshaped: dict[str, str] = {}
    loaded: set[str] = set()
    for path, names in files.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                if name not in slots:
                    unexpected.append(name)
                    continue
                target = _slot_tensor(*slots[name])
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(target.shape):
                    misshaped[name] = f"{name} ({path.name}: {list(shape)}, model: {list(target.shape)})"
                    continue
                target.copy_(f.get_tensor(name))
                loaded.add(name)
    missing = [name for name in slots if name not in loaded and name not in misshaped]
    problems = [(label, items) for label, items in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", list(misshaped.values())))
                if items]
    if problems:
        lines = [f"{label} ({len(items)}): " + ", ".join(items[:10]) + (" ..." if len(items) > 10 else "")
                 for label, items in problems]
        raise CheckpointError(f"{directory}: checkpoint does not match the model:\n  " + "\n  ".join(lines))


def build_model(config: K3Config, dtype: torch.dtype, weights: dict[str, Any]) -> K3ForCausalLM:
    """The eager model with its weights from `{"seed": N}` or `{"checkpoint": DIR}`."""
    model = K3ForCausalLM(config, dtype).eval()
    if "checkpoint" in weights:
        load_checkpoint(model, weights["checkpoint"])
    elif "seed" in weights:
        model.init_weights(int(weights["seed"]))
    else:
        raise CheckpointError(f"weights {weights!r}: expected a seed or a checkpoint")
    return model
