"""The eager reference model: plain PyTorch, the source of truth for every artifact."""

from k3export.model.cache import K3Cache, KDACache, MLACache, empty_cache
from k3export.model.k3 import K3ForCausalLM

__all__ = ["K3Cache", "K3ForCausalLM", "KDACache", "MLACache", "empty_cache"]
