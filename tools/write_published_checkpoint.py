"""Writes a seeded model as a checkpoint in the published Kimi-K3 layout (k3export/weights/published.py).

    python tools/write_published_checkpoint.py --out /tmp/k3-tiny-published [--experts bf16]
    k3export info --checkpoint /tmp/k3-tiny-published
"""

from __future__ import annotations

import argparse

import torch

from k3export.config import PRESETS, K3Config
from k3export.model import K3ForCausalLM
from k3export.weights.published import write_published


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, metavar="DIR")
    parser.add_argument("--preset", choices=list(PRESETS), default="k3-tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experts", choices=["mxfp4", "bf16"], default="mxfp4",
                        help="routed experts as published (MXFP4) or as plain bfloat16 .weight tensors")
    args = parser.parse_args()
    model = K3ForCausalLM(K3Config.from_preset(args.preset), torch.float32).eval()
    model.init_weights(args.seed)
    for path in write_published(model, args.out, experts=args.experts):
        print(path)


if __name__ == "__main__":
    main()
