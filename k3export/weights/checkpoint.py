"""Weights in and out as safetensors (never pickle), under the published checkpoint's names.

The model holds the routed experts stacked ([E, ...] per projection); checkpoints hold one
tensor per expert (`...experts.{e}.w1.weight`, or its MXFP4 pair `.weight_packed` +
`.weight_scale`). `checkpoint_slots` is the one place where the two meet. Large checkpoints are
sharded with a `model.safetensors.index.json` beside them.

A rank of a split model (k3export/model/parallel.py: tensor- and expert-parallel) loads only its
part: its routed experts' tensors, and of each split tensor only the slice it keeps (safetensors
`get_slice`), so a rank's peak memory follows its slice, not its stage (`build_model(..., rank, ranks)`).

Two layouts load: our own (names as the model's) and the published Kimi-K3 one, whose
language-model names carry a `language_model.` prefix and whose other tensors (the vision tower)
are skipped and counted. `published_name` translates names; `_to_model_layout` holds the
published tensors' quirks (A_log padding, conv layout, dtypes); mxfp4.py decodes experts.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from k3export.artifacts import atomic_path, write_atomic
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.model import K3ForCausalLM
from k3export.model.parallel import Kept, split_model
from k3export.ops import mxfp4
from k3export.options import available_memory

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 4 << 30
PUBLISHED_PREFIX = "language_model."
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# safetensors header dtypes; anything else is refused as mis-typed.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
                      "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}
MXFP4_FORMAT = "mxfp4-pack-quantized"
_STACKED_EXPERTS = re.compile(r"(.*\.experts)\.(w[123])(_packed|_scale)?")
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")
# One routed expert's matrix in a checkpoint: `.weight`, or a half of its MXFP4 pair.
EXPERT_WEIGHT = re.compile(r"(.*\.experts\.\d+\.w[123])\.weight(?:_(packed|scale))?")


class CheckpointError(UserError):
    """A checkpoint that does not fit the model: the message names the file and tensors."""


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: `tensor`, or its `expert` (local index) if stacked [E, ...].
    It holds `index` of the checkpoint tensor, whose whole shape is `shape`: all of it (index ()),
    except on a rank of a split model."""

    tensor: Tensor
    expert: int | None
    index: tuple[slice, ...]
    shape: torch.Size

    @property
    def target(self) -> Tensor:
        return self.tensor if self.expert is None else self.tensor[self.expert]


def _kept(model: nn.Module) -> dict[str, Kept]:
    """What a rank of a split model keeps of each split tensor (none for an unsplit model)."""
    split = getattr(model, "tensor_parallel", None)
    return split.kept if split else {}


def _experts_held(part: Kept) -> range:
    """The model's indices of the experts a stacked [E, ...] tensor holds: all, or a rank's (whole)."""
    experts = range(part.shape[0])
    return experts[part.index[0]] if part.index else experts


def checkpoint_slots(model: nn.Module) -> dict[str, Slot]:
    """Checkpoint name -> Slot for every tensor the model holds.

    Stacked experts [E, ...] give one name per expert (a rank: per expert it holds, by its index
    in the model); kept-packed experts (`w1_packed`, `w1_scale` buffers) give the MXFP4 pair
    `experts.{e}.w1.weight_packed` / `.weight_scale`."""
    kept = _kept(model)
    slots: dict[str, Slot] = {}
    for name, tensor in chain(model.named_parameters(), model.named_buffers()):
        part = kept.get(name, Kept((), tensor.shape))
        stacked = _STACKED_EXPERTS.fullmatch(name)
        if stacked:
            suffix = "weight" + (stacked[3] or "")
            for local, e in enumerate(_experts_held(part)):
                slots[f"{stacked[1]}.{e}.{stacked[2]}.{suffix}"] = Slot(tensor, local, part.index[1:],
                                                                        part.shape[1:])
        else:
            slots[name] = Slot(tensor, None, part.index, part.shape)
    return slots


def _other_ranks_experts(model: nn.Module) -> set[str]:
    """The routed experts (`...experts.{e}.w1`) that the other ranks of a split model hold: their
    checkpoint tensors are not read, and not unexpected either."""
    others = set()
    for name, part in _kept(model).items():
        stacked = _STACKED_EXPERTS.fullmatch(name)
        if stacked:
            held = _experts_held(part)
            others |= {f"{stacked[1]}.{e}.{stacked[2]}" for e in range(part.shape[0]) if e not in held}
    return others


def write_shard(path: Path, tensors: dict[str, Tensor]) -> Path:
    """One safetensors file, written to a temporary name and renamed."""
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    return path


def write_index(directory: Path, files: dict[str, str], total_size: int) -> Path:
    """`model.safetensors.index.json`: tensor name -> file name, and the tensors' total bytes."""
    index = {"metadata": {"total_size": total_size}, "weight_map": files}
    write_atomic(directory / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
    return directory / INDEX_NAME


def save_checkpoint(model: nn.Module, directory: str | Path,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Writes the model's weights (and its config.json when it has a config); returns the files.

    One `model.safetensors` when it fits in max_shard_bytes, else numbered shards and an index."""
    directory = Path(directory)
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    slots = checkpoint_slots(model)
    for name, slot in slots.items():
        size = slot.target.nbytes
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
        tensors = {n: slots[n].target.detach().clone().contiguous() for n in shard}
        written.append(write_shard(directory / file_name, tensors))
    if len(shards) > 1:
        total = sum(slot.target.nbytes for slot in slots.values())
        files = {n: f for f, shard in zip(names, shards, strict=True) for n in shard}
        written.append(write_index(directory, files, total))
    config = getattr(model, "config", None)
    if config is not None:
        config.to_json(directory / "config.json")
        written.append(directory / "config.json")
    return written


def weight_map(directory: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, from the index or the single file.
    Only safetensors files inside the folder are accepted: pickle checkpoints can run code."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"--checkpoint {directory}: no such folder")
    index_path = directory / INDEX_NAME
    if index_path.exists():
        try:
            entries = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(entries, dict) or not all(isinstance(f, str) for f in entries.values()):
                raise TypeError("its values must be file names")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: expected JSON with a 'weight_map' object of tensor name -> "
                                  f"file name ({e})") from None
        files = {name: _shard_path(directory, file, index_path) for name, file in entries.items()}
        return files
    single = directory / SINGLE_NAME
    if not single.exists():
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(f"{directory}: holds {', '.join(pickles[:3])} (PyTorch pickle files, which "
                                  f"can run code when loaded); expected safetensors ({SINGLE_NAME} or "
                                  f"{INDEX_NAME} with its shards): convert them with safetensors first")
        raise CheckpointError(f"{directory}: no {INDEX_NAME} or {SINGLE_NAME}")
    return dict.fromkeys(read_headers([single])[single], single)


def _shard_path(directory: Path, file: str, index_path: Path) -> Path:
    path = directory / file
    if Path(file).is_absolute() or ".." in Path(file).parts \
            or not path.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(f"{index_path}: weight_map entry {file!r}: expected a file inside {directory}")
    if path.suffix in PICKLE_SUFFIXES:
        raise CheckpointError(f"{index_path}: weight_map entry {file!r} is a PyTorch pickle file (it can run "
                              "code when loaded); expected .safetensors shards")
    return path


def read_headers(paths: Iterable[Path]) -> dict[Path, dict[str, tuple[list[int], str]]]:
    """Each safetensors file's tensors (name -> shape, dtype) from its header alone. Every file
    that is missing or whose header does not parse (a truncated download) is named together."""
    headers, bad = {}, []
    for path in paths:
        try:
            with safe_open(path, framework="pt") as f:
                slices = {n: f.get_slice(n) for n in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
                headers[path] = {n: (t.get_shape(), t.get_dtype()) for n, t in slices.items()}
        except FileNotFoundError:
            bad.append(f"{path}: missing")
        except (SafetensorError, OSError) as e:
            bad.append(f"{path}: not a complete safetensors file ({e}); download it again")
    if bad:
        raise CheckpointError("unreadable checkpoint files:\n  " + "\n  ".join(bad))
    return headers


def published_name(name: str) -> str | None:
    """A published checkpoint's tensor name -> ours, or None for a tensor not of the language model.

    `language_model.model.layers.3.x` -> `model.layers.3.x`, `language_model.lm_head.weight` ->
    `lm_head.weight`. The form without `.model` (`language_model.layers.3.x`) is accepted too,
    as sglang's KimiK3 loader accepts it (its WeightsMapper adds the infix)."""
    if not name.startswith(PUBLISHED_PREFIX):
        return None
    name = name.removeprefix(PUBLISHED_PREFIX)
    return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"


@dataclass
class ShardFile:
    """One file a checkpoint's index names, as it is on disk now, and what it holds."""

    path: Path
    bytes: int | None  # None: missing
    problem: str | None  # its header does not parse (a truncated download)
    layers: list[int]  # the language-model layers whose tensors it holds
    other: list[str]  # "embedding", "head" (final norm, AttnRes output mix, LM head), "other tensors"

    def holds(self) -> str:
        return holdings(self.layers, self.other)


def holdings(layers: list[int], other: list[str]) -> str:
    """'layers 0-2, 4-8, embedding, head'."""
    return ", ".join(([f"layers {_spans(layers)}"] if layers else []) + other) or "nothing"


def _spans(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


@dataclass
class CheckpointLayout:
    """What a checkpoint folder holds, from its index alone (no tensor is read)."""

    directory: Path
    published: bool
    # Our name -> (the name in the file, the file).
    tensors: dict[str, tuple[str, Path]]
    # Tensors that are not the language model's (published layout only), by top-level name.
    skipped: Counter[str] = field(default_factory=Counter)
    # Every file the index names (or the single model.safetensors).
    files: list[Path] = field(default_factory=list)

    def shard_files(self) -> list[ShardFile]:
        """Each file: present (with its bytes, and whether its header parses) or missing, and
        which layers it holds. A host may hold only its stage's shards (export --layers A:B)."""
        held: dict[Path, list[str]] = {path: [] for path in self.files}
        for ours, (_, path) in self.tensors.items():
            held[path].append(ours)
        shards = []
        for path, names in held.items():
            layers, other = set(), set()
            for name in names:
                layer = LAYER_NAME.match(name)
                if layer:
                    layers.add(int(layer[1]))
                else:
                    other.add("embedding" if name.startswith("model.embed_tokens.") else "head")
            if not names:
                other.add("other tensors")
            size = path.stat().st_size if path.is_file() else None
            problem = None
            if size is not None:
                try:
                    read_headers([path])
                except CheckpointError:
                    problem = "not a complete safetensors file"
            shards.append(ShardFile(path, size, problem, sorted(layers), sorted(other)))
        return shards

    @property
    def mxfp4_experts(self) -> int:
        return sum(name.endswith(".weight_packed") for name in self.tensors)

    def summary(self) -> str:
        files = len({path for _, path in self.tensors.values()})
        kind = "published (language_model.*)" if self.published else "k3export"
        experts = f", {self.mxfp4_experts} routed-expert matrices in MXFP4" if self.mxfp4_experts else ""
        line = f"checkpoint {self.directory}: {kind} layout, {len(self.tensors)} language-model tensors " \
               f"in {files} files{experts}"
        if self.published:
            counts = ", ".join(f"{prefix}: {n}" for prefix, n in sorted(self.skipped.items())) or "none"
            line += f"; skipped {sum(self.skipped.values())} other tensors ({counts})"
        return line


def read_layout(directory: str | Path) -> CheckpointLayout:
    """The checkpoint's names mapped to ours. The published layout is recognised by its
    `language_model.` names; its MXFP4 experts need config.json's quantization_config to say so."""
    directory = Path(directory)
    files = weight_map(directory)
    published = any(name.startswith(PUBLISHED_PREFIX) for name in files)
    layout = CheckpointLayout(directory, published, {}, files=sorted(set(files.values())))
    for name, path in files.items():
        ours = published_name(name) if published else name
        if ours is None:
            layout.skipped[name.split(".")[0]] += 1
        elif ours in layout.tensors:
            raise CheckpointError(f"{directory}: tensors {layout.tensors[ours][0]} and {name} both map "
                                  f"to {ours}; expected one of them")
        else:
            layout.tensors[ours] = (name, path)
    if published and layout.mxfp4_experts:
        _check_quantization_config(directory / "config.json")
    return layout


def _check_quantization_config(path: Path) -> None:
    """The published config.json keeps quantization_config under text_config (sglang copies it
    to the top level): accept either, and require compressed-tensors MXFP4, groups of 32."""
    try:
        config = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: expected the checkpoint's config.json ({e})") from None
    quant = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if not isinstance(quant, dict) or quant.get("format") != MXFP4_FORMAT:
        raise CheckpointError(f"{path}: field 'text_config.quantization_config.format': expected "
                              f"{MXFP4_FORMAT!r} for the checkpoint's .weight_packed tensors")
    for group, scheme in quant.get("config_groups", {}).items():
        weights = scheme.get("weights") or {}
        expected = {"num_bits": 4, "type": "float", "group_size": mxfp4.GROUP}
        for key, value in expected.items():
            if weights.get(key) != value:
                raise CheckpointError(f"{path}: field 'quantization_config.config_groups.{group}.weights."
                                      f"{key}' = {weights.get(key)!r}: expected {value!r} (MXFP4)")


def _in_range(name: str, layers: range, num_layers: int) -> bool:
    """Whether a tensor (our name) is used by `layers`: the embedding by layer 0, the final
    norm, AttnRes output mix and LM head by the last layer."""
    layer = LAYER_NAME.match(name)
    if layer:
        return int(layer[1]) in layers
    if name.startswith("model.embed_tokens."):
        return layers.start == 0
    return layers.stop == num_layers


def _to_model_layout(name: str, tensor: Tensor, shape: torch.Size, where: str) -> Tensor:
    """The published tensors' quirks, in one place; dtypes are cast by the copy that follows
    (so a bfloat16 e_score_correction_bias, as sglang's loader allows, reaches the float32 slot)."""
    if name.endswith(".A_log"):
        # Published: F32 [128], heads first, zero padding after; sglang/vLLM (Kimi Linear) hold
        # [1, 1, H, 1]. The model holds [H].
        padded = tensor.dim() == 1 or (tensor.dim() == 4 and tensor.shape[:2] + tensor.shape[3:] == (1, 1, 1))
        flat, heads = tensor.flatten(), shape[0]
        if padded and flat.numel() > heads:
            if not flat.is_meta and flat[heads:].any():
                raise CheckpointError(f"{where}: {name} has non-zero entries past the {heads} heads "
                                      f"(shape {list(tensor.shape)}); expected zero padding")
            return flat[:heads]
        return flat if padded else tensor
    if name.endswith("_conv1d.weight") and tensor.dim() == 2:
        # nn.Conv1d's depthwise [C, 1, W] as published; [C, W] is accepted as well.
        return tensor.unsqueeze(1)
    return tensor


def _read(f: Any, name: str, slot: Slot | None, path: Path) -> Tensor:
    """The checkpoint tensor `name` of the open file `f` as its slot holds it, in the model's layout.
    Only the slot's part is read when the file's layout is the model's (a rank reads its slice);
    else the whole tensor is read, laid out and cut. MXFP4 halves (no slot of their own when the
    model decodes them) are read whole: a rank holds whole experts."""
    if slot is None:
        return f.get_tensor(name)
    stored = f.get_slice(name)
    if slot.index and tuple(stored.get_shape()) == tuple(slot.shape):
        return stored[slot.index]
    return _to_model_layout(name, f.get_tensor(name), slot.shape, str(path))[slot.index]


class _Loader:
    """One load: fills the model's slots from the files, recording what did not fit. A dry loader
    takes meta tensors of the files' whole tensors (shapes and dtypes from their headers) and checks
    them against the slots' whole shapes without copying; a loader that copies takes what `_read`
    read (the slot's part, laid out), once the dry loader has passed the files."""

    def __init__(self, model: nn.Module, layout: CheckpointLayout, dry: bool = False) -> None:
        self.slots = checkpoint_slots(model)
        self.other_ranks_experts = _other_ranks_experts(model)
        self.layout, self.dry = layout, dry
        self.dtype = getattr(model, "dtype", torch.float32)  # what MXFP4 experts decode to
        self.loaded: set[str] = set()
        self.misshaped: dict[str, str] = {}
        self.pairs: dict[str, dict[str, Tensor]] = {}  # MXFP4 halves waiting for their partner

    def fills(self, ours: str) -> bool:
        """Whether a checkpoint tensor has a slot: its own, or for an MXFP4 half when the model
        holds dequantised experts, the expert's `.weight`."""
        pair = EXPERT_WEIGHT.fullmatch(ours)
        return ours in self.slots or (pair is not None and f"{pair[1]}.weight" in self.slots)

    def other_ranks(self, ours: str) -> bool:
        """Whether a checkpoint tensor is a routed expert that another rank of a split model holds."""
        pair = EXPERT_WEIGHT.fullmatch(ours)
        return pair is not None and pair[1] in self.other_ranks_experts

    def copy(self, ours: str, tensor: Tensor, path: Path) -> None:
        slot = self.slots[ours]
        if not self.dry:
            slot.target.copy_(tensor)
            self.loaded.add(ours)
            return
        name, shape = self.layout.tensors[ours][0], list(tensor.shape)
        tensor = _to_model_layout(name, tensor, slot.shape, str(path))
        if tensor.shape != slot.shape:
            self.misshaped[ours] = f"{name} ({path.name}: {shape}, model: {list(slot.shape)})"
            return
        if tensor.dtype.is_floating_point != slot.tensor.dtype.is_floating_point:
            self.misshaped[ours] = (f"{name} ({path.name}: {str(tensor.dtype).removeprefix('torch.')}, "
                                    f"model: {str(slot.tensor.dtype).removeprefix('torch.')})")
            return
        self.loaded.add(ours)

    def add(self, ours: str, tensor: Tensor, path: Path) -> None:
        pair = EXPERT_WEIGHT.fullmatch(ours)
        if pair is None or pair[2] is None:
            self.copy(ours, tensor, path)
            return
        # Both halves are needed to check (and perhaps decode) either; they usually share a shard.
        halves = self.pairs.setdefault(pair[1], {})
        halves[pair[2]] = tensor
        if len(halves) < 2:
            return
        del self.pairs[pair[1]]
        base, packed, scale = pair[1], halves["packed"], halves["scale"]
        if not self.dry:
            try:
                mxfp4.check(packed, scale, f"{path}: {self.layout.tensors[f'{base}.weight_scale'][0]}",
                            self.dtype)
            except mxfp4.MXFP4Error as e:
                raise CheckpointError(str(e)) from None
        dense = f"{base}.weight"
        if dense not in self.slots:
            self.copy(f"{base}.weight_packed", packed, path)
            self.copy(f"{base}.weight_scale", scale, path)
            return
        target = self.slots[dense].target
        if packed.shape[-1] * 2 != target.shape[-1] or scale.shape != (*target.shape[:-1],
                                                                      target.shape[-1] // mxfp4.GROUP):
            name = self.layout.tensors[f"{base}.weight_packed"][0]
            self.misshaped[dense] = (f"{name}/_scale ({path.name}: {list(packed.shape)} + "
                                     f"{list(scale.shape)}, model: {list(target.shape)} as MXFP4)")
            return
        if not self.dry:
            target.copy_(mxfp4.dequantize(packed, scale, target.dtype))
        self.loaded.add(dense)


@dataclass
class LoadReport:
    layout: CheckpointLayout
    files_read: list[Path]
    tensors_loaded: int

    def summary(self) -> str:
        total = len({path for _, path in self.layout.tensors.values()})
        return (f"{self.layout.summary()}; loaded {self.tensors_loaded} tensors from "
                f"{len(self.files_read)} of those {total} files")


def checked_files(model: nn.Module, directory: str | Path,
                  layers: range | None = None) -> tuple[CheckpointLayout, dict[Path, list[str]]]:
    """The checkpoint's layout and, per file, the tensors (our names) that `model` takes from it (with
    `layers`, only those layers' and the globals they need), every name, shape and dtype checked
    against the model from the files' headers alone: a bad checkpoint is refused (CheckpointError
    naming every missing, unexpected and mis-shaped tensor) before any weight is read. A meta
    model's shapes will do."""
    layout = read_layout(directory)
    slots = checkpoint_slots(model)

    def needed(name: str) -> bool:
        return layers is None or _in_range(name, layers, len(model.model.layers))

    files: dict[Path, list[str]] = {}
    unexpected: list[str] = []
    dry = _Loader(model, layout, dry=True)
    for ours, (name, path) in layout.tensors.items():
        if not dry.fills(ours):
            if not dry.other_ranks(ours):
                unexpected.append(name)
        elif needed(ours):
            files.setdefault(path, []).append(ours)
    headers = read_headers(files)
    for path, names in files.items():
        for ours in names:
            header = headers[path].get(layout.tensors[ours][0])
            if header is not None:
                shape, dtype = header
                dry.add(ours, torch.empty(shape, dtype=SAFETENSORS_DTYPES.get(dtype, torch.int8),
                                          device="meta"), path)
    _refuse_mismatch(Path(directory), dry, [n for n in slots if needed(n)], unexpected)
    return layout, files


@torch.no_grad()
def load_checkpoint(model: nn.Module, directory: str | Path, layers: range | None = None) -> LoadReport:
    """Copies the checkpoint's tensors into the model (cast to each slot's dtype), one file at a
    time; with `layers`, only those layers' tensors (and the globals they need), opening only
    the files that hold them. Reads either layout (see read_layout); MXFP4 experts are decoded
    to the model dtype, or copied as they are into a model whose experts are kept packed. A rank
    of a split model reads only its part (see checkpoint_slots), and only the files that hold it.

    Raises CheckpointError naming every missing, unexpected and mis-shaped tensor (checked_files),
    before any weight is read."""
    layout, files = checked_files(model, directory, layers)
    loader = _Loader(model, layout)
    for path, names in files.items():
        with safe_open(path, framework="pt") as f:
            for ours in names:
                loader.add(ours, _read(f, layout.tensors[ours][0], loader.slots.get(ours), path), path)
    return LoadReport(layout, list(files), len(loader.loaded))


def check_weights(config: K3Config, dtype: torch.dtype, weights: dict[str, Any], layers: range) -> None:
    """Refuses (CheckpointError) a checkpoint that does not hold every tensor of `layers` as the model
    takes it, from its headers alone: what a check that reads the layers one at a time verifies
    before it starts. Seeded weights need nothing."""
    if "checkpoint" in weights:
        shapes = build_model(config, dtype, {**weights, "stripped": True})  # meta: no memory
        checked_files(shapes, weights["checkpoint"], layers)


def _refuse_mismatch(directory: Path, loader: _Loader, wanted: list[str], unexpected: list[str]) -> None:
    """Raises naming every missing, unexpected and mis-shaped tensor, if there are any."""
    missing = [n for n in wanted if n not in loader.loaded and n not in loader.misshaped]
    problems = [(label, items) for label, items in
                (("missing", missing), ("unexpected", unexpected),
                 ("mis-shaped", list(loader.misshaped.values()))) if items]
    if problems:
        lines = [f"{label} ({len(items)}): " + ", ".join(items[:10]) + (" ..." if len(items) > 10 else "")
                 for label, items in problems]
        raise CheckpointError(f"{directory}: checkpoint does not match the model:\n  " + "\n  ".join(lines))


def _refuse_if_too_large(parts: list[nn.Module], config: K3Config, dtype: torch.dtype,
                         layers: range | None) -> None:
    """Refuses, with the numbers, eager weights that cannot fit in this machine's memory, before
    anything is allocated (the whole published model is 5.6 TB in bfloat16)."""
    needed = sum(t.numel() * t.element_size() for part in parts
                 for t in chain(part.parameters(), part.buffers()))
    available = available_memory()
    if available and needed > available:
        span = f"layers {layers.start}:{layers.stop}" if layers else "all layers"
        raise UserError(
            f"the eager model ({span} of {config.num_hidden_layers}, {str(dtype).removeprefix('torch.')}) "
            f"needs {needed / 1e9:,.1f} GB of weights and this machine has {available / 1e9:,.1f} GB "
            "available; export a layer range that fits (--layers A:B, see `k3export plan`), or the graph "
            "alone at real shapes (--no-weights)")


def build_model(config: K3Config, dtype: torch.dtype, weights: dict[str, Any], layers: range | None = None,
                log: Callable[[str], None] = lambda _: None, rank: int = 0, ranks: int = 1) -> K3ForCausalLM:
    """The eager model with its weights from `{"seed": N}` or `{"checkpoint": DIR}`, or with none
    (`{"stripped": true}`: all on the meta device, for exporting a graph at real shapes); with a
    checkpoint, `"packed_experts": true` keeps its MXFP4 routed experts packed (dequantised in
    forward), and stripped, it gives the routed experts the packed layout (meta buffers). With
    `layers`, only the parts those layers use hold memory and weights (see
    `K3ForCausalLM.parts`); the rest stay on the meta device, so one shard of a 2.8T model fits.

    With `ranks` > 1, rank `rank` of the split model (k3export/model/parallel.py split_model), split
    on the meta device first, so memory follows the rank's slice: from a checkpoint the rank reads
    only its part; seeded weights are drawn a whole parameter at a time (its values depend on its
    whole shape) and the rank's part kept."""
    if "seed" not in weights and "checkpoint" not in weights and not weights.get("stripped"):
        raise CheckpointError(f"weights {weights!r}: expected a seed or a checkpoint "
                              "(an export made with --no-weights has no numbers to check)")
    with torch.device("meta"):
        model = K3ForCausalLM(config, dtype).eval()
    if weights.get("packed_experts"):
        if "checkpoint" in weights and not read_layout(weights["checkpoint"]).mxfp4_experts:
            raise CheckpointError(f"{weights['checkpoint']}: packed experts need MXFP4 routed experts "
                                  "(experts.{e}.w1.weight_packed); this checkpoint has none")
        for layer in model.model.layers:
            if not layer.is_dense:
                layer.block_sparse_moe.experts.keep_packed()
    split_model(model, rank, ranks)  # on the meta device: the rank's shapes, before any memory
    if weights.get("stripped"):
        return model
    parts = model.parts(layers or range(config.num_hidden_layers))
    _refuse_if_too_large(parts, config, dtype, layers)
    for part in parts:
        part.to_empty(device="cpu")
    if "checkpoint" in weights:
        log(load_checkpoint(model, weights["checkpoint"], layers).summary())
        return model
    model.init_weights(int(weights["seed"]))
    return model
