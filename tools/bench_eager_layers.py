"""Seconds per layer per step of the eager model at the published widths, on this machine's CPU.

    python tools/bench_eager_layers.py [--threads 2] [--prefill 256] [--decode 8]

The kimi-k3 preset's widths (hidden 7168, 96 KDA heads of 128, MLA latent 576, latent MoE 3584 x
3072, shared expert 6144) with 8 routed experts, 2 a token, so that one layer fits in a few GB: its
first KDA layer (1) and first MLA layer (3), both MoE layers, each built alone in its own process
with seeded float32 weights (`build_model(..., layers)`), then timed over a prefill of --prefill
tokens (B = 1) and --decode decode steps after it. The routed experts run only the chosen ones, so
time follows the 2 a token (the published 16 of 896 would run 8x their share); weights follow the 8.
Each row also gives the child's peak RSS (os.wait4's ru_maxrss) and the layer's weight bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stage_memory import peak_rss

CHILD = """
import dataclasses, sys, time, torch
from k3export.config import K3Config
from k3export.model.cache import empty_layer_cache
from k3export.weights.checkpoint import build_model
layer, prefill, decode, threads = (int(x) for x in sys.argv[1:5])
torch.set_num_threads(threads)
config = dataclasses.replace(K3Config.from_preset("kimi-k3"), num_experts=8, num_experts_per_token=2)
model = build_model(config, torch.float32, {"seed": 0}, range(layer, layer + 1))
weights = sum(p.nbytes for p in model.model.layers[layer].parameters())
gen = torch.Generator().manual_seed(0)
D = config.hidden_size
bank = [torch.randn(1, prefill, D, generator=gen) for _ in range(layer // config.attn_res_block_size + 1)]
cache = [empty_layer_cache(config, layer, 1, prefill + decode, torch.float32)]
lengths = torch.zeros(1, dtype=torch.int64)


def step(T):
    global cache, lengths
    partial = torch.randn(1, T, D, generator=gen)
    start = time.perf_counter()
    with torch.no_grad():
        _, _, cache = model.run_layers([b[:, :T] for b in bank], partial, cache, range(layer, layer + 1),
                                       lengths, torch.full((1,), T))
    lengths = lengths + T
    return time.perf_counter() - start


first = step(prefill)
steps = sorted(step(1) for _ in range(decode))
print(weights, first, steps[len(steps) // 2], steps[0], steps[-1])
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--decode", type=int, default=8)
    args = parser.parse_args()
    print(f"$ python tools/bench_eager_layers.py --threads {args.threads} --prefill {args.prefill} "
          f"--decode {args.decode}")
    print("| layer | weights GB | peak RSS GB | prefill s | s/token | decode step s (median [min, max]) |")
    print("|---|---|---|---|---|---|")
    for layer, kind in ((1, "KDA + MoE"), (3, "MLA + MoE")):
        peak, _, out = peak_rss([sys.executable, "-c", CHILD, str(layer), str(args.prefill), str(args.decode),
                                 str(args.threads)])
        weights, prefill, median, low, high = (float(x) for x in out.split())
        print(f"| {layer} ({kind}) | {weights / 1e9:.2f} | {peak / 1e9:.2f} | {prefill:.2f} | "
              f"{prefill / args.prefill:.4f} | {median:.3f} [{low:.3f}, {high:.3f}] |", flush=True)


if __name__ == "__main__":
    main()
