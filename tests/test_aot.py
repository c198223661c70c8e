"""Every Triton kernel variant compiles ahead of time for sm_90 without a GPU, fits in shared
memory and does not spill registers, per the bundled `ptxas -v`."""

from __future__ import annotations

import os

import pytest

import k3plugins
from k3plugins.aot import SM90_MAX_SHARED_BYTES, compile_variant, kernel_stats

# Under the interpreter @triton.jit yields interpreted functions, which do not compile.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="TRITON_INTERPRET is set: run `pytest tests/kernels` separately")


@pytest.mark.parametrize("variant", k3plugins.kernel_variants(), ids=lambda v: v.name)
def test_variant_compiles_for_sm90(variant: k3plugins.KernelVariant) -> None:
    stats = kernel_stats(compile_variant(variant))
    assert stats.shared_bytes <= SM90_MAX_SHARED_BYTES, stats
    assert stats.spill_stores == 0 and stats.spill_loads == 0, stats
