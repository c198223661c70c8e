"""k3export: the Kimi K3 model from eager PyTorch to ONNX and TensorRT-RTX engines, each artifact
checked against the eager model.

The packages, in pipeline order (model -> export -> engine -> shards -> check):

    ops/        the custom ops the model calls (torch.ops.k3.*: KDA, latent MLA, routed experts),
                their reference math, and the MXFP4 format of packed experts
    model/      the eager reference model, one module per layer type; parameter accounting
    weights/    safetensors checkpoints in and out (ours and the published layout)
    onnx/       export: the translation to k3 custom nodes, their ONNX function bodies, taps, and
                the export as something that runs (runner.py: signature, runner base, ONNX Runtime)
    engine/     TensorRT-RTX: parse and build engines, and the CPU evaluator of a parsed network
    shards/     recipes, the plan that cuts the model into stages, and the stage build
    runtime/    a sharded build run stage after stage (`k3export run`), or a process a stage and rank
                under `torchrun -m k3export.runtime` (segments.py: a rank's graph between its sums)
    check/      an artifact against the eager model: the driver, the comparison, one runner each
    cli.py      the command line (__main__.py: `python -m k3export`); demo.py its `demo`
    config.py, artifacts.py, options.py, progress.py, errors.py   the model config, files written
                whole with their manifests, the command-line option types (ranges, paths, requests
                that fit), progress bars, the error a user gets
    exits.py    how every process that has used gloo ends (os._exit, never the interpreter's teardown)

Layers: a module imports from its own package and from the floors below its own, never from a
floor above nor from another package on its floor (tests/test_layers.py reads this table, and also
refuses any import cycle between modules):

    floor 11   __main__
    floor 10   cli
    floor  9   check demo
    floor  8   shards runtime
    floor  7   engine
    floor  6   onnx
    floor  5   weights
    floor  4   model
    floor  3   ops
    floor  2   config options
    floor  1   artifacts
    floor  0   errors exits progress

plugins/k3plugins (the Triton kernels and their TensorRT adapters) is a package of its own that
imports nothing from k3export, so a serving process can load it alone.
"""
