"""Export: the model as one ONNX graph. The k3 custom ops lower to one `k3` node per call plus a
model-local function with its decomposition in standard ops, so ONNX Runtime runs the file and
TensorRT can swap in plugins.

    export.py      the graph's signature and `export_model` (export.json, weights beside the graph)
    ops.py         the translation table (custom op -> k3 node) and the exporter call
    functions.py   the KDA and LatentMLA function bodies; moe.py the routed experts' (and MXFP4)
    domain.py      the k3 domain's name, version and plugin attributes
    taps.py        per-layer taps: their names and the eager hooks that record them
    runner.py      an export run: its Signature, the StatefulRunner base of every runner, and ONNX
                   Runtime through IO binding (used by check and the sharded runtime)
"""

