"""The description of one ahead-of-time compilable kernel variant."""

from __future__ import annotations

from typing import Any, NamedTuple

import triton

# Triton's names for the element types the launchers accept.
DTYPES = ("fp32", "fp16", "bf16")


class KernelVariant(NamedTuple):
    """One kernel specialisation: `signature` and `constexprs` are what `triton.compile`'s
    ASTSource takes; `num_warps` and `num_stages` are the launch options the launcher uses for it
    (3 stages is Triton's default). `divisible_by_16` names int arguments compiled as multiples of
    16, as Triton's JIT specialises such values (the launcher must then pass only such values)."""

    name: str
    fn: triton.JITFunction
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int = 3
    divisible_by_16: tuple[str, ...] = ()


def pointer(dtype: str) -> str:
    return f"*{dtype}"
