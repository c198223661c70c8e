"""One runner per artifact, each a k3export.onnx.runner.StatefulRunner that check's driver feeds:
eager.py (the PyTorch model, the reference), network.py (`--network`: the parsed TensorRT network on
CPU), engine.py (`--engine`: a TensorRT engine), chain.py (`--build`: a sharded build's stages in
order), grid.py (`--build` of a build split over ranks: one worker process a rank). ONNX Runtime's
(`--onnx`) is k3export.onnx.runner.BoundOnnxrtRunner, shared with the runtime."""
