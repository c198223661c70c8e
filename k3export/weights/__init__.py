"""Weights in and out: safetensors checkpoints (ours and the published layout)."""
