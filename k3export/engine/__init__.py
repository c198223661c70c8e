"""TensorRT(-RTX) engines from an export folder: the k3 plugins, optimization profiles, builds."""
