"""What a tensor/expert-parallel split (k3export/model/parallel.py) puts on each GPU of a pipeline stage.

    k3export plan --preset kimi-k3 --stages 2 --ranks 8 --packed-experts

Every rank of a stage holds the same bytes (the splits are even): the split weights (1/N of the heads,
experts and MLP widths) and the replicated ones (router, latent projections and norms, MLA's q_a and
kv_a, KDA's f_a, AttnRes, and on the first and last stage the embedding and LM head). Its cache: its
KDA heads' state and conv tails, and the whole MLA latent cache (one key head, the same on every
rank). Its collectives: two all-reduces per layer (k3export.model.parallel.collectives), each taking
2 (N - 1) / N x bytes / bandwidth on a ring, per token (latency per call not counted).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from k3export.config import K3Config
from k3export.model import K3ForCausalLM
from k3export.model.accounting import H200_BYTES, MXFP4_BITS, component
from k3export.model.parallel import collectives, rank_config, split_model
from k3export.shards.plan import Plan, layer_cache_bytes

# NVLink 4 on H100 / H200: 450 GB/s in each direction per GPU, what a ring all-reduce moves data at.
COLLECTIVE_GB_PER_S = 450.0
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class RankStage:
    """One rank of a stage (all ranks of a stage hold the same amounts)."""

    index: int
    layers: range
    ranks: int
    split_weight_bytes: int  # this rank's share of the split weights
    replicated_weight_bytes: int  # held whole by every rank
    cache_bytes_per_sequence: int  # its KDA heads, the whole MLA latent cache
    cache_bytes: int  # x the plan's batch
    activation_bytes: int  # the unsplit stage's estimate (an upper bound for a rank)
    collective_bytes_per_token: list[int]  # per all-reduce, in layer order
    collective_seconds_per_token: float

    @property
    def weight_bytes(self) -> int:
        return self.split_weight_bytes + self.replicated_weight_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.activation_bytes

    @property
    def fits_h200(self) -> bool:
        return self.total_bytes <= H200_BYTES


def _weight_bytes(name: str, param: torch.Tensor, config: K3Config, packed_experts: bool) -> int:
    if packed_experts and component(name, config) == "routed_experts":
        return round(param.numel() * MXFP4_BITS / 8)
    return param.numel() * param.element_size()


def split_loads(config: K3Config, dtype: torch.dtype, ranks: int,
                packed_experts: bool = False) -> tuple[list[int], list[int]]:
    """Per layer (the embedding counted to layer 0, the output mix, final norm and LM head to the
    last): one rank's bytes of split weights and of replicated ones. The split model is built on the
    meta device and compared with the unsplit one parameter by parameter."""
    with torch.device("meta"):
        whole = dict(K3ForCausalLM(config, dtype).named_parameters())
        split = split_model(K3ForCausalLM(config, dtype), 0, ranks)
    layers = config.num_hidden_layers
    split_bytes, replicated_bytes = [0] * layers, [0] * layers
    for name, param in split.named_parameters():
        match = _LAYER.match(name)
        layer = int(match[1]) if match else 0 if name.startswith("model.embed_tokens.") else layers - 1
        held = split_bytes if param.numel() < whole[name].numel() else replicated_bytes
        held[layer] += _weight_bytes(name, param, config, packed_experts)
    return split_bytes, replicated_bytes


def rank_stages(plan: Plan, ranks: int, collective_gb_per_s: float = COLLECTIVE_GB_PER_S) -> list[RankStage]:
    """The plan's stages, each split over `ranks` GPUs."""
    dtype = getattr(torch, plan.dtype)
    elem = torch.empty(0, dtype=dtype).element_size()
    split_bytes, replicated_bytes = split_loads(plan.config, dtype, ranks, plan.packed_experts)
    local = rank_config(plan.config, ranks)
    ring = 2 * (ranks - 1) / ranks
    result = []
    for stage in plan.stages:
        layers = stage.layers
        sums = [c.bytes_per_token(dtype) for c in collectives(plan.config, layers)] if ranks > 1 else []
        per_sequence = sum(layer_cache_bytes(local, i, plan.context, elem) for i in layers)
        result.append(RankStage(
            index=stage.index, layers=layers, ranks=ranks,
            split_weight_bytes=sum(split_bytes[i] for i in layers),
            replicated_weight_bytes=sum(replicated_bytes[i] for i in layers),
            cache_bytes_per_sequence=per_sequence, cache_bytes=per_sequence * plan.batch,
            activation_bytes=stage.activation_bytes, collective_bytes_per_token=sums,
            collective_seconds_per_token=ring * sum(sums) / (collective_gb_per_s * 1e9)))
    return result


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def format_rank_plan(stages: list[RankStage], collective_gb_per_s: float) -> str:
    ranks = stages[0].ranks
    lines = [
        f"each stage split over {ranks} GPUs (tensor-parallel heads, expert-parallel experts; per GPU of "
        f"a stage, all alike); collectives at {collective_gb_per_s:g} GB/s (ring all-reduce)",
        "stage  layers  split weights  replicated  cache/seq  all-reduces     B/tok  us/tok"
        "    weights + cache + activations =  total  fits",
    ]
    for s in stages:
        lines.append(
            f"{s.index:>5}  {s.layers.start:>2}-{s.layers.stop - 1:<3}  {_gb(s.split_weight_bytes):>13}  "
            f"{_gb(s.replicated_weight_bytes):>10}  {_gb(s.cache_bytes_per_sequence):>9}  "
            f"{len(s.collective_bytes_per_token):>11}  {sum(s.collective_bytes_per_token):>8}  "
            f"{s.collective_seconds_per_token * 1e6:>6.2f}  {_gb(s.weight_bytes):>10} + "
            f"{_gb(s.cache_bytes):>5} + {_gb(s.activation_bytes):>11} = {_gb(s.total_bytes):>6}  "
            f"{'yes' if s.fits_h200 else 'NO'}")
    lines += [
        "per layer two all-reduces: attention (hidden values, model dtype) and FFN (a MoE layer's "
        "[u | shared] in float32, latent + hidden values; the dense layer's output in the model dtype)",
        "the MLA latent cache is the same on every rank (one key head); KDA state and conv tails are "
        "split by heads; activations are the unsplit stage's estimate (an upper bound)",
    ]
    return "\n".join(lines)


def rank_plan_json(stages: list[RankStage], collective_gb_per_s: float) -> dict:
    return {"ranks": stages[0].ranks, "collective_gb_per_s": collective_gb_per_s, "stages": [{
        "layers": [s.layers.start, s.layers.stop], "split_weight_bytes": s.split_weight_bytes,
        "replicated_weight_bytes": s.replicated_weight_bytes, "weight_bytes": s.weight_bytes,
        "cache_bytes_per_sequence": s.cache_bytes_per_sequence, "cache_bytes": s.cache_bytes,
        "activation_bytes": s.activation_bytes, "total_bytes": s.total_bytes, "fits_h200": s.fits_h200,
        "collective_bytes_per_token": s.collective_bytes_per_token,
        "collective_seconds_per_token": s.collective_seconds_per_token} for s in stages]}
