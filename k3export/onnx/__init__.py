"""ONNX lowering of the k3 custom ops: one `k3` node per call plus a model-local function with
its decomposition in standard ops, so ONNX Runtime runs the file and TensorRT can swap in plugins."""

from k3export.onnx.functions import attach_functions, k3_functions, kda_function, latent_mla_function
from k3export.onnx.ops import TRANSLATION_TABLE, attach_functions_ir, export_onnx

__all__ = [
    "TRANSLATION_TABLE",
    "attach_functions",
    "attach_functions_ir",
    "export_onnx",
    "k3_functions",
    "kda_function",
    "latent_mla_function",
]
