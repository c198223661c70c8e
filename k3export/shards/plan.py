"""The shard planner: contiguous layer ranges (pipeline stages) balanced by weight bytes.

    k3export plan engines/kimi-k3-16x1.toml
    k3export plan --preset kimi-k3 --stages 16 --packed-experts [--json]
    k3export plan engines/kimi-k3.toml          # 2 stages x 8 ranks: per GPU ([parallel] ranks)

A plan is a function of the model's configuration: the model is built on the meta device (no
weights allocated) and each layer's parameters are counted, the embedding with layer 0 and the
output mix, final norm and LM head with the last layer. The ranges minimise the heaviest stage's
weight bytes over all contiguous partitions (dynamic programming, exact), and among those maximise
the lightest. Bound: heaviest <= mean + the heaviest layer. (Greedy filling, each stage closed as
soon as it reaches the mean, gives every stage but the last at least the mean, so the last at most
the mean, and each at most mean + one layer; the optimum is no heavier.)

Per stage the plan states weights, the decode cache, the AttnRes boundary tensors it receives and
sends (bank rows and partial block, per token), their transfer time at a stated link bandwidth, and
whether weights + cache + an activation estimate fit one H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from k3export.config import PRESETS, K3Config
from k3export.errors import UserError
from k3export.model import K3ForCausalLM
from k3export.model.accounting import H200_BYTES, MXFP4_BITS, component
from k3export.model.parallel import collectives, rank_config, split_model
from k3export.options import positive_int, positive_real, recipe_file

LINK_GB_PER_S = 50.0  # one 400 Gb/s InfiniBand NDR port per GPU, the usual link between hosts
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class Load:
    """What each layer (with the globals it carries) costs: parameters and bytes as stored."""

    params: list[int]
    weight_bytes: list[int]


def layer_loads(config: K3Config, dtype: torch.dtype, packed_experts: bool = False) -> Load:
    """Per layer: parameters and weight bytes (routed experts at MXFP4's 4.25 bits when packed,
    float32 parameters such as KDA's conv weights at 4 bytes); the embedding counts to layer 0,
    the output mix, final norm and LM head to the last layer."""
    with torch.device("meta"):
        model = K3ForCausalLM(config, dtype)
    L = config.num_hidden_layers
    load = Load([0] * L, [0] * L)
    for name, param in model.named_parameters():
        match = _LAYER.match(name)
        layer = int(match[1]) if match else 0 if name.startswith("model.embed_tokens.") else L - 1
        n = param.numel()
        load.params[layer] += n
        if packed_experts and component(name, config) == "routed_experts":
            load.weight_bytes[layer] += round(n * MXFP4_BITS / 8)
        else:
            load.weight_bytes[layer] += n * param.element_size()
    return load


def partition(weights: list[int], parts: int) -> list[range]:
    """Contiguous ranges of `weights` into `parts` non-empty parts minimising the largest sum,
    and among those maximising the smallest. Exact, O(parts x n^2)."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise UserError(f"{parts} stages for {n} layers: expected 1..{n} stages (a layer at least in each)")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def solve(better: Any, combine: Any, allowed: Any) -> list[range]:
        # best[j][i]: the best value for the first i items in j parts; cut[j][i]: where part j starts.
        best = [[None] * (n + 1) for _ in range(parts + 1)]
        cut = [[0] * (n + 1) for _ in range(parts + 1)]
        best[0][0] = 0
        for j in range(1, parts + 1):
            for i in range(j, n - parts + j + 1):
                for p in range(j - 1, i):
                    if best[j - 1][p] is None or not allowed(prefix[i] - prefix[p]):
                        continue
                    value = combine(best[j - 1][p], prefix[i] - prefix[p], j)
                    if best[j][i] is None or better(value, best[j][i]):
                        best[j][i], cut[j][i] = value, p
        bounds, i = [n], n
        for j in range(parts, 0, -1):
            i = cut[j][i]
            bounds.append(i)
        bounds.reverse()
        return [range(a, b) for a, b in itertools.pairwise(bounds)]

    heaviest = max(sum(weights[r.start:r.stop]) for r in
                   solve(lambda a, b: a < b, lambda acc, s, j: max(acc, s), lambda s: True))
    return solve(lambda a, b: a > b, lambda acc, s, j: s if j == 1 else min(acc, s),
                 lambda s: s <= heaviest)


# Peak host memory of one build process (the export, then the engine of the same weights), by kind of
# page at the peak, measured on TensorRT-RTX 1.7 builds (k3-tiny and k3-small float32 stages, a k3-small
# rank, a published-widths layer's rank; docs/benchmarks.md#stage-builds): anonymous memory, which
# must fit (the builder's copy that it serializes, about the engine's size, which for the wide layer
# was 1.42 x its weights; the chunk being written; the export's residue; Python, torch and
# TensorRT's own), and file pages (the libraries, and the parser's mapping of the weights file: clean
# pages the kernel drops when memory runs short, reading them again if touched again). The anonymous
# line bounds every build measured; the published-widths rank sets it. Full TensorRT's and
# weight-stripped builds are unmeasured.
BUILD_ANON_FIXED_BYTES, BUILD_ANON_PER_WEIGHT_BYTE = 0.66e9, 1.76
BUILD_FILE_FIXED_BYTES, BUILD_FILE_PER_WEIGHT_BYTE = 0.26e9, 1.0
HOST_BYTES = 2.0e12  # an 8 x H200 host (DGX H200): 2 TB
HOST_BUILD_SHARE = 0.8  # of a host's memory, for the builds it runs at once


class GpuMemory:
    """What one GPU holds: weights, caches, activations and, with a verify profile, the rollback's copy
    (the fields or properties of a subclass)."""

    weight_bytes: int
    cache_bytes: int
    activation_bytes: int
    rollback_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.activation_bytes + self.rollback_bytes

    @property
    def fits_h200(self) -> bool:
        return self.total_bytes <= H200_BYTES

    @property
    def build_anon_bytes(self) -> int:
        """Anonymous memory one process building these weights peaks at (BUILD_ANON_...)."""
        return round(BUILD_ANON_FIXED_BYTES + BUILD_ANON_PER_WEIGHT_BYTE * self.weight_bytes)

    @property
    def build_host_bytes(self) -> int:
        """Resident memory (anonymous and file pages) one process building these weights peaks at."""
        file_bytes = BUILD_FILE_FIXED_BYTES + BUILD_FILE_PER_WEIGHT_BYTE * self.weight_bytes
        return self.build_anon_bytes + round(file_bytes)

    def builds_at_once(self, host_bytes: float) -> int:
        """How many such builds fit at once in HOST_BUILD_SHARE of a host's memory, counting their
        anonymous memory (their file pages are reclaimable)."""
        return int(HOST_BUILD_SHARE * host_bytes // self.build_anon_bytes)


@dataclass
class Tensor:
    name: str
    dtype: str
    shape: list[int | str]
    bytes_per_token: int


@dataclass
class Stage(GpuMemory):
    index: int
    layers: range
    kda_layers: int
    mla_layers: int
    moe_layers: int
    params: int
    weight_bytes: int
    cache_bytes_per_sequence: int  # at the plan's context length
    receives: list[Tensor]
    sends: list[Tensor]
    seconds_per_token_sent: float  # at the plan's link bandwidth
    activation_bytes: int  # estimate at the largest prefill (the prefill profile's)
    cache_bytes: int  # capacity x batch
    decode_activation_bytes: int  # the same estimate at the decode profile's batch x 1 tokens
    verify_activation_bytes: int  # and at the verify profile's batch x seq tokens (0: none)
    # With a verify profile: the rollback's copy of the KDA states and conv tails (rollback_bytes) for
    # every sequence the cache holds (a verify may draft for all); 0 without one.
    rollback_bytes: int
    # check --build / --engine: the eager reference runs on the host's CPU, never beside the engine on
    # its GPU: the stage's weights, and for half precision its float32 model's too (MXFP4 experts stay
    # packed in both); streamed (check --eager streamed), one layer's at a time, the heaviest of its
    # own layers (with the float32 twin) and of the layers before it (check --stage: its input).
    check_host_bytes: int
    check_streamed_host_bytes: int

    @property
    def bytes_received_per_token(self) -> int:
        return sum(t.bytes_per_token for t in self.receives)

    @property
    def bytes_sent_per_token(self) -> int:
        return sum(t.bytes_per_token for t in self.sends)


@dataclass
class Plan:
    model: str
    config: K3Config
    dtype: str
    packed_experts: bool
    context: int  # tokens of cache per sequence (the recipe's capacity)
    batch: int  # sequences the cache holds
    prefill_tokens: int  # batch x seq of the largest prefill
    decode_tokens: int  # the decode profile's batch
    verify_tokens: int  # the verify profile's batch x seq (0: none)
    link_gb_per_s: float
    stages: list[Stage]
    heaviest_layer_bytes: int  # the granularity the balance bound allows

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "dtype": self.dtype, "packed_experts": self.packed_experts,
            "context": self.context, "batch": self.batch, "prefill_tokens": self.prefill_tokens,
            "link_gb_per_s": self.link_gb_per_s, "h200_bytes": H200_BYTES,
            "heaviest_layer_bytes": self.heaviest_layer_bytes,
            "stages": [{
                "layers": [s.layers.start, s.layers.stop], "kda_layers": s.kda_layers,
                "mla_layers": s.mla_layers, "moe_layers": s.moe_layers, "params": s.params,
                "weight_bytes": s.weight_bytes, "cache_bytes_per_sequence": s.cache_bytes_per_sequence,
                "receives": [dataclasses.asdict(t) for t in s.receives],
                "sends": [dataclasses.asdict(t) for t in s.sends],
                "bytes_received_per_token": s.bytes_received_per_token,
                "bytes_sent_per_token": s.bytes_sent_per_token,
                "seconds_per_token_sent": s.seconds_per_token_sent,
                "memory": {"weights": s.weight_bytes, "cache": s.cache_bytes,
                           "activations": s.activation_bytes, "rollback": s.rollback_bytes,
                           "total": s.total_bytes,
                           "fits_h200": s.fits_h200, "build_host": s.build_host_bytes,
                           "build_anon": s.build_anon_bytes,
                           "check_host": s.check_host_bytes,
                           "check_host_streamed": s.check_streamed_host_bytes,
                           "activations_by_profile": {"prefill": s.activation_bytes,
                                                      "decode": s.decode_activation_bytes,
                                                      "verify": s.verify_activation_bytes}},
            } for s in self.stages],
        }


def layer_cache_bytes(config: K3Config, layer: int, context: int, elem: int) -> int:
    """Decode cache of one layer for one sequence: MLA latent rows for `context` tokens, or the
    KDA state (float32) and the three conv tails."""
    lac = config.linear_attn_config
    if config.is_mla(layer):
        return context * config.latent_dim * elem
    channels = lac.num_heads * lac.head_dim
    state = lac.num_heads * lac.head_dim * lac.head_dim * 4  # float32 always
    return state + 3 * (lac.short_conv_kernel_size - 1) * channels * elem


def rollback_bytes(config: K3Config, layers: range, dtype: str) -> int:
    """What speculative decoding's rollback copies per sequence before a verify call: the KDA layers'
    caches (state and conv tails) of `layers`; the MLA latent rows past a cache length need no copy."""
    elem = getattr(torch, dtype).itemsize
    return sum(layer_cache_bytes(config, i, 0, elem) for i in layers if not config.is_mla(i))


def layer_working_bytes(config: K3Config, layer: int, elem: int) -> int:
    """Per token, the intermediates one layer holds at once in the served engine: the mixers as k3
    plugins (no attention matrix: MLA queries and latent outputs, KDA's q, k, v, g in float32), and
    the MoE as the grouped routed-experts plugin (issue 11): router scores, the top-k experts' gate,
    up and output rows and the shared expert's, in float32."""
    c, lac = config, config.linear_attn_config
    mixer = (c.num_attention_heads * (c.latent_dim + c.kv_lora_rank) * 4 if c.is_mla(layer)
             else 4 * lac.num_heads * lac.head_dim * 4)
    if c.is_dense(layer):
        ffn = 2 * c.intermediate_size * 4
    else:
        routed = c.num_experts_per_token * (2 * c.moe_intermediate_size + c.routed_expert_hidden_size)
        ffn = (c.num_experts + routed + 2 * c.shared_expert_size) * 4
    return max(mixer, ffn) + 4 * c.hidden_size * elem  # plus the layer's input, norm and mix outputs


def _tensors(specs: list[Any]) -> list[Tensor]:
    """Graph I/O specs -> per-token sizes (symbolic batch and seq dims count as 1)."""
    out = []
    for s in specs:
        per_token = torch.empty(0, dtype=getattr(torch, s.dtype)).element_size()
        for d in s.shape:
            per_token *= d if isinstance(d, int) else 1
        out.append(Tensor(s.name, s.dtype, list(s.shape), per_token))
    return out


def make_plan(config: K3Config, stages: int | list[range], *, model: str, dtype: str,
              packed_experts: bool = False, context: int = 131072, batch: int = 1,
              prefill_tokens: int = 1024, decode_tokens: int = 1, verify_tokens: int = 0,
              link_gb_per_s: float = LINK_GB_PER_S) -> Plan:
    """A plan over `config`: `stages` a count (balanced ranges) or the ranges themselves."""
    from k3export.onnx.export import graph_signature  # the graph's own names and shapes

    torch_dtype = getattr(torch, dtype)
    elem = torch.empty(0, dtype=torch_dtype).element_size()
    load = layer_loads(config, torch_dtype, packed_experts)
    reference = layer_loads(config, torch.float32, packed_experts).weight_bytes if elem < 4 else None
    ranges = partition(load.weight_bytes, stages) if isinstance(stages, int) else list(stages)
    checked = [w + (reference[i] if reference else 0) for i, w in enumerate(load.weight_bytes)]
    result = []
    for index, layers in enumerate(ranges):
        inputs, outputs = graph_signature(config, layers, torch_dtype)
        # What crosses a stage boundary per token: the tensors with a seq axis that are not caches
        # (each stage keeps its own); per-row inputs such as lengths are not per token.
        receives = _tensors([s for s in inputs if "seq" in s.shape and not s.name.startswith("past.")])
        sends = _tensors([s for s in outputs if "seq" in s.shape and not s.name.startswith("present.")])
        sent = sum(t.bytes_per_token for t in sends)
        in_out = sum(t.bytes_per_token for t in receives) + sent
        working = max(layer_working_bytes(config, i, elem) for i in layers)
        per_sequence = sum(layer_cache_bytes(config, i, context, elem) for i in layers)
        result.append(Stage(
            index=index, layers=layers,
            kda_layers=sum(not config.is_mla(i) for i in layers), mla_layers=sum(map(config.is_mla, layers)),
            moe_layers=sum(not config.is_dense(i) for i in layers),
            params=sum(load.params[i] for i in layers),
            weight_bytes=sum(load.weight_bytes[i] for i in layers),
            cache_bytes_per_sequence=per_sequence, receives=receives, sends=sends,
            seconds_per_token_sent=sent / (link_gb_per_s * 1e9),
            activation_bytes=prefill_tokens * (in_out + working), cache_bytes=per_sequence * batch,
            decode_activation_bytes=decode_tokens * (in_out + working),
            verify_activation_bytes=verify_tokens * (in_out + working),
            rollback_bytes=rollback_bytes(config, layers, dtype) * batch if verify_tokens else 0,
            check_host_bytes=sum(checked[i] for i in layers),
            check_streamed_host_bytes=max([checked[i] for i in layers] + load.weight_bytes[:layers.start])))
    return Plan(model, config, dtype, packed_experts, context, batch, prefill_tokens, decode_tokens,
                verify_tokens, link_gb_per_s, result, max(load.weight_bytes))


def plan_recipe(recipe: Any, link_gb_per_s: float | None = None) -> Plan:
    """The plan a recipe (k3export.shards.recipe.Recipe) builds: its stage ranges, or balanced ones;
    its links between stages at `link_gb_per_s`, else the recipe's [links], else LINK_GB_PER_S."""
    model = recipe.preset or str(recipe.config_path)
    return make_plan(recipe.config, list(recipe.stage_ranges) if recipe.stage_ranges else recipe.stage_count,
                     model=model, dtype=recipe.dtype, packed_experts=recipe.packed_experts,
                     context=recipe.capacity, batch=recipe.batch,
                     prefill_tokens=recipe.prefill_batch * recipe.prefill_seq,
                     decode_tokens=recipe.decode_batch, verify_tokens=recipe.decode_batch * recipe.verify_seq,
                     link_gb_per_s=link_gb_per_s or recipe.stages_gb_per_s or LINK_GB_PER_S)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


ROLLBACK_COLUMN = " + rollback"  # with a verify profile: the rollback's copy (GpuMemory.rollback_bytes)


def rollback_column(memory: GpuMemory) -> str:
    return f" + {_gb(memory.rollback_bytes):>8}"


def format_plan(plan: Plan, ranks: int = 1) -> str:
    """The plan's table of stages; `ranks` > 1: each is split over that many GPUs in a table after
    this one, so this one is labelled as the unsplit reference (its "fits" is one GPU's, whole)."""
    c = plan.config
    experts = "routed experts MXFP4 (4.25 bits)" if plan.packed_experts else f"all weights {plan.dtype}"
    total = sum(s.weight_bytes for s in plan.stages)
    lines = [
        f"{plan.model}: {c.num_hidden_layers} layers in {len(plan.stages)} stages, {plan.dtype}, {experts}; "
        f"weights {_gb(total)} GB in all, heaviest layer {_gb(plan.heaviest_layer_bytes)} GB",
        f"cache {plan.context} tokens x {plan.batch} sequences; activations at a prefill of "
        f"{plan.prefill_tokens} tokens; link {plan.link_gb_per_s:g} GB/s; one H200 {_gb(H200_BYTES)} GB",
        "",
        *([f"each stage unsplit, whole on one GPU (for reference: it is served split over {ranks} GPUs, the "
           "per-GPU table below, whose fits is the one that counts)"] if ranks > 1 else []),
        "stage  layers  KDA MLA MoE  params  weights  cache/seq  bank rows  in B/tok  out B/tok  out us/tok"
        f"    weights + cache + activations{ROLLBACK_COLUMN if plan.verify_tokens else ''} =  total  fits",
    ]
    for s in plan.stages:
        rows = [f"{t.shape[0]}" for t in s.receives if t.name.endswith(".bank")] or ["-"]
        lines.append(
            f"{s.index:>5}  {s.layers.start:>2}-{s.layers.stop - 1:<3}  {s.kda_layers:>3} {s.mla_layers:>3} "
            f"{s.moe_layers:>3}  {s.params / 1e9:>5.1f}B  {_gb(s.weight_bytes):>7}  "
            f"{_gb(s.cache_bytes_per_sequence):>9}  {rows[0]:>9}  {s.bytes_received_per_token:>8}  "
            f"{s.bytes_sent_per_token:>9}  {s.seconds_per_token_sent * 1e6:>10.3f}  "
            f"{_gb(s.weight_bytes):>10} + {_gb(s.cache_bytes):>5} + {_gb(s.activation_bytes):>11}"
            f"{rollback_column(s) if plan.verify_tokens else ''} = {_gb(s.total_bytes):>6}  "
            f"{'yes' if s.fits_h200 else 'no, unsplit' if ranks > 1 else 'NO'}")
    heavy = max(s.weight_bytes for s in plan.stages)
    light = min(s.weight_bytes for s in plan.stages)
    lines += [
        "", "GB = 1e9 bytes; ranges are 0-based, inclusive here (--json: [start, stop) with stop exclusive)",
        f"balance: heaviest / lightest stage = {heavy / light:.3f}; heaviest - mean = "
        f"{_gb(heavy - total / len(plan.stages))} GB <= the heaviest layer, "
        f"{_gb(plan.heaviest_layer_bytes)} GB",
        "speculative decoding (run --speculate K): the rollback keeps a copy of a stage's KDA states and "
        "conv tails from before each call that feeds a row drafts, that row's only (onnx.runner.Rollback; "
        "the MLA latents need none; a prefill or a plain decode copies nothing), per sequence "
        + ", ".join(f"stage {s.index} {_gb(rollback_bytes(c, s.layers, plan.dtype))} GB" for s in plan.stages)
        + f" (x {plan.batch} sequences, held beside the caches: "
        + ("in the total, the recipe has a verify profile" if plan.verify_tokens else
           "not in the total, the recipe has no verify profile")
        + "); a row that rejects a draft feeds its accepted tokens again in its next call, with new drafts "
        "(at most 3K + 1 tokens a call: the verify profile's seq)",
        "boundaries: a stage receives the AttnRes bank [rows, batch, seq, hidden] and partial block [batch, "
        "seq, hidden] (the first: token ids) and sends the next stage's (the last: logits)",
        "activations assume the served engine: the k3 mixer plugins and the grouped routed-experts plugin "
        "(only the chosen experts run)",
        "activations per engine profile (each profile's execution context holds its own; the table's are "
        "the prefill profile's): " + ", ".join(
            f"stage {s.index} prefill {_gb(s.activation_bytes)} GB, decode "
            f"{_gb(s.decode_activation_bytes)} GB"
            + (f", verify {_gb(s.verify_activation_bytes)} GB" if plan.verify_tokens else "")
            for s in plan.stages),
        "host memory to build a stage (one process, peak resident; of it anonymous): " + ", ".join(
            f"stage {s.index} {_gb(s.build_host_bytes)} GB ({_gb(s.build_anon_bytes)} GB)"
            for s in plan.stages)
        + f" (measured fit: anonymous {BUILD_ANON_FIXED_BYTES / 1e9:.2f} GB + {BUILD_ANON_PER_WEIGHT_BYTE} x "
        f"its weights, file pages {BUILD_FILE_FIXED_BYTES / 1e9:.2f} GB + {BUILD_FILE_PER_WEIGHT_BYTE:g} x: "
        "the parser's mapping of the weights file, which the kernel reclaims)",
        "host memory to check a stage (check --build / --engine: the eager reference runs on the host's CPU, "
        "never on the engine's GPU; its weights" + (", and its float32 model's" if plan.dtype != "float32"
                                                    else "") + "): in memory " + ", ".join(
            f"stage {s.index} {_gb(s.check_host_bytes)} GB" for s in plan.stages)
        + "; streamed (check --eager streamed: one layer at a time, the layers before a stage for its input, "
        "check --build --stage I) " + ", ".join(
            f"stage {s.index} {_gb(s.check_streamed_host_bytes)} GB" for s in plan.stages)
        + " (weights only: caches and per-step activations come on top, as the check's request sizes them)",
    ]
    return "\n".join(lines)


# ---- per GPU of a tensor/expert-parallel stage
#
# What a tensor/expert-parallel split (k3export/model/parallel.py) puts on each GPU of a pipeline stage.
#
#     k3export plan --preset kimi-k3 --stages 2 --ranks 8 --packed-experts
#
# Every rank of a stage holds the same bytes (the splits are even): the split weights (1/N of the heads,
# experts and MLP widths) and the replicated ones (router, latent projections and norms, MLA's q_a and
# kv_a, KDA's f_a, AttnRes, and on the first and last stage the embedding and LM head). Its cache: its
# KDA heads' state and conv tails, and the whole MLA latent cache (one key head, the same on every
# rank). Its collectives: two all-reduces per layer (k3export.model.parallel.collectives), each taking
# 2 (N - 1) / N x bytes / bandwidth on a ring, per token (latency per call not counted).

# NVLink 4 on H100 / H200: 450 GB/s in each direction per GPU, what a ring all-reduce moves data at.
COLLECTIVE_GB_PER_S = 450.0
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class RankStage(GpuMemory):
    """One rank of a stage (all ranks of a stage hold the same amounts)."""

    index: int
    layers: range
    ranks: int
    split_weight_bytes: int  # this rank's share of the split weights
    replicated_weight_bytes: int  # held whole by every rank
    cache_bytes_per_sequence: int  # its KDA heads, the whole MLA latent cache
    cache_bytes: int  # x the plan's batch
    rollback_bytes_per_sequence: int  # its KDA heads' caches, copied before a verify (rollback_bytes)
    rollback_bytes: int  # x the plan's batch when it has a verify profile (0: none)
    activation_bytes: int  # the unsplit stage's estimate (an upper bound for a rank)
    collective_bytes_per_token: list[int]  # per all-reduce, in layer order
    collective_seconds_per_token: float

    @property
    def weight_bytes(self) -> int:
        return self.split_weight_bytes + self.replicated_weight_bytes


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
        copy = rollback_bytes(local, layers, plan.dtype)
        result.append(RankStage(
            index=stage.index, layers=layers, ranks=ranks,
            split_weight_bytes=sum(split_bytes[i] for i in layers),
            replicated_weight_bytes=sum(replicated_bytes[i] for i in layers),
            cache_bytes_per_sequence=per_sequence, cache_bytes=per_sequence * plan.batch,
            rollback_bytes_per_sequence=copy, rollback_bytes=copy * plan.batch if plan.verify_tokens else 0,
            activation_bytes=stage.activation_bytes, collective_bytes_per_token=sums,
            collective_seconds_per_token=ring * sum(sums) / (collective_gb_per_s * 1e9)))
    return result


def format_rank_plan(stages: list[RankStage], collective_gb_per_s: float, host_bytes: float) -> str:
    ranks = stages[0].ranks
    verify = any(s.rollback_bytes for s in stages)
    lines = [
        f"each stage split over {ranks} GPUs (tensor-parallel heads, expert-parallel experts; per GPU of "
        f"a stage, all alike); collectives at {collective_gb_per_s:g} GB/s (ring all-reduce)",
        "stage  layers  split weights  replicated  cache/seq  all-reduces     B/tok  us/tok"
        f"    weights + cache + activations{ROLLBACK_COLUMN if verify else ''} =  total  fits",
    ]
    for s in stages:
        lines.append(
            f"{s.index:>5}  {s.layers.start:>2}-{s.layers.stop - 1:<3}  {_gb(s.split_weight_bytes):>13}  "
            f"{_gb(s.replicated_weight_bytes):>10}  {_gb(s.cache_bytes_per_sequence):>9}  "
            f"{len(s.collective_bytes_per_token):>11}  {sum(s.collective_bytes_per_token):>8}  "
            f"{s.collective_seconds_per_token * 1e6:>6.2f}  {_gb(s.weight_bytes):>10} + "
            f"{_gb(s.cache_bytes):>5} + {_gb(s.activation_bytes):>11}"
            f"{rollback_column(s) if verify else ''} = {_gb(s.total_bytes):>6}  "
            f"{'yes' if s.fits_h200 else 'NO'}")
    lines += [
        "per layer two all-reduces: attention (hidden values, model dtype) and FFN (a MoE layer's "
        "[u | shared] in float32, latent + hidden values; the dense layer's output in the model dtype)",
        "the MLA latent cache is the same on every rank (one key head); KDA state and conv tails are "
        "split by heads; activations are the unsplit stage's estimate (an upper bound)",
        "speculative decoding's rollback, per GPU: a copy of its KDA heads' states and conv tails before "
        "each verify call, per sequence " + ", ".join(
            f"stage {s.index} {_gb(s.rollback_bytes_per_sequence)} GB" for s in stages),
        "host memory to build one rank (a process, peak resident; of it anonymous): " + ", ".join(
            f"stage {s.index} {_gb(s.build_host_bytes)} GB ({_gb(s.build_anon_bytes)} GB)" for s in stages)
        + f"; builds at once (build --stage I --rank R, one per GPU) within {HOST_BUILD_SHARE:.0%} of a "
        f"{host_bytes / 1e12:g} TB host, counting their anonymous memory: " + ", ".join(
            f"stage {s.index} {min(ranks, s.builds_at_once(host_bytes))} of {ranks} "
            f"({ranks} need {_gb(ranks * s.build_anon_bytes)} GB)" for s in stages),
    ]
    return "\n".join(lines)


def rank_plan_json(stages: list[RankStage], collective_gb_per_s: float, host_bytes: float) -> dict:
    return {"ranks": stages[0].ranks, "collective_gb_per_s": collective_gb_per_s, "host_bytes": host_bytes,
            "stages": [{
        "layers": [s.layers.start, s.layers.stop], "split_weight_bytes": s.split_weight_bytes,
        "replicated_weight_bytes": s.replicated_weight_bytes, "weight_bytes": s.weight_bytes,
        "cache_bytes_per_sequence": s.cache_bytes_per_sequence, "cache_bytes": s.cache_bytes,
        "activation_bytes": s.activation_bytes, "rollback_bytes": s.rollback_bytes,
        "total_bytes": s.total_bytes, "fits_h200": s.fits_h200,
        "build_host_bytes": s.build_host_bytes, "build_anon_bytes": s.build_anon_bytes,
        "builds_at_once": min(s.ranks, s.builds_at_once(host_bytes)),
        "collective_bytes_per_token": s.collective_bytes_per_token,
        "collective_seconds_per_token": s.collective_seconds_per_token} for s in stages]}


# What `plan --preset` takes beyond the preset (their defaults where not given); a recipe has its own.
PRESET_DEFAULTS = {"context": 131072, "batch": 1, "prefill_tokens": 1024}
PRESET_ONLY = ("stages", "packed_experts", "dtype", *PRESET_DEFAULTS)


def cmd_plan(args: argparse.Namespace) -> int:
    from k3export.shards.recipe import load_recipe

    if (args.recipe is None) == (args.preset is None):
        raise UserError("plan: expected a RECIPE file or --preset NAME --stages N (one of them)")
    if args.recipe:
        # A recipe sets these itself ([stages], [weights], [cache], [profiles]): not silently ignored.
        given = [f"--{dest.replace('_', '-')}" for dest in PRESET_ONLY
                 if getattr(args, dest) not in (None, False)]
        if given:
            raise UserError(f"plan {args.recipe} {given[0]}: expected --preset NAME with it (a recipe's own "
                            "[stages], [weights], [cache] and [profiles] are what its plan uses)")
    recipe = load_recipe(args.recipe) if args.recipe else None
    if recipe:
        plan = plan_recipe(recipe, args.link_gb_per_s)
    else:
        if args.stages is None:
            raise UserError("plan --preset: expected --stages N")
        config = K3Config.from_preset(args.preset)
        sizes = {dest: getattr(args, dest) or default for dest, default in PRESET_DEFAULTS.items()}
        plan = make_plan(config, args.stages, model=args.preset, dtype=args.dtype or config.torch_dtype,
                         packed_experts=args.packed_experts, **sizes,
                         link_gb_per_s=args.link_gb_per_s or LINK_GB_PER_S)
    ranks = args.ranks or (recipe.ranks if recipe else 1)
    collective_gb_per_s = (args.collective_gb_per_s or (recipe and recipe.ranks_gb_per_s)
                           or COLLECTIVE_GB_PER_S)
    if ranks == 1:
        # They size the per-GPU table of split stages, which an unsplit plan has not: not ignored.
        split_only = [option for option, value in (("--collective-gb-per-s", args.collective_gb_per_s),
                                                    ("--host-gb", args.host_gb)) if value is not None]
        if split_only:
            raise UserError(f"plan {split_only[0]}: expected --ranks N > 1 (or a recipe's [parallel] "
                            "ranks) with it: it sizes the split stages' per-GPU table, which an unsplit plan "
                            "has not")
        print(json.dumps(plan.to_json(), indent=2) if args.json else format_plan(plan))
        return 0
    stages = rank_stages(plan, ranks, collective_gb_per_s)
    host_bytes = args.host_gb * 1e9 if args.host_gb else HOST_BYTES
    if args.json:
        parallel = rank_plan_json(stages, collective_gb_per_s, host_bytes)
        print(json.dumps({**plan.to_json(), "parallel": parallel}, indent=2))
    else:
        rank_plan = format_rank_plan(stages, collective_gb_per_s, host_bytes)
        print(format_plan(plan, ranks) + "\n\n" + rank_plan)
    return 0


def add_parser(sub: Any) -> None:
    """Registers `k3export plan` on the CLI's subparsers."""
    plan = sub.add_parser("plan", help="pipeline stages balanced by weight bytes, and what each holds")
    plan.add_argument("recipe", nargs="?", metavar="RECIPE", type=recipe_file,
                      help="a recipe (engines/*.toml)")
    plan.add_argument("--preset", choices=list(PRESETS), help="plan a preset instead of a recipe")
    plan.add_argument("--stages", type=positive_int, help="stage count (with --preset)")
    plan.add_argument("--packed-experts", action="store_true", help="routed experts in MXFP4 (with --preset)")
    plan.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="with --preset")
    plan.add_argument("--context", type=positive_int,
                      help=f"cache tokens per sequence (with --preset; default {PRESET_DEFAULTS['context']})")
    plan.add_argument("--batch", type=positive_int,
                      help=f"sequences in the cache (with --preset; default {PRESET_DEFAULTS['batch']})")
    plan.add_argument("--prefill-tokens", type=positive_int,
                      help="batch x seq of the largest prefill, for the activation estimate (with --preset; "
                           f"default {PRESET_DEFAULTS['prefill_tokens']})")
    plan.add_argument("--link-gb-per-s", type=positive_real,
                      help="bandwidth between stages, GB/s (default: the recipe's [links] stages_gb_per_s, "
                           f"else {LINK_GB_PER_S:g}: 400 Gb/s InfiniBand)")
    plan.add_argument("--ranks", type=positive_int, metavar="N",
                      help="GPUs per stage: every stage split over N (k3export/model/parallel.py); per GPU "
                           "figures (default: the recipe's [parallel] ranks, else 1)")
    plan.add_argument("--collective-gb-per-s", type=positive_real,
                      help="bandwidth of the collectives within a stage, GB/s (default: the recipe's [links] "
                           f"ranks_gb_per_s, else {COLLECTIVE_GB_PER_S:g}: NVLink 4, one direction)")
    plan.add_argument("--host-gb", type=positive_real,
                      help="memory of a host building its ranks at once, GB (default "
                           f"{HOST_BYTES / 1e9:g}: 8 x H200, DGX H200)")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(run=cmd_plan)
