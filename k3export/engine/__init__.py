"""TensorRT(-RTX) engines from an export folder (the k3 plugins, optimization profiles, builds), and
the CPU evaluator of the network the builder receives (network.py)."""
