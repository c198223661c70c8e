"""Which ops' bits move with which CPU knob, and by how much.

    python tools/cpu_bits.py

Runs the ops the k3 model is made of (matmuls, softmax, RMS norm, SiLU, sigmoid, exp, a sum) and the
eager k3-tiny model, in float32, float16 and bfloat16 on fixed inputs, once per setting of the two
knobs that choose torch's CPU kernels (each read once per process, so one process a setting), and
prints, per op and dtype, the fraction of elements that differ from the uncapped run and the largest
difference relative to the output's largest magnitude. `--setting` is the per-process worker.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

SETTINGS = {"default": {}, "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
            "ONEDNN_MAX_CPU_ISA=AVX512_CORE": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
            "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
            "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"}}
DTYPES = ("float32", "float16", "bfloat16")


def outputs() -> dict[str, list[float]]:
    """Every op's output (as float32 values) per dtype, on seeded inputs of the model's widths."""
    from k3export.config import K3Config
    from k3export.weights.checkpoint import build_model

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 512, generator=gen), torch.randn(512, 512, generator=gen) / 512**0.5
    rms_weight = torch.rand(512, generator=gen)
    ids = torch.randint(0, 1000, (2, 40), generator=gen)
    out = {}
    ops = {"matmul": lambda a, b, g: a @ b, "linear": lambda a, b, g: torch.nn.functional.linear(a, b),
           "softmax": lambda a, b, g: torch.softmax(a, -1),
           "rms_norm": lambda a, b, g: torch.nn.functional.rms_norm(a, (512,), g, 1e-6),
           "silu": lambda a, b, g: torch.nn.functional.silu(a), "sigmoid": lambda a, b, g: torch.sigmoid(a),
           "exp": lambda a, b, g: torch.exp(a), "sum": lambda a, b, g: a.sum(-1)}
    for name in DTYPES:
        dtype = getattr(torch, name)
        for op, f in ops.items():
            out[f"{op} {name}"] = f(x.to(dtype), w.to(dtype), rms_weight.to(dtype)).float().flatten().tolist()
        model = build_model(K3Config.from_preset("k3-tiny"), dtype, {"seed": 0})
        with torch.no_grad():
            out[f"k3-tiny logits {name}"] = model(ids % model.config.vocab_size)[0].float().flatten().tolist()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setting:
        print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "outputs": outputs()}))
        return
    runs = {}
    for label, env in SETTINGS.items():
        done = subprocess.run([sys.executable, __file__, "--setting", label], env={**os.environ, **env},
                              capture_output=True, text=True, check=True)
        runs[label] = json.loads(done.stdout)
    base = runs["default"]["outputs"]
    print(f"{torch.__version__}; uncapped ATen level {runs['default']['capability']}")
    print("each cell: fraction of elements that differ from the uncapped run / largest difference over "
          "the largest magnitude")
    labels = [s for s in SETTINGS if s != "default"]
    heads = [f"{s} (ATen {runs[s]['capability']})" for s in labels]
    print(f"| op | {' | '.join(heads)} |")
    print("|---" * (len(labels) + 1) + "|")
    for op, ref in base.items():
        r = torch.tensor(ref)
        cells = []
        for s in labels:
            diff = (torch.tensor(runs[s]["outputs"][op]) - r).abs()
            cells.append("same" if not diff.any() else
                         f"{(diff > 0).float().mean():.0%} / {diff.max() / r.abs().max():.1e}")
        print(f"| {op} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
