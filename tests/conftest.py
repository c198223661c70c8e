from pathlib import Path

import pytest

from k3export.config import K3Config
from k3export.model import K3ForCausalLM


@pytest.fixture(scope="session")
def tiny_config() -> K3Config:
    return K3Config.from_preset("k3-tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_config: K3Config) -> K3ForCausalLM:
    model = K3ForCausalLM(tiny_config).eval()
    model.init_weights(0)
    return model


def _export_tiny(folder: Path, *options: str) -> Path:
    from k3export.cli import main

    assert main(["export", "--preset", "k3-tiny", "--seed", "0", "--out", str(folder), *options]) == 0
    return folder


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`k3export export --preset k3-tiny --seed 0` (float32), shared by every test that reads it."""
    return _export_tiny(tmp_path_factory.mktemp("export") / "tiny")


@pytest.fixture(scope="session")
def aot_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same export with `--aot-plugins`: every k3 node marked aot = 1."""
    return _export_tiny(tmp_path_factory.mktemp("export") / "tiny_aot", "--aot-plugins")


@pytest.fixture(scope="session")
def taps_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same export with `--taps` (per-layer outputs for localisation), shared by test_taps and
    test_report."""
    return _export_tiny(tmp_path_factory.mktemp("export") / "tiny_taps", "--taps")
