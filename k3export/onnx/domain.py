"""The k3 ONNX domain: its name and version, and the attributes every k3 node and function declare.
A module of its own so that the function bodies (functions.py, moe.py) and the translations
(ops.py) share them without importing each other."""

DOMAIN = "k3"
DOMAIN_VERSION = 1
PLUGIN_ATTRIBUTES = ("plugin_namespace", "plugin_version")
# Optional INT on a k3 node: 1 asks full TensorRT's ONNX parser for a `tensorrt.plugin` plugin's AOT form
# (k3plugins.trt_aot), 0 for its JIT form; IPluginV3 creators (TensorRT-RTX) do not declare it.
AOT_ATTRIBUTE = "aot"
# The ops that read each token's chosen experts ([tokens, k] int64), one node a MoE layer, and that input's
# index: the grouping node of exports since 2026-12, the one-node routed experts of earlier ones.
ROUTED_OPS = {"RoutedExpertsGroup": 0, "RoutedExperts": 1, "RoutedExpertsMXFP4": 1}
