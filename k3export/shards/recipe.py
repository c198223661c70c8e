"""Recipes: how to build a model as pipeline-stage engines, as data (TOML, never Python).

    [model]     preset = "k3-tiny"        or config = "path/config.json" (relative to the recipe)
    [weights]   seed = 0                  or checkpoint = "folder"
                dtype = "float32"         float32 | float16 | bfloat16
                experts = "as-stored"     or "mxfp4-packed" (a checkpoint's MXFP4 routed experts kept packed)
    [stages]    count = 2                 or ranges = [[0, 4], [4, 9]] (0-based, stop-exclusive)
    [cache]     capacity = 256            tokens per sequence; batch = 2 sequences
    [profiles]  prefill = {batch = 2, seq = 64}, decode = {batch = 2}: each optimization profile
                covers 1 up to these; optional verify = {seq = 13}: a third, decode's batch x seq
                tokens (`run --speculate K`'s calls: seq = 3K + 1)
    [parallel]  ranks = 8                 optional: GPUs per stage, every stage split over them
                                          (tensor-parallel heads, expert-parallel experts; default 1)
    [links]     stages_gb_per_s = 50      optional, for `plan`: between stages (hosts: InfiniBand), and
                ranks_gb_per_s = 450      within a stage, its ranks' collectives (NVLink); GB/s
    [build]     backend = "tensorrt-rtx"  onnx | tensorrt-rtx | tensorrt; target = "sm89"
                taps = false              true: every stage exports its layers' taps (export --taps),
                                          for `check --build DIR --taps`
                routing_outputs = false   true: every stage (and rank) exports check's outputs
                                          (export --routing-outputs), for `check --build DIR` of
                                          half-precision engines; not the served engines

Every key is checked on load; a bad one raises UserError naming the file, the key and what was
expected. Unknown keys are refused too (a misspelt key would otherwise be silently ignored).
"""

from __future__ import annotations

import hashlib
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3export.config import PRESETS, K3Config
from k3export.engine.flavours import FLAVOURS, target_problem
from k3export.errors import UserError
from k3export.model.parallel import check_split

BACKENDS = ("onnx", "tensorrt-rtx", "tensorrt")
EXPERT_FORMATS = ("as-stored", "mxfp4-packed")
DTYPES = ("float32", "float16", "bfloat16")

_KEYS: dict[str, set[str]] = {
    "model": {"preset", "config"},
    "weights": {"seed", "checkpoint", "dtype", "experts"},
    "stages": {"count", "ranges"},
    "cache": {"capacity", "batch"},
    "profiles": {"prefill", "decode", "verify"},
    "build": {"backend", "target", "taps", "routing_outputs"},
    "parallel": {"ranks"},
    "links": {"stages_gb_per_s", "ranks_gb_per_s"},
}


@dataclass(frozen=True)
class Recipe:
    path: Path
    sha256: str  # of the file's bytes, recorded in the build manifest
    data: dict[str, Any]  # the parsed TOML, as written
    config: K3Config
    preset: str | None
    config_path: Path | None
    seed: int | None
    checkpoint: Path | None
    dtype: str
    packed_experts: bool
    stage_count: int
    stage_ranges: tuple[range, ...] | None  # explicit ranges, or None: the planner chooses
    capacity: int
    batch: int
    prefill_batch: int
    prefill_seq: int
    decode_batch: int
    backend: str
    target: str | None
    taps: bool = False  # stage exports carry taps.{layer}.* outputs (global layer indices)
    routing_outputs: bool = False  # stage (rank) exports carry check's routing.* (and partial.*) outputs
    ranks: int = 1  # GPUs per stage (k3export/model/parallel.py); 1: stages are not split
    stages_gb_per_s: float | None = None  # link between stages; None: the plan's default
    ranks_gb_per_s: float | None = None  # link among a stage's ranks (the collectives); None: default
    verify_seq: int = 0  # tokens a row of the verify profile (run --speculate K: 3K + 1); 0: none

    @property
    def weights(self) -> dict[str, Any]:
        """The weights as `checkpoint.build_model` takes them."""
        if self.checkpoint is not None:
            return {"checkpoint": str(self.checkpoint), **({"packed_experts": True} if self.packed_experts
                                                           else {})}
        return {"seed": self.seed}


class _Reader:
    """Typed access to the parsed TOML; every failure names the file and the dotted key."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path, self.data = path, data

    def fail(self, key: str, expected: str) -> UserError:
        value = self.get(key)
        found = "missing" if value is None else f"= {value!r}"
        return UserError(f"{self.path}: key '{key}' {found}: expected {expected}")

    def get(self, key: str) -> Any:
        node: Any = self.data
        for part in key.split("."):
            if not isinstance(node, dict):
                return None
            node = node.get(part)
        return node

    def integer(self, key: str, low: int = 1) -> int:
        value = self.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise self.fail(key, f"an integer >= {low}")
        return value

    def bandwidth(self, key: str) -> float | None:
        """An optional positive, finite number of GB/s."""
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise self.fail(key, "a positive number of GB/s")
        return float(value)

    def choice(self, key: str, options: tuple[str, ...], default: str | None = None) -> str:
        value = self.get(key)
        if value is None and default is not None:
            return default
        if value not in options:
            raise self.fail(key, f"one of {', '.join(map(repr, options))}")
        return value

    def one_of(self, table: str, a: str, b: str) -> str:
        """Which of the two alternative keys the table sets (exactly one)."""
        present = [k for k in (a, b) if self.get(f"{table}.{k}") is not None]
        if len(present) != 1:
            raise UserError(f"{self.path}: table [{table}]: expected exactly one of '{a}' or '{b}'"
                            f"{', found both' if len(present) == 2 else ''}")
        return present[0]


def _check_keys(reader: _Reader) -> None:
    data = reader.data
    for table in data:
        if table not in _KEYS:
            raise UserError(f"{reader.path}: unknown table [{table}]: expected {', '.join(_KEYS)}")
        if not isinstance(data[table], dict):
            raise UserError(f"{reader.path}: key '{table}': expected a table [{table}]")
        for key in data[table]:
            if key not in _KEYS[table]:
                raise UserError(f"{reader.path}: unknown key '{table}.{key}': expected one of "
                                f"{', '.join(sorted(_KEYS[table]))}")
    for table in ("model", "weights", "stages", "cache", "profiles", "build"):
        if table not in data:
            raise UserError(f"{reader.path}: table [{table}] is missing")
    for profile, keys in (("prefill", {"batch", "seq"}), ("decode", {"batch"})):
        value = reader.get(f"profiles.{profile}")
        if not isinstance(value, dict) or set(value) != keys:
            raise reader.fail(f"profiles.{profile}", f"a table with keys {', '.join(sorted(keys))}")


def _ranges(reader: _Reader, layers: int) -> tuple[range, ...]:
    value = reader.get("stages.ranges")
    expected = (f"a list of [start, stop] pairs, 0-based and stop-exclusive, covering layers 0..{layers} "
                "in order with no gap or overlap")
    if not isinstance(value, list) or not value:
        raise reader.fail("stages.ranges", expected)
    ranges, at = [], 0
    for pair in value:
        if (not isinstance(pair, list) or len(pair) != 2 or not all(type(x) is int for x in pair)
                or pair[0] != at or not pair[0] < pair[1] <= layers):
            raise reader.fail("stages.ranges", f"{expected}; [{at}, ...] came next")
        ranges.append(range(*pair))
        at = pair[1]
    if at != layers:
        raise reader.fail("stages.ranges", f"{expected}; they end at {at}")
    return tuple(ranges)


def load_recipe(path: str | Path) -> Recipe:
    """Reads and validates a recipe; raises UserError naming the file, the key and the expectation."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such recipe file") from None
    try:
        data = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid TOML ({e})") from None
    r = _Reader(path, data)
    _check_keys(r)

    preset = config_path = None
    if r.one_of("model", "preset", "config") == "preset":
        preset = r.choice("model.preset", tuple(PRESETS))
        config = K3Config.from_preset(preset)
    else:
        if not isinstance(r.get("model.config"), str):
            raise r.fail("model.config", "a path to an HF config.json, relative to the recipe")
        config_path = path.parent / r.get("model.config")
        config = K3Config.from_json(config_path)

    seed = checkpoint = None
    if r.one_of("weights", "seed", "checkpoint") == "seed":
        seed = r.integer("weights.seed", low=0)
    elif isinstance(r.get("weights.checkpoint"), str):
        checkpoint = path.parent / r.get("weights.checkpoint")
    else:
        raise r.fail("weights.checkpoint", "a checkpoint folder, relative to the recipe")
    packed = r.choice("weights.experts", EXPERT_FORMATS, default="as-stored") == "mxfp4-packed"
    if packed and checkpoint is None:
        raise r.fail("weights.experts", "'as-stored' with a seed: only a checkpoint's MXFP4 experts can "
                                        "be kept packed")

    L = config.num_hidden_layers
    if r.one_of("stages", "count", "ranges") == "count":
        ranges, count = None, r.integer("stages.count")
        if count > L:
            raise r.fail("stages.count", f"at most the model's {L} layers")
    else:
        ranges = _ranges(r, L)
        count = len(ranges)

    batch = r.integer("cache.batch")
    profile_batches = {}
    for key in ("profiles.prefill.batch", "profiles.decode.batch"):
        profile_batches[key] = r.integer(key)
        if profile_batches[key] > batch:
            raise r.fail(key, f"at most cache.batch ({batch}): the cache holds that many sequences")
    capacity = r.integer("cache.capacity")
    prefill_seq = r.integer("profiles.prefill.seq")
    if prefill_seq > capacity:
        raise r.fail("profiles.prefill.seq", f"at most cache.capacity ({capacity})")
    verify_seq = r.integer("profiles.verify.seq") if r.get("profiles.verify") is not None else 0
    if verify_seq and not 2 <= verify_seq <= capacity:
        raise r.fail("profiles.verify.seq", f"2 up to cache.capacity ({capacity}): a token and its drafts")

    backend = r.choice("build.backend", BACKENDS)
    target = r.get("build.target")
    problem = target_problem(FLAVOURS[backend], target) if backend in FLAVOURS else \
        None if target is None else target_problem(FLAVOURS["tensorrt"], target)
    if problem:
        raise r.fail("build.target", problem)
    for key in ("build.taps", "build.routing_outputs"):
        if r.get(key) is not None and not isinstance(r.get(key), bool):
            raise r.fail(key, "true or false")
    ranks = r.integer("parallel.ranks") if r.get("parallel.ranks") is not None else 1
    try:
        check_split(config, ranks)
    except UserError as e:
        raise r.fail("parallel.ranks", f"a rank count that divides the model ({e})") from None

    return Recipe(path=path, sha256=hashlib.sha256(raw).hexdigest(), data=data, config=config,
                  preset=preset, config_path=config_path, seed=seed, checkpoint=checkpoint,
                  dtype=r.choice("weights.dtype", DTYPES, default=config.torch_dtype),
                  packed_experts=packed, stage_count=count, stage_ranges=ranges, capacity=capacity,
                  batch=batch, prefill_batch=profile_batches["profiles.prefill.batch"],
                  prefill_seq=prefill_seq, decode_batch=profile_batches["profiles.decode.batch"],
                  backend=backend, target=target, taps=bool(r.get("build.taps")),
                  routing_outputs=bool(r.get("build.routing_outputs")), ranks=ranks,
                  stages_gb_per_s=r.bandwidth("links.stages_gb_per_s"),
                  ranks_gb_per_s=r.bandwidth("links.ranks_gb_per_s"), verify_seq=verify_seq)
