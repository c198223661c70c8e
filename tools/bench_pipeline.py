"""The pipeline's own gain: decode tokens/s and each stage's busy fraction with micro-batches in
flight, measured on k3-small in 2 stages (one process a stage, torchrun, gloo), and estimated for
the published recipe from the plan.

    python tools/bench_pipeline.py [--build out/k3-small-2] [--max-new-tokens 65] [--prompt-len 32]
                                   [--runs 8x1,16x2,32x4,16x1] [--recipe engines/kimi-k3-16x1.toml]
    python tools/bench_pipeline.py --build out/k3-small-2x2 --ranks 2   # each stage split over 2 ranks

Measured: each run is `torchrun --nproc-per-node S*N -m k3export.runtime BUILD --batch B
--micro-batches M --json` (float32, ONNX Runtime with the default intra-op threads, the host's cores
/ the processes, at least one), one after the other; the load average (`uptime`) before each is
printed with it, since other work on the machine takes cores from the stages. The build is made
from engines/k3-small-2.toml if the folder does not hold one (with --ranks N > 1: that recipe with
`[parallel] ranks = N`, written beside the folder); a grid's processes report the part of their
busy time spent in their stage's sums. Runs with the same batch have the same
prompts (--seed 0), so their greedy tokens are compared: positions that differ are listed (they
can only be near-ties, where batching's rounding decides the top token).

Estimated (--recipe, the published one by default; clearly not a measurement): per stage and
decode step of a micro-batch of b sequences, the bytes the GPU reads (the stage's weights other
than routed experts; of the routed experts, the expected share that b tokens choose, E (1 - (1 -
k/E)^b) of E with top-k routing spread evenly; and b sequences' caches at the recipe's full
context) at the H200's 4.8 TB/s, plus the plan's link time for b tokens' boundary tensors. With the
recipe's batch in M micro-batches of b, a round (every micro-batch one step) takes the longer of M
times the slowest stage's step and one micro-batch's trip through every stage and link (it cannot
step again before its tokens are back): tokens/s = batch / round. Kernel efficiency, launch
latency and the link's per-message latency are left out, so these are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from k3export.model.accounting import H200_BYTES, MXFP4_BITS, parameter_report
from k3export.runtime import stage_ranks
from k3export.shards.plan import plan_recipe
from k3export.shards.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
H200_BYTES_PER_S = 4.8e12  # HBM3e as NVIDIA states it


def load_average() -> str:
    return " / ".join(Path("/proc/loadavg").read_text().split()[:3])


def measure(build: Path, processes: int, batch: int, micro_batches: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "-m",
               "k3export.runtime", str(build), "--batch", str(batch), "--micro-batches", str(micro_batches),
               "--prompt-len", str(args.prompt_len), "--max-new-tokens", str(args.max_new_tokens),
               "--seed", "0", "--json"]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ensure_build(build: Path, ranks: int) -> None:
    if (build / "manifest.json").is_file():
        return
    recipe = ROOT / "engines/k3-small-2.toml"
    if ranks > 1:
        split = build.with_suffix(".toml")
        split.write_text(recipe.read_text() + f"\n[parallel]\nranks = {ranks}\n")
        recipe = split
    subprocess.run([sys.executable, "-m", "k3export.cli", "build", str(recipe), "--out", str(build),
                    "--backend", "onnx"], check=True)


def measured_table(args: argparse.Namespace) -> None:
    build = Path(args.build)
    ensure_build(build, args.ranks)
    stages = stage_ranks(build)
    ranks = len(stages[0])
    names = [f"stage {i}" + (f" rank {r}" if ranks > 1 else "") for i, folders in enumerate(stages)
             for r in range(len(folders))]
    runs = [tuple(map(int, run.split("x"))) for run in args.runs.split(",")]
    results = {}
    print(f"k3-small in {len(stages)} stages" + (f" x {ranks} ranks" if ranks > 1 else "")
          + f" ({build}), float32, prompts up to {args.prompt_len} tokens, --max-new-tokens "
          f"{args.max_new_tokens}, {len(names)} processes\n")
    busy = "busy (of it sums)" if ranks > 1 else "busy"
    print("| run | sequences | micro-batches | load before (1/5/15 min) | decode tokens/s | vs first | "
          + " | ".join(f"{name} {busy}" for name in names) + " | "
          + " | ".join(f"{name} ms a step" for name in names) + " | bytes a token 0->1 |")
    print("|" + "---|" * (7 + 2 * len(names)))
    for label, (batch, count) in zip("abcdefgh", runs, strict=False):
        load = load_average()
        result = measure(build, len(names), batch, count, args)
        results[label] = (batch, count, result)
        rate = result["decode_tokens_per_second"]
        first = results["a"][2]["decode_tokens_per_second"]
        times = result["stages"]
        steps = [t["busy_seconds"] / (result["decode_steps"] * count) * 1e3 for t in times]
        fractions = [f"{t['busy_fraction']:.0%}" + (f" ({t['sums_seconds'] / t['busy_seconds']:.0%})"
                                                    if ranks > 1 else "") for t in times]
        print(f"| ({label}) | {batch} | {count} of {batch // count} | {load} | {rate:.1f} | "
              f"{rate / first:.2f}x | " + " | ".join(fractions) + " | "
              + " | ".join(f"{ms:.0f}" for ms in steps)
              + f" | {times[0]['sent_bytes_per_token']:.0f} |", flush=True)
    print()
    by_batch: dict[int, list[str]] = {}
    for label, (batch, _, _) in results.items():
        by_batch.setdefault(batch, []).append(label)
    for batch, labels in by_batch.items():
        for other in labels[1:]:
            a, b = results[labels[0]][2]["tokens"], results[other][2]["tokens"]
            differ = [(row, i) for row, (x, y) in enumerate(zip(a, b, strict=True))
                      for i in range(min(len(x), len(y))) if x[i] != y[i]]
            same = "identical" if not differ and a == b else f"differences at (row, position) {differ[:8]}"
            print(f"tokens ({labels[0]}) against ({other}), {batch} sequences: {same}")


def routed_bytes_per_moe_layer(recipe) -> float:
    """Bytes of one MoE layer's routed experts as the recipe stores them (every MoE layer has the same)."""
    config = recipe.config
    params = parameter_report(config).params["routed_experts"]
    layers = sum(not config.is_dense(i) for i in range(config.num_hidden_layers))
    elem = (MXFP4_BITS / 8 if recipe.packed_experts
            else torch.empty(0, dtype=getattr(torch, recipe.dtype)).element_size())
    return params / layers * elem


def estimate(recipe_path: str) -> None:
    recipe = load_recipe(recipe_path)
    plan = plan_recipe(recipe)
    config = recipe.config
    routed = routed_bytes_per_moe_layer(recipe)
    experts, chosen = config.num_experts, config.num_experts_per_token

    def stage_seconds(stage, b: int) -> tuple[float, float]:
        """One decode step of b sequences on the stage: (reading its bytes, sending its boundary)."""
        share = 1 - (1 - chosen / experts) ** b  # of a layer's experts, chosen by at least one token
        routed_bytes = stage.moe_layers * routed
        read = stage.weight_bytes - routed_bytes + share * routed_bytes + b * stage.cache_bytes_per_sequence
        return read / H200_BYTES_PER_S, b * stage.seconds_per_token_sent

    print(f"\nEstimate (not a measurement): {recipe_path}, {len(plan.stages)} stages, {recipe.dtype}"
          f"{', routed experts MXFP4' if recipe.packed_experts else ''}, every sequence at a context of "
          f"{recipe.capacity} tokens, H200 {H200_BYTES_PER_S / 1e12:g} TB/s, link {plan.link_gb_per_s:g} "
          "GB/s. "
          f"First the recipe's {recipe.batch} sequences in M micro-batches, then M micro-batches of "
          f"{recipe.decode_batch} (its decode profile), the caches of all of them held\n")
    print("| micro-batches | sequences each | slowest stage ms a step | one trip through all stages ms | "
          "round ms | decode tokens/s | slowest stage busy | weights + caches fit one H200 |")
    print("|---|---|---|---|---|---|---|---|")
    splits = [(count, recipe.batch // count) for count in (1, 2, 4, 8) if recipe.batch % count == 0]
    for count, b in splits + [(count, recipe.decode_batch) for count in (2, 4, 8, 16)]:
        times = [stage_seconds(stage, b) for stage in plan.stages]
        slowest = max(read for read, _ in times)
        trip = sum(read + link for read, link in times)
        round_seconds = max(count * slowest, trip)
        fits = all(stage.weight_bytes + count * b * stage.cache_bytes_per_sequence + stage.activation_bytes
                   <= H200_BYTES for stage in plan.stages)
        print(f"| {count} | {b} | {slowest * 1e3:.2f} | {trip * 1e3:.2f} | {round_seconds * 1e3:.2f} | "
              f"{count * b / round_seconds:.0f} | {count * slowest / round_seconds:.0%} | "
              f"{'yes' if fits else 'no'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=str(ROOT / "out/k3-small-2"))
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=65)
    parser.add_argument("--ranks", type=int, default=1, help="of each stage, for a build made here")
    parser.add_argument("--runs", default="8x1,16x2,32x4,16x1",
                        help="SEQUENCESxMICRO_BATCHES, comma-separated")
    parser.add_argument("--recipe", default=str(ROOT / "engines/kimi-k3-16x1.toml"), help="for the estimate")
    parser.add_argument("--estimate-only", action="store_true")
    args = parser.parse_args()
    if not args.estimate_only:
        measured_table(args)
    estimate(args.recipe)


if __name__ == "__main__":
    main()
