"""`k3export check --build DIR`: a sharded build against the eager model, stage by stage.

Every stage runs twice: its ONNX Runtime session in the sharded chain (each stage fed the stage
before's outputs, as `k3export run` does), and the eager model over the same layer range, built
from the same weights record, in a chain of its own. Both are driven with the same requests: a
prefill of prompts of different lengths, then greedy decode steps taking the eager chain's token.
At every stage boundary the stage's outputs (the AttnRes bank and partial block, or the logits, and
its caches: valid entries only) are compared; the first stage past the dtype's bound is named, so
a bad stage is found where it goes wrong, not where its error ends up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3export.checkpoint import build_model
from k3export.config import K3Config
from k3export.errors import UserError
from k3export.onnx.check import EagerRunner, last_tokens, valid_entries
from k3export.onnx.export import ExportGraph
from k3export.parity import TOLERANCES, compare, top1_agreement
from k3export.runtime import Pipeline, random_prompts, stage_exports


def run_build_check(build_dir: str | Path, steps: int = 16, seed: int = 0, batch: int = 2,
                    prompt_len: int = 70, log: Any = print) -> dict[str, Any]:
    """The report: per step and stage, each output's comparison; "first_divergent_stage" (None if
    every stage is within the bound) and "passed"."""
    exports = stage_exports(build_dir)
    pipeline = Pipeline(exports)
    config = K3Config.from_json(exports[0] / "config.json")
    dtype = pipeline.stages[0].dtype
    if dtype not in ("float32", "float16"):
        raise UserError(f"{build_dir}: a {dtype} build cannot be fed through numpy; check a float32 build")
    tolerance = TOLERANCES[dtype]
    eager = []
    for stage, folder in zip(pipeline.stages, exports, strict=True):
        weights = json.loads((folder / "export.json").read_text())["weights"]
        model = build_model(config, getattr(torch, dtype), weights, stage.layers)
        runner = EagerRunner(ExportGraph(model, stage.layers), f"eager {stage.runner.name}", stage.signature)
        runner.activate()
        eager.append(runner)
    prompts = random_prompts(batch, prompt_len, config.vocab_size, seed)
    lengths = np.array([len(p) for p in prompts], np.int64)
    ids = np.zeros((batch, int(lengths.max())), np.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    request = {"input_ids": ids, "cache_lengths": np.zeros(batch, np.int64), "input_lengths": lengths}
    pipeline.reset(batch)
    for runner in eager:
        runner.reset(batch)
    report: dict[str, Any] = {"dtype": dtype, "tolerance": tolerance.rel, "prompt_lengths": lengths.tolist(),
                              "stages": [[s.layers.start, s.layers.stop] for s in pipeline.stages],
                              "steps": []}
    first = None
    try:
        for step in range(steps + 1):
            after = request["cache_lengths"] + request["input_lengths"]
            entry: dict[str, Any] = {"step": "prefill" if step == 0 else f"decode {step}", "stages": []}
            ours: dict[str, np.ndarray] = {}
            ref: dict[str, np.ndarray] = {}
            for i, (stage, runner) in enumerate(zip(pipeline.stages, eager, strict=True)):
                # Each chain feeds its own outputs on; compared before the next call reuses the buffers.
                ours = stage(stage.feeds(request, ours))
                ref = runner.infer(stage.feeds(request, ref), check_inputs=False)
                valid = [{s.name: valid_entries(s, np.asarray(out[s.name]), after, request["input_lengths"])
                          for s in stage.signature.outputs} for out in (ours, ref)]
                comparisons = [compare(name, valid[0][name], ref_value, tolerance)
                               for name, ref_value in valid[1].items()]
                worst = max(comparisons, key=lambda c: c.rel)
                passed = all(c.passed for c in comparisons)
                if not passed and first is None:
                    first = i
                entry["stages"].append({"stage": i, "passed": passed, "worst": worst.name, "rel": worst.rel,
                                        "outputs": [c.as_dict() for c in comparisons]})
            entry["tokens"] = top1_agreement(ours["logits"], ref["logits"], tolerance.margin).as_dict()
            log(f"{entry['step']:>10}: " + ", ".join(f"stage {s['stage']} rel {s['rel']:.1e} ({s['worst']})"
                                                    for s in entry["stages"]))
            report["steps"].append(entry)
            tokens = last_tokens(ref["logits"], request["input_lengths"].tolist())
            request = {"input_ids": tokens.astype(np.int64), "cache_lengths": after,
                       "input_lengths": np.ones(batch, np.int64)}
    finally:
        pipeline.close()
        for runner in eager:
            runner.deactivate()
    report["first_divergent_stage"] = first
    report["passed"] = first is None
    return report


def cmd_check_build(args: Any) -> int:
    """`k3export check --build DIR`: exit 0 when every stage is within the bound, 1 naming the first
    stage that is not."""
    report = run_build_check(args.build, steps=args.steps, seed=args.seed, batch=args.batch,
                             prompt_len=args.prompt_len, log=(lambda _: None) if args.json else print)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["passed"] else 1
    first = report["first_divergent_stage"]
    if first is None:
        print(f"PASSED: every stage within relative error {report['tolerance']} of the eager model "
              f"({report['dtype']}, prefill and {len(report['steps']) - 1} decode steps)")
        return 0
    start, stop = report["stages"][first]
    step = next(s for s in report["steps"] if not s["stages"][first]["passed"])
    worst = step["stages"][first]
    print(f"FAILED: stage {first} (layers {start}..{stop - 1}) diverges first, at {step['step']}: "
          f"{worst['worst']} relative error {worst['rel']:.2e} > {report['tolerance']}")
    return 1
