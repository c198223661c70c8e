import fcntl
import os
import shutil
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


def shared_export(tmp_path_factory: pytest.TempPathFactory, name: str, *options: str) -> Path:
    """`k3export export --preset k3-tiny --seed 0 OPTIONS`, exported once per test run: pytest-xdist
    gives each worker a session of its own, so the first worker to ask exports it into the run's
    folder, under a lock, and the others wait for it. Each worker gets a copy of its own (a check
    writes its report into the export's folder)."""
    from k3export.cli import main

    # A worker's base folder lies in the run's (pytest-N/popen-gwK); without xdist the run's is its own.
    run = tmp_path_factory.getbasetemp()
    run = run.parent if os.environ.get("PYTEST_XDIST_WORKER") else run
    folder = run / "shared" / name
    folder.parent.mkdir(exist_ok=True)
    with open(folder.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder.parent / f"{name}.done"
        if not done.exists():
            assert main(["export", "--preset", "k3-tiny", "--seed", "0", "--out", str(folder), *options]) == 0
            done.touch()
    return Path(shutil.copytree(folder, tmp_path_factory.mktemp("export") / name))


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`k3export export --preset k3-tiny --seed 0` (float32), shared by every test that reads it."""
    return shared_export(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def aot_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same export with `--aot-plugins`: every k3 node marked aot = 1."""
    return shared_export(tmp_path_factory, "tiny_aot", "--aot-plugins")


@pytest.fixture(scope="session")
def taps_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same export with `--taps` (per-layer outputs for localisation), shared by test_taps and
    test_report."""
    return shared_export(tmp_path_factory, "tiny_taps", "--taps")
