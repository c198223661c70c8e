"""Types of command-line options: argparse calls them on each value as it parses, so a bad value
is refused (`argument --batch: expected an integer >= 1, got 0`, exit 2) before any model is built
or file read. Every parser of the CLI (and of `python -m k3export.runtime`) uses these.

Also the one check of a request against this machine's memory, made with the numbers from the
export manifests before anything is allocated. Importing this module imports neither torch nor
numpy: the CLI imports it to build its parser.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3export.artifacts import BUILD, EXPORT, KINDS, MANIFEST_NAMES, STAGE, Kind, identify
from k3export.errors import UserError

MIN_CAPACITY = 8  # cached tokens per sequence of an export (its MLA cache's static row count)
MAX_SEED = 2**63 - 1  # torch and numpy both take seeds in 0..2**63-1
# Counts (tokens, sequences, steps, stages, token ids) are 32-bit, as TensorRT's dimensions are;
# byte estimates over them stay well within a float.
MAX_COUNT = 2**31 - 1


def integer(minimum: int, maximum: int) -> Callable[[str], int]:
    """An integer in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in {minimum}..{maximum}, "
                                             f"got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"expected an integer <= {maximum}, got {value}")
        return value

    parse.__name__ = f"integer in {minimum}..{maximum}"
    return parse


def real(minimum: float, maximum: float = math.inf, *, above_minimum: bool = False) -> Callable[[str], float]:
    """A finite number in [minimum, maximum] (or (minimum, maximum] with `above_minimum`)."""
    low = f"> {minimum:g}" if above_minimum else f">= {minimum:g}"
    bounds = low if maximum == math.inf else f"{low} and <= {maximum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {bounds}, got {text!r}") from None
        too_low = value <= minimum if above_minimum else value < minimum
        if not math.isfinite(value) or too_low or value > maximum:
            raise argparse.ArgumentTypeError(f"expected a finite number {bounds}, got {text}")
        return value

    parse.__name__ = f"number {bounds}"
    return parse


positive_int = integer(1, MAX_COUNT)
non_negative_int = integer(0, MAX_COUNT)
seed = integer(0, MAX_SEED)
capacity = integer(MIN_CAPACITY, MAX_COUNT)
probability = real(0.0, 1.0)
non_negative_real = real(0.0)
positive_real = real(0.0, above_minimum=True)


def token_ids(text: str) -> list[int]:
    """Comma-separated token ids (their range is checked against the vocabulary once it is read)."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    outside = [t for t in ids if not 0 <= t <= MAX_COUNT]
    if outside:
        raise argparse.ArgumentTypeError(f"expected token ids in 0..{MAX_COUNT}, got {outside[0]}")
    return ids


def _kind(text: str) -> str | None:
    """'folder', 'file' or None (nothing there); a name the system refuses is refused here."""
    if not text:  # Path("") is the current folder: never what an empty value meant
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    try:
        path = Path(text)
        return "folder" if path.is_dir() else "file" if path.exists() else None
    except (OSError, ValueError) as e:  # a name too long, a NUL byte
        raise argparse.ArgumentTypeError(f"{text[:80]}: {getattr(e, 'strerror', None) or e}") from None


def _existing(text: str, kind: str, other: str) -> str:
    """`text` if it names an existing `kind` ("folder" or "file"); else why not."""
    found = _kind(text)
    if found is None:
        raise argparse.ArgumentTypeError(f"{text}: no such {kind}")
    if found == other:
        raise argparse.ArgumentTypeError(f"{text} is a {other}; expected a {kind}")
    return text


def existing_dir(text: str) -> str:
    """A folder that exists (an input)."""
    return _existing(text, "folder", "file")


def existing_file(text: str) -> str:
    """A file that exists (an input)."""
    return _existing(text, "file", "folder")


def existing_path(text: str) -> str:
    """A file or folder that exists (an input that may be either)."""
    if _kind(text) is None:
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")
    return text


def artifact_path(expected: str, *kinds: Kind, any_file: bool = False) -> Callable[[str], str]:
    """An existing k3export output of one of `kinds` (k3export.artifacts.KINDS), and a build only when
    whole; `any_file`: a file of any kind too (an engine, whose runner reads its record). Another kind
    is refused naming what it is and what reads it, `expected` naming what the option takes. A
    manifest of the right name that k3export cannot read passes: `verify` names the damage."""

    def parse(text: str) -> str:
        found = _kind(text)
        if found is None:
            raise argparse.ArgumentTypeError(f"{text}: no such {'file or folder' if any_file else 'folder'}")
        if found == "file" and any_file:
            return text
        artifact = identify(text)
        if artifact is None:
            manifests = ", ".join(MANIFEST_NAMES)
            raise argparse.ArgumentTypeError(
                f"{text} is a file; expected a folder, {expected}" if found == "file" else
                f"{text}: no k3export output there (none of {manifests}); expected {expected}")
        damaged = artifact.manifest is None and any(k.manifest == artifact.kind.manifest for k in kinds)
        if artifact.kind not in kinds and not damaged:
            raise argparse.ArgumentTypeError(f"{text} is {artifact.describe()}; expected {expected}")
        try:
            artifact.require_whole("")
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    parse.__name__ = f"existing {expected}"  # (the CLI fuzz draws paths for types named existing...)
    return parse


def recipe_file(text: str) -> str:
    """A recipe file (engines/*.toml); a build folder is refused naming the recipe it was built from."""
    artifact = identify(text) if _kind(text) == "folder" else None
    if artifact is not None:
        recipe = (artifact.manifest or {}).get("recipe_file", "its RECIPE")
        built = f"; it was built from {recipe}" if artifact.kind is BUILD else ""
        try:
            artifact.require_whole("")
        except UserError as e:
            built += f". Besides, {e}"
        raise argparse.ArgumentTypeError(f"{text} is {artifact.describe()}; expected a RECIPE file{built}")
    return existing_file(text)


def _under_a_folder(text: str) -> None:
    """Refuses an output path below a file (`notes.txt/out`): its nearest existing parent is a folder."""
    for parent in Path(text).parents:
        kind = _kind(str(parent))
        if kind == "file":
            raise argparse.ArgumentTypeError(f"{text}: {parent} is a file, not a folder")
        if kind == "folder":
            return


def output_path(text: str) -> str:
    """A file or folder to write: a name the system takes, not below a file (whether what is
    there may be replaced is the command's to judge: k3export.artifacts)."""
    _kind(text)
    _under_a_folder(text)
    return text


def available_memory() -> int:
    """Bytes this machine can still allocate without swapping (MemAvailable), or 0 if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def call_bytes(manifests: list[dict[str, Any]], batch: int, seq: int) -> int:
    """The bytes of one call's inputs and outputs through every export of `manifests` (their
    export.json) at `batch` rows of `seq` tokens: caches, AttnRes boundaries, logits. An output
    written in place over its input (export.json "in_place") is counted once. A lower bound of
    what running the call holds (the graph's own intermediates come on top)."""
    import torch

    sizes = {"batch": batch, "seq": seq}
    total = 0
    for manifest in manifests:
        sizes["capacity"] = manifest["capacity"]
        in_place = set(manifest.get("in_place", {}))
        outputs = [s for s in manifest.get("outputs", []) if s["name"] not in in_place]
        for spec in manifest["inputs"] + outputs:
            elements = math.prod(sizes[d] if isinstance(d, str) else d for d in spec["shape"])
            total += elements * getattr(torch, spec["dtype"]).itemsize
    return total


def require_memory(needed: int, request: str, holds: str) -> None:
    """Refuses, with the numbers, a request whose `needed` bytes exceed what this machine has
    available. `request` names the options ("--batch 4096 --prompt-len 32"), `holds` what the
    bytes are."""
    available = available_memory()
    if available and needed > available:
        raise UserError(f"{request}: needs at least {needed / 1e9:,.1f} GB ({holds}) and this machine has "
                        f"{available / 1e9:,.1f} GB available; ask for fewer sequences or tokens")


def require_request_fits(request: str, manifests: list[dict[str, Any]], batch: int, prompt_len: int,
                         decode_tokens: int, copies: int = 1) -> None:
    """Refuses, before anything is allocated, a request of `batch` rows whose longest holds
    `prompt_len` prompt tokens and then `decode_tokens` more: past the exports' cache capacity, or
    past this machine's memory (`copies` of the caches and one prefill call's tensors: 2 when an
    eager model runs beside the graph). `request` names the options as the user gave them."""
    capacity = min(m["capacity"] for m in manifests)
    tokens = prompt_len + decode_tokens
    if tokens > capacity:
        raise UserError(f"{request}: the longest row holds {prompt_len} + {decode_tokens} = {tokens} tokens "
                        f"in its cache, and the export's cache capacity is {capacity} tokens per sequence "
                        "(export --capacity, or the recipe's [cache] capacity); ask for fewer tokens")
    holds = f"the caches and the prefill's inputs and outputs at batch {batch}, {prompt_len} tokens"
    require_memory(copies * call_bytes(manifests, batch, prompt_len), request,
                   holds + (f", {copies} copies" if copies > 1 else ""))


# What the options that read k3export's outputs take.
EXPORT_DIR = artifact_path("an export (`k3export export --out DIR`, or a build's stage folder)", EXPORT,
                           STAGE)
BUILD_DIR = artifact_path("a build (`k3export build RECIPE --out DIR`), whole", BUILD)
ENGINE_OR_BUILD = artifact_path("an engine file (`k3export build --onnx DIR --out FILE`) or a whole build",
                                BUILD, any_file=True)
ANY_OUTPUT = artifact_path("a folder k3export wrote (an export, a build, a check report)", *KINDS)

# check --eager: how the eager side runs (k3export.check.runners.eager.plan_eager).
STREAMED, IN_MEMORY, AUTO = "streamed", "in-memory", "auto"
EAGER_MODES = (STREAMED, IN_MEMORY, AUTO)
