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
