"""Compile every Triton kernel variant for sm_90 (no GPU needed) and print its resources.

    PYTHONPATH=plugins python tools/kernel_report.py
"""

from __future__ import annotations

import k3plugins
from k3plugins.aot import compile_variant, kernel_stats


def main() -> None:
    header = (f"{'variant':<36} {'warps':>5} {'stages':>6} {'regs':>5} {'smem B':>7} {'spill st B':>10} "
              f"{'spill ld B':>10}")
    print(header)
    print("-" * len(header))
    for variant in k3plugins.kernel_variants():
        s = kernel_stats(compile_variant(variant))
        print(f"{variant.name:<36} {variant.num_warps:>5} {variant.num_stages:>6} {s.registers:>5} "
              f"{s.shared_bytes:>7} {s.spill_stores:>10} {s.spill_loads:>10}")


if __name__ == "__main__":
    main()
