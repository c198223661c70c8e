"""Peak resident memory of loading one rank of a split stage from a checkpoint, against the whole stage.

    python tools/rank_memory.py [--preset k3-small] [--ranks 2 4] [--checkpoint DIR]

Writes a seeded checkpoint of the preset (safetensors shards of 256 MB) unless --checkpoint names one,
then loads the eager model in a fresh child process per row (`build_model`, the step of a stage
build that reads the weights) and reports the child's peak RSS (os.wait4's ru_maxrss, via
tools/stage_memory.py):

    whole          the unsplit model: every tensor
    whole, split   ranks N the way builds did before: the whole stage loaded, then split_model
    rank slice     ranks N now: split on the meta device, each kept part read alone

`held MB` is what the loaded model holds (the rank's weights); `baseline` is a child that imports
torch and k3export and builds the meta model, so peak - baseline is what loading costs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from stage_memory import peak_rss

# In a child too: a child started by this process would count this process's peak in its own
# (os.wait4's ru_maxrss carries the parent's over the fork and exec).
WRITE = """
import sys, torch
from k3export.config import K3Config
from k3export.model import K3ForCausalLM
from k3export.weights.checkpoint import save_checkpoint
model = K3ForCausalLM(K3Config.from_preset(sys.argv[2]), torch.float32)
model.init_weights(0)
save_checkpoint(model, sys.argv[1], 256 << 20)
"""
LOAD = """
import sys, torch
from k3export.config import K3Config
from k3export.model import K3ForCausalLM
from k3export.model.parallel import split_model
from k3export.weights.checkpoint import build_model
checkpoint, mode, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = K3Config.from_json(checkpoint + "/config.json")
weights = {"checkpoint": checkpoint}
if mode == "baseline":
    with torch.device("meta"):
        K3ForCausalLM(config)
    sys.exit()
if mode == "whole":
    model = split_model(build_model(config, torch.float32, weights), 0, ranks)
else:
    model = build_model(config, torch.float32, weights, rank=0, ranks=ranks)
print(sum(t.nbytes for t in [*model.parameters(), *model.buffers()]))
"""


def measure(checkpoint: Path, mode: str, ranks: int) -> tuple[int, int]:
    """(peak RSS, bytes the loaded model holds) of one child."""
    peak, _, out = peak_rss([sys.executable, "-c", LOAD, str(checkpoint), mode, str(ranks)])
    return peak, int(out or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="k3-small")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint folder (default: write one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or Path(tmp)
        if args.checkpoint is None:
            subprocess.run([sys.executable, "-c", WRITE, str(checkpoint), args.preset], check=True)
        baseline, _ = measure(checkpoint, "baseline", 1)
        print(f"{checkpoint} (float32): peak RSS of loading rank 0, each row in its own process; "
              f"baseline (imports and the meta model) {baseline / 1e6:.0f} MB; MB = 1e6 bytes")
        print("ranks  load           held MB  peak MB  peak - baseline MB")
        rows = [(1, "whole")] + [(n, mode) for n in args.ranks for mode in ("whole", "slice")]
        for ranks, mode in rows:
            peak, held = measure(checkpoint, mode, ranks)
            label = {"whole": "whole" if ranks == 1 else "whole, split", "slice": "rank slice"}[mode]
            print(f"{ranks:>5}  {label:<13}  {held / 1e6:>7.0f}  {peak / 1e6:>7.0f}  "
                  f"{(peak - baseline) / 1e6:>18.0f}", flush=True)


if __name__ == "__main__":
    main()
