"""The k3 ONNX domain: its name and version, and the attributes every k3 node and function declare.
A module of its own so that the function bodies (functions.py, moe.py) and the translations
(ops.py) share them without importing each other."""

DOMAIN = "k3"
DOMAIN_VERSION = 1
PLUGIN_ATTRIBUTES = ("plugin_namespace", "plugin_version")
# Optional INT on a k3 node: 1 asks full TensorRT's ONNX parser for a `tensorrt.plugin` plugin's AOT form
# (k3plugins.trt_aot), 0 for its JIT form; IPluginV3 creators (TensorRT-RTX) do not declare it.
AOT_ATTRIBUTE = "aot"
# The ops whose second input is each token's chosen experts ([tokens, k] int64), one node a MoE layer.
ROUTED_OPS = ("RoutedExperts", "RoutedExpertsMXFP4")
