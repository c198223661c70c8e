"""Kernel tests run Triton's interpreter on the CPU. It must be switched on before anything imports
triton, so this directory runs as its own pytest process: `pytest tests/kernels`."""

import os

os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config):
    # The interpreter reads runtime loop bounds such as range(T) from 1-element numpy arrays.
    config.addinivalue_line("filterwarnings",
                            "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
