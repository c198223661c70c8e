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


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`k3export export --preset k3-tiny --seed 0` (float32), shared by every test that reads it."""
    from k3export.cli import main

    folder = tmp_path_factory.mktemp("export") / "tiny"
    assert main(["export", "--preset", "k3-tiny", "--seed", "0", "--out", str(folder)]) == 0
    return folder
