"""`k3export check --onnx DIR`: the exported graph in ONNX Runtime against the eager model.

Both sides run through Polygraphy runners (ONNX Runtime's, and `EagerRunner` for the PyTorch
model): a prefill from an empty cache, then greedy decode steps in which each side feeds back its
own caches and both take the reference's token, so that a near-tie cannot derail the comparison.
The prefill's inputs and the eager outputs are saved in Polygraphy's format, so that

    polygraphy run DIR/model.onnx --onnxrt --load-inputs DIR/check/inputs.json \\
        --load-outputs DIR/check/golden.json --atol A --rtol R

repeats the prefill comparison from the command line (the report prints the exact command).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.backend.onnxrt import OnnxrtRunner
from polygraphy.common import TensorMetadata
from polygraphy.comparator import Comparator, RunResults
from polygraphy.json import save_json
from polygraphy.logger import G_LOGGER

from k3export.checkpoint import build_model
from k3export.config import K3Config
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE, ExportGraph, TensorSpec
from k3export.parity import TOLERANCES, compare, top1_agreement

# Elementwise tolerances for the `polygraphy run` replay: |a - b| <= atol + rtol |b|.
POLYGRAPHY_TOLERANCES = {"float32": (1e-3, 1e-3), "float16": (0.1, 0.05), "bfloat16": (0.5, 0.1)}


class EagerRunner(BaseRunner):
    """Polygraphy's runner for the eager model, called with the graph's named inputs."""

    def __init__(self, graph: ExportGraph, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> None:
        super().__init__(name="eager")
        self.graph, self.inputs, self.outputs = graph, inputs, outputs

    def get_input_metadata_impl(self) -> TensorMetadata:
        meta = TensorMetadata()
        for spec in self.inputs:
            meta.add(spec.name, getattr(torch, spec.dtype),
                     [None if isinstance(d, str) else d for d in spec.shape])
        return meta

    def infer_impl(self, feed_dict: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        start = time.perf_counter()
        with torch.no_grad():
            outputs = self.graph(*(torch.from_numpy(np.asarray(feed_dict[s.name])) for s in self.inputs))
        self.inference_time = time.perf_counter() - start
        return OrderedDict((s.name, o.numpy()) for s, o in zip(self.outputs, outputs, strict=True))


def onnxrt_session(path: Path, threads: int | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    # Spinning worker threads would slow the eager model running beside them in this process.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def read_export(onnx_dir: Path) -> tuple[dict[str, Any], K3Config]:
    manifest_path = onnx_dir / MANIFEST_FILE
    if not manifest_path.exists():
        raise FileNotFoundError(f"{manifest_path}: no such file (is {onnx_dir} a `k3export export` folder?)")
    return json.loads(manifest_path.read_text()), K3Config.from_json(onnx_dir / "config.json")


def _random_feed(specs: list[TensorSpec], sizes: dict[str, int], vocab: int,
                 gen: torch.Generator) -> dict[str, np.ndarray]:
    """Token ids, or AttnRes boundary tensors for a layer range; the caches start empty."""
    feed = {}
    for spec in specs:
        shape = [sizes[d] if isinstance(d, str) else d for d in spec.shape]
        if spec.name == "input_ids":
            feed[spec.name] = torch.randint(0, vocab, shape, generator=gen).numpy()
        elif spec.name.startswith("attn_res."):
            feed[spec.name] = torch.randn(shape, generator=gen).to(getattr(torch, spec.dtype)).numpy()
        else:
            feed[spec.name] = np.zeros(shape, dtype=torch.empty(0, dtype=getattr(torch, spec.dtype)).numpy().dtype)
    return feed


def run_check(onnx_dir: str | Path, steps: int = 16, seed: int = 0, batch: int = 2,
              prompt_len: int = 70, log: Any = print) -> dict[str, Any]:
    """Prefill of `prompt_len` tokens and `steps` decode steps; returns the report (see "passed")."""
    onnx_dir = Path(onnx_dir)
    G_LOGGER.module_severity = G_LOGGER.WARNING  # Polygraphy prints every tensor's metadata at INFO
    manifest, config = read_export(onnx_dir)
    dtype = manifest["dtype"]
    if dtype == "bfloat16":
        raise ValueError(f"{onnx_dir}: a bfloat16 export cannot be fed through numpy; "
                         "it is checked structurally (see the README)")
    tolerance = TOLERANCES[dtype]
    layers = range(*manifest["layers"])
    inputs = [TensorSpec(**s) for s in manifest["inputs"]]
    outputs = [TensorSpec(**s) for s in manifest["outputs"]]
    log(f"eager reference: {config.num_hidden_layers} layers, {dtype}, weights {manifest['weights']}")
    model = build_model(config, getattr(torch, dtype), manifest["weights"])
    eager = EagerRunner(ExportGraph(model, layers), inputs, outputs)
    onnxrt = OnnxrtRunner(onnxrt_session(onnx_dir / GRAPH_FILE), name="onnxrt")
    gen = torch.Generator().manual_seed(seed)
    feed = _random_feed(inputs, {"batch": batch, "seq": prompt_len, "past": 0}, config.vocab_size, gen)

    check_dir = onnx_dir / "check"
    check_dir.mkdir(exist_ok=True)
    results = Comparator.run([eager, onnxrt], data_loader=[feed],
                             save_inputs_path=str(check_dir / "inputs.json"))
    golden = RunResults()
    golden.append((eager.name, results[eager.name]))
    golden.save(str(check_dir / "golden.json"))

    report: dict[str, Any] = {"dtype": dtype, "tolerance": tolerance.__dict__, "steps": []}
    ref_out, ort_out = results[eager.name][0], results[onnxrt.name][0]
    report["steps"].append(_compare_step("prefill", ref_out, ort_out, tolerance, log))
    has_logits = "logits" in ref_out
    ref_tokens, ort_tokens = [], []
    with eager, onnxrt:
        for step in range(steps):
            feeds = []
            for out in (ref_out, ort_out):
                step_feed = _random_feed(inputs, {"batch": batch, "seq": 1, "past": 0}, config.vocab_size, gen)
                if has_logits:
                    step_feed["input_ids"] = ref_out["logits"][:, -1:].argmax(-1)
                for spec in inputs:
                    if spec.name.startswith("past."):
                        step_feed[spec.name] = out[spec.name.replace("past.", "present.", 1)]
                feeds.append(step_feed)
            if has_logits:
                ref_tokens.append(ref_out["logits"][:, -1].argmax(-1).tolist())
                ort_tokens.append(ort_out["logits"][:, -1].argmax(-1).tolist())
            # The boundary inputs of a range are drawn once per step and shared by both sides.
            feeds[1].update({k: v for k, v in feeds[0].items() if k.startswith("attn_res.")})
            ref_out, ort_out = eager.infer(feeds[0]), onnxrt.infer(feeds[1])
            report["steps"].append(_compare_step(f"decode {step + 1}", ref_out, ort_out, tolerance, log))
    failed = sorted({c["name"] for s in report["steps"] for c in s["outputs"] if not c["passed"]})
    mismatched = sum(s.get("tokens", {}).get("mismatches", 0) for s in report["steps"])
    report["failed_outputs"] = failed
    report["token_mismatches"] = mismatched
    report["greedy_streams_identical"] = ref_tokens == ort_tokens
    report["passed"] = not failed and mismatched == 0
    atol, rtol = POLYGRAPHY_TOLERANCES[dtype]
    report["polygraphy_command"] = (
        f"polygraphy run {onnx_dir / GRAPH_FILE} --onnxrt --load-inputs {check_dir / 'inputs.json'} "
        f"--load-outputs {check_dir / 'golden.json'} --atol {atol} --rtol {rtol}")
    save_json(report, str(check_dir / "report.json"), description="check report")
    return report


def _compare_step(label: str, reference: dict[str, np.ndarray], actual: dict[str, np.ndarray],
                  tolerance: Any, log: Any) -> dict[str, Any]:
    comparisons = [compare(name, actual[name], ref, tolerance) for name, ref in reference.items()]
    step: dict[str, Any] = {"step": label, "outputs": [c.as_dict() for c in comparisons]}
    worst = max(comparisons, key=lambda c: c.rel)
    line = f"{label:>10}: worst {worst.name} rel {worst.rel:.2e} max_abs {worst.max_abs:.2e}"
    if "logits" in reference:
        logits = next(c for c in comparisons if c.name == "logits")
        tokens = top1_agreement(actual["logits"], reference["logits"], tolerance.margin)
        step["tokens"] = tokens.as_dict()
        line += (f"; logits rel {logits.rel:.2e} cos {logits.cosine:.6f}; top-1 {tokens.agree}/"
                 f"{tokens.positions} (ties {tokens.ties}, mismatches {tokens.mismatches})")
    failed = [c.name for c in comparisons if not c.passed]
    log(line + (f"  FAILED: {', '.join(failed)}" if failed else ""))
    return step
