"""One rank of tests/test_parallel_export.py's grid run: the TensorRT-RTX network parsed from the
rank's export (RANKS_DIR/rank-{r}), evaluated on CPU (k3export.engine.network, its DIST_COLLECTIVE
layers summed by torch.distributed), run greedily from a ragged prompt, written to OUT/rank-{r}.npz:
the tokens and each call's logits at the rows' last valid positions.

    python -m torch.distributed.run --nproc-per-node N tests/parallel_grid_worker.py RANKS_DIR OUT NEW_TOKENS
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from k3export.engine.network import NetworkEvaluator, parse_network, to_numpy
from k3export.exits import run_to_end
from k3export.onnx.runner import PAST, PRESENT, Signature

PROMPT_LENGTHS = [6, 4]


def prompts(vocab: int) -> np.ndarray:
    return np.random.default_rng(3).integers(0, vocab, (len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)))


def network(folder: Path) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    evaluator = NetworkEvaluator(parse_network(folder / "model.onnx"))
    return lambda feed: {name: to_numpy(value) for name, value in evaluator.evaluate(feed).items()}


def main(ranks_dir: str, out: str, new_tokens: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = Path(ranks_dir) / f"rank-{rank}"
    manifest = json.loads((folder / "export.json").read_text())
    signature = Signature(manifest)
    graph = network(folder)
    ids = prompts(json.loads((folder / "config.json").read_text())["vocab_size"])
    lengths = np.array(PROMPT_LENGTHS)
    cache_lengths = np.zeros(len(lengths), dtype=np.int64)
    caches = signature.empty_caches(len(lengths))
    tokens, logits = [], []
    for _ in range(int(new_tokens)):
        feed = {"input_ids": ids, "cache_lengths": cache_lengths, "input_lengths": lengths, **caches}
        results = graph(feed)
        last = results["logits"][np.arange(len(lengths)), lengths - 1]
        logits.append(last)
        tokens.append(last.argmax(-1))
        caches = {PAST + name.removeprefix(PRESENT): value for name, value in results.items()
                  if name.startswith(PRESENT)}
        cache_lengths = cache_lengths + lengths
        ids, lengths = tokens[-1][:, None], np.ones(len(lengths), dtype=np.int64)
    np.savez(Path(out) / f"rank-{rank}.npz", tokens=np.stack(tokens, 1), logits=np.stack(logits))


if __name__ == "__main__":
    run_to_end(lambda: main(*sys.argv[1:]))  # destroys the process group
