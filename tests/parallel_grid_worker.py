"""One rank of tests/test_parallel_export.py's grid run: the rank's ONNX export (RANKS_DIR/rank-{r}) in
ONNX Runtime pieces with torch.distributed sums between them (k3export.runtime.segments), greedy from
a ragged prompt, written to OUT/rank-{r}.npz: the tokens and each call's logits at the rows' last
valid positions.

    python -m torch.distributed.run --nproc-per-node N tests/parallel_grid_worker.py RANKS_DIR OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from k3export.onnx.check import PAST, PRESENT, Signature
from k3export.runtime.segments import SegmentedGraph

PROMPT_LENGTHS = [6, 4]
NEW_TOKENS = 6


def prompts(vocab: int) -> np.ndarray:
    return np.random.default_rng(3).integers(0, vocab, (len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)))


def main(ranks_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = Path(ranks_dir) / f"rank-{rank}"
    manifest = json.loads((folder / "export.json").read_text())
    signature = Signature(manifest)
    graph = SegmentedGraph(folder / "model.onnx", threads=1)
    ids = prompts(json.loads((folder / "config.json").read_text())["vocab_size"])
    lengths = np.array(PROMPT_LENGTHS)
    cache_lengths = np.zeros(len(lengths), dtype=np.int64)
    caches = signature.empty_caches(len(lengths))
    tokens, logits = [], []
    for _ in range(NEW_TOKENS):
        feed = {"input_ids": ids, "cache_lengths": cache_lengths, "input_lengths": lengths, **caches}
        results = graph(feed)
        last = results["logits"][np.arange(len(lengths)), lengths - 1]
        logits.append(last)
        tokens.append(last.argmax(-1))
        caches = {PAST + name.removeprefix(PRESENT): value for name, value in results.items()
                  if name.startswith(PRESENT)}
        cache_lengths = cache_lengths + lengths
        ids, lengths = tokens[-1][:, None], np.ones(len(lengths), dtype=np.int64)
    np.savez(Path(out) / f"rank-{rank}.npz", tokens=np.stack(tokens, 1), logits=np.stack(logits),
             pieces=len(graph.pieces), compute_seconds=graph.compute_seconds,
             collective_seconds=graph.collective_seconds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
