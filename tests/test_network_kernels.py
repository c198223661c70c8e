"""check --network --kernels: the parsed network's plugin layers launch the Triton kernels under the
interpreter, in a fresh process (TRITON_INTERPRET must be set before triton is imported)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from k3export.cli import main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                                reason="check --network needs TensorRT-RTX (the engine extra)")


def test_kernels_run_in_every_plugin_layer_and_match_eager(tiny_export, tiny_config):
    command = [sys.executable, "-m", "k3export.cli", "check", "--network", str(tiny_export), "--kernels",
               "--steps", "1", "--prompt-len", "4", "--json", "--quiet"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    # One launch per plugin layer per call: every layer's mixer's two (KDA's prepare and recurrence, MLA's
    # splits and their combine), every MoE layer's experts; prefill + 1 step.
    # (A 4-token prompt: the interpreter's time grows with the tokens, 47 s of CPU at 12, 34 s at 4.)
    layers = tiny_config.num_hidden_layers
    moe = sum(not tiny_config.is_dense(i) for i in range(layers))
    assert report["network"]["plugins"] == "triton kernels"
    assert report["network"]["kernel_launches"] == 2 * (2 * layers + 3 * moe)  # group, gate/up, down
    assert report["passed"] and all(c["rel"] < 1e-4 for s in report["steps"] for c in s["outputs"])


def test_kernels_need_the_network(tiny_export, capsys):
    assert main(["check", "--onnx", str(tiny_export), "--kernels"]) == 2
    assert "--kernels: expected --network DIR" in capsys.readouterr().err
