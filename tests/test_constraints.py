"""The constraints files agree with what the wheels they pin require in their own metadata
(wheel-requires.json, refreshed by `python tools/wheel_requires.py`): a GPU host's install
(constraints-gpu.txt: PyPI's CUDA torch, full TensorRT) and this machine's and CI's (constraints.txt:
the CPU torch on disk). Offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
WHEELS = json.loads((ROOT / "wheel-requires.json").read_text())
# Each world's wheels, by the constraints file it installs with.
WORLDS = {"constraints-gpu.txt": WHEELS["gpu_host"], "constraints.txt": WHEELS["this_machine"]}
# Both worlds are Linux x86_64 with Python 3.11; no extra of a wheel is asked for.
LINUX = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
         "python_version": "3.11", "python_full_version": "3.11.7", "extra": ""}


def pins(text: str) -> dict[str, Version]:
    """The `name==version` lines of a constraints file, by canonical name."""
    found = {}
    for line in text.splitlines():
        if line := line.split("#")[0].strip():
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{line}: pin one exact version"
            found[canonicalize_name(requirement.name)] = Version(spec.version)
    return found


def disagreements(wheel: dict, pinned: dict[str, Version]) -> list[str]:
    """The wheel's Linux requirements that the pins contradict, and the exact versions it requires
    that the pins leave out (what torch pins exactly, a host needs: its CUDA libraries, NCCL, Triton)."""
    found = []
    own = canonicalize_name(wheel["name"])
    if own not in pinned or not SpecifierSet(f"=={pinned[own]}").contains(wheel["version"]):
        found.append(f"{wheel['file']} is not the version pinned: refresh with `{WHEELS['refresh']}`")
    for requirement in map(Requirement, wheel["requires_dist"]):
        if requirement.marker and not requirement.marker.evaluate(LINUX):
            continue
        name = canonicalize_name(requirement.name)
        if name not in pinned:
            if any(spec.operator == "==" for spec in requirement.specifier):
                found.append(f"{wheel['file']} requires {requirement}: not pinned")
        elif not requirement.specifier.contains(pinned[name], prereleases=True):
            found.append(f"{wheel['file']} requires {requirement}: pinned {name}=={pinned[name]}")
    return found


def departures(cpu: dict[str, Version], gpu: dict[str, Version]) -> list[str]:
    """constraints.txt's pins that constraints-gpu.txt leaves out or changes, other than those the
    GPU host's torch pins itself (its Triton): every other pin of ours applies on a GPU host too."""
    torch_pins = {canonicalize_name(Requirement(r).name) for r in WHEELS["gpu_host"]["torch"]["requires_dist"]
                  if "==" in r}
    return [f"constraints-gpu.txt: {name}=={gpu.get(name)}, constraints.txt: {name}=={version}"
            for name, version in cpu.items() if gpu.get(name) != version and name not in torch_pins]


def every_problem(texts: dict[str, str]) -> list[str]:
    pinned = {name: pins(text) for name, text in texts.items()}
    return [*departures(pinned["constraints.txt"], pinned["constraints-gpu.txt"]),
            *(line for name, wheels in WORLDS.items() for wheel in wheels.values()
              for line in disagreements(wheel, pinned[name]))]


@pytest.mark.parametrize("world", [f"{name}: {wheel}" for name, wheels in WORLDS.items() for wheel in wheels])
def test_pins_agree_with_the_wheels_own_requirements(world: str) -> None:
    name, wheel = world.split(": ")
    assert disagreements(WORLDS[name][wheel], pins((ROOT / name).read_text())) == []


def test_a_gpu_host_keeps_our_other_pins() -> None:
    assert departures(pins((ROOT / "constraints.txt").read_text()),
                      pins((ROOT / "constraints-gpu.txt").read_text())) == []


def test_the_metadata_is_of_each_worlds_wheel() -> None:
    """The GPU host's torch is PyPI's CUDA build for Linux x86_64 and this machine's the CPU build
    on its disk, both for Python 3.11 (a refresh on another machine would record other wheels)."""
    gpu, cpu = WHEELS["gpu_host"]["torch"], WHEELS["this_machine"]["torch"]
    assert gpu["file"].endswith("-cp311-cp311-manylinux_2_28_x86_64.whl") and "+" not in gpu["version"]
    assert cpu["file"].endswith("-cp311-cp311-manylinux_2_28_x86_64.whl") and cpu["version"].endswith("+cpu")
    assert any(Requirement(r).name == "nvidia-nccl-cu13" for r in gpu["requires_dist"])


@pytest.mark.parametrize(("file", "edit", "expected"), [
    ("constraints-gpu.txt", ("triton==3.7.1", "triton==3.6.0"), "requires triton==3.7.1"),
    ("constraints-gpu.txt", ("nvidia-nccl-cu13==2.29.7\n", ""), "requires nvidia-nccl-cu13==2.29.7"),
    ("constraints-gpu.txt", ("tensorrt-cu13-libs==11.4.0.106", "tensorrt-cu13-libs==11.3.0.99"),
     "requires tensorrt_cu13_libs=="),
    ("constraints-gpu.txt", ("onnx==1.23.2", "onnx==1.22.0"), "onnx==1.22.0, constraints.txt: onnx==1.23.2"),
    ("constraints.txt", ("torch==2.13.0", "torch==2.14.1"),
     "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl is not the version pinned"),
], ids=["triton", "nccl-missing", "tensorrt-libs", "other-pin", "cpu-torch"])
def test_a_wrong_pin_is_named(file: str, edit: tuple[str, str], expected: str) -> None:
    """What the checks above report for a constraints file edited wrongly."""
    texts = {name: (ROOT / name).read_text() for name in WORLDS}
    assert edit[0] in texts[file]
    texts[file] = texts[file].replace(*edit)
    problems = every_problem(texts)
    assert any(expected in line for line in problems), problems
