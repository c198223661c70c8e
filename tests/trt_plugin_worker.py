"""Run by tests/test_trt_plugin.py in a fresh process: `k3plugins.trt_aot.register` through full TensorRT's
own `tensorrt.plugin` (tests/trt_plugin_shim.py), then each op's plugin as a build would meet it, at the
published model's widths (kimi-k3, one rank of 8: 112 experts). Prints one JSON line: what TensorRT's code
made of our functions.

A build calls, in order: the creator's create_plugin (the ONNX node's fields), get_output_data_types,
get_output_shapes, get_supported_format_combinations (our autotune), configure_plugin, set_tactic, then for
the AOT form get_launch_params (our aot_impl) and get_kernel. Here they are called in that order on the
plugin TensorRT's creator makes, with the shim's stand-ins for the C++ builder's expressions.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import trt_plugin_shim

# The dynamic dimensions' values where expressions are read; S: LatentMLACombine's input splits; U: T's
# chunks of 16 tokens (KDA's decay_last); P: the N k pairs (kimi-k3's top-16).
SIZES = {"B": 2, "T": 37, "C": 4096, "N": 9, "S": 3, "U": 3, "P": 9 * 16}
EXPERTS_HELD = 112  # kimi-k3's 896 routed experts over 8 ranks
PARSER_TYPES = {int: np.int32, float: np.float32}  # an ONNX INT / FLOAT attribute as the parser passes it


def published_inputs(config: Any) -> dict[str, list[list[int | str]]]:
    """Each op's input dims at the published widths (str: a dynamic dimension, SIZES)."""
    K, H = config.linear_attn_config.head_dim, config.linear_attn_config.num_heads
    D, L, I = config.latent_dim, config.routed_expert_hidden_size, config.moe_intermediate_size
    E, k = EXPERTS_HELD, config.num_experts_per_token
    routing = [["N", L], ["N", k], ["N", k]]
    H, V = config.num_attention_heads, config.kv_lora_rank
    mla = [["B", "T", H, D], ["B", 1, "C", D], ["B"]]
    kda = [["B", "T", H, K]] * 4 + [["B", "T", H], ["B", H, K, K]]
    kda_terms = [["B", "T", H, K]] * 4 + [["B", "T", H, 16], ["B", "U", H, K]]
    return {
        "KDA": kda,
        "KDAPrepare": kda[:5],
        "KDAChunkRecurrence": [*kda[:5], *kda_terms, kda[5]],
        "LatentMLA": mla,
        "LatentMLASplits": mla,
        "LatentMLACombine": [mla[0], ["S", "B", "T", H, V], ["S", "B", "T", H]],
        "RoutedExperts": [*routing, [E, I, L], [E, I, L], [E, L, I]],
        # int32 words: codes [E, O*I/8], scales [E, O*I/128] (k3export/ops/mxfp4.py).
        "RoutedExpertsGroup": [["N", k]],
        "RoutedExpertsGateUp": [["N", L], ["P"], [E + 1], [E, I, L], [E, I, L]],
        "RoutedExpertsGateUpMXFP4": [["N", L], ["P"], [E + 1], *[[E, I * L // 8], [E, I * L // 128]] * 2],
        "RoutedExpertsDown": [["P", I], [E + 1], [E, L, I]],
        "RoutedExpertsDownMXFP4": [["P", I], [E + 1], [E, L * I // 8], [E, L * I // 128]],
        "RoutedExpertsMXFP4": [*routing, *[[E, I * L // 8], [E, I * L // 128]] * 2,
                               [E, L * I // 8], [E, L * I // 128]],
    }


def node_fields(config: Any) -> dict[str, dict[str, float | int]]:
    """The attributes each ONNX node carries (k3export/onnx): what the parser hands create_plugin."""
    routed = {"situ_beta": config.activation_situ_beta,
              "situ_linear_beta": config.activation_situ_linear_beta, "expert_offset": 0}
    mla = {"v_dim": config.kv_lora_rank, "scale": config.mla_scale}
    betas = {"situ_beta": config.activation_situ_beta, "situ_linear_beta": config.activation_situ_linear_beta}
    return {"KDA": {}, "KDAPrepare": {}, "KDAChunkRecurrence": {}, "LatentMLA": mla, "LatentMLASplits": mla,
            "LatentMLACombine": {}, "RoutedExperts": routed, "RoutedExpertsMXFP4": routed,
            "RoutedExpertsGroup": {"num_experts": EXPERTS_HELD, "expert_offset": 0},
            "RoutedExpertsGateUp": betas, "RoutedExpertsGateUpMXFP4": betas, "RoutedExpertsDown": {},
            "RoutedExpertsDownMXFP4": {}}


def network_dtypes(definition: Any, dtype: str) -> list[str]:
    """The dtype of each input and output in a `dtype` model: a group's one dtype, or the model's; KDA's
    g and beta float32 (k3export/model/kda.py keeps them so)."""
    chosen = {group: allowed[0] if len(allowed) == 1 or group == "TG" else dtype
              for group, allowed in definition.groups.items()}
    return [chosen[a.group] for a in definition.inputs + definition.outputs]


def parser_fields(trt: Any, creator: Any, values: dict[str, float | int]) -> tuple[Any, dict[str, Any]]:
    """A node's attributes as the ONNX parser hands them to `creator` (onnx-tensorrt, onnxOpImporters.cpp
    `loadFields`): in the order of the creator's field names, an INT attribute as INT32, a FLOAT one as
    FLOAT32. Returns the field collection and its arrays, which the caller keeps referenced: a PluginField
    points into its array's buffer."""
    arrays = {f.name: np.array([values[f.name]], PARSER_TYPES[type(values[f.name])])
              for f in creator.field_names}
    collection = trt.PluginFieldCollection([
        trt.PluginField(key, array, getattr(trt.PluginFieldType, array.dtype.name.upper()))
        for key, array in arrays.items()])
    return collection, arrays


def main() -> None:
    trtp = trt_plugin_shim.load()
    import tensorrt as trt

    from k3export.config import K3Config
    from k3plugins import trt_aot
    from k3plugins.definitions import (
        GROUPED_EXPERTS,
        KDA,
        KDA_CHUNK_RECURRENCE,
        KDA_PREPARE,
        LATENT_MLA,
        LATENT_MLA_COMBINE,
        LATENT_MLA_SPLITS,
        ROUTED_EXPERTS,
        ROUTED_EXPERTS_MXFP4,
    )

    trt_aot.register(trt)
    trt_aot.register(trt)  # a second build or engine in the process registers again
    trt_plugin_shim.use_stand_ins(trt)
    trt_aot.device_target = lambda: "sm90"  # the build GPU's target, which needs a GPU to query
    config = K3Config.from_preset("kimi-k3")
    inputs, fields = published_inputs(config), node_fields(config)
    registry = trt.get_plugin_registry()
    result: dict[str, Any] = {"ops": sorted(n for n in vars(trtp.op.k3) if not n.startswith("_"))}
    for definition in (KDA, KDA_PREPARE, KDA_CHUNK_RECURRENCE, LATENT_MLA, LATENT_MLA_SPLITS,
                       LATENT_MLA_COMBINE, ROUTED_EXPERTS, ROUTED_EXPERTS_MXFP4, *GROUPED_EXPERTS):
        name = definition.name
        creator = registry.get_creator(name, "1", "k3")
        collection, arrays = parser_fields(trt, creator, fields[name])
        op: dict[str, Any] = {"fields": list(arrays), "dtypes": {}}
        for dtype in ("float32", "float16", "bfloat16"):
            plugin = creator.create_plugin(name, "k3", collection, trt.TensorRTPhase.BUILD,
                                           trt.QuickPluginCreationRequest.PREFER_AOT)
            dims = inputs[name]
            io = [getattr(trt, t) for t in network_dtypes(definition, dtype)]
            n_in = len(dims)
            out_types = plugin.get_output_data_types(io[:n_in], [len(d) for d in dims])
            out_exprs = plugin.get_output_shapes([[trt_plugin_shim.dim(d) for d in ds] for ds in dims], [],
                                                 trt_plugin_shim.ExprBuilder())
            out_dims = [[e.evaluate(SIZES) for e in exprs] for exprs in out_exprs]

            def described(i: int, *, io: list[Any] = io, dims: list[Any] = dims,
                          out_dims: list[list[int]] = out_dims) -> Any:
                desc = trt.DynamicPluginTensorDesc()
                tensor = trt.PluginTensorDesc()
                shape = dims[i] if i < len(dims) else out_dims[i - len(dims)]
                tensor.dims = trt.Dims([SIZES[d] if isinstance(d, str) else d for d in shape])
                tensor.type, tensor.format = io[i], trt.TensorFormat.LINEAR
                desc.desc = tensor
                return desc

            in_out = [described(i) for i in range(len(io))]
            offered = plugin.get_supported_format_combinations(in_out, n_in)
            width = len(io)
            combos = [[str(d.type) for d in offered[j:j + width]] for j in range(0, len(offered), width)]
            entry = {"output_dtypes": [str(t) for t in out_types], "network": [str(t) for t in io],
                     "aliases": [plugin.get_aliased_input(i) for i in range(len(out_types))],
                     "output_dims": out_dims, "combinations": combos}
            if dtype == "bfloat16":  # the published recipe's dtype: the AOT kernel compiled, its launch read
                plugin.configure_plugin(in_out[:n_in], in_out[n_in:])
                entry["tactics"] = plugin.get_valid_tactics()
                plugin.set_tactic(0)
                params, scalars = trt_plugin_shim.LaunchParams(), trt_plugin_shim.SymExprSetter()
                plugin.get_launch_params(None, in_out, n_in, params, scalars, trt_plugin_shim.ExprBuilder())
                kernel_name, ptx = plugin.get_kernel([d.desc for d in in_out[:n_in]],
                                                     [d.desc for d in in_out[n_in:]])
                entry["launch"] = {key: getattr(params, key).expr.evaluate(SIZES) for key in params.KEYS}
                entry["scalars"] = [s.expr.evaluate(SIZES) for s in scalars]
                entry["scalar_dtypes"] = [str(s.dtype) for s in scalars]
                entry["kernel"] = kernel_name if isinstance(kernel_name, str) else kernel_name.decode()
                entry["ptx_target"] = re.search(r"^\.target\s+(\w+)", ptx.decode(), re.M).group(1)
                entry["ptx_entry"] = re.search(r"\.entry\s+(\w+)", ptx.decode()).group(1)
            op["dtypes"][dtype] = entry
        result[name] = op
    print("RESULT " + json.dumps(result))


def jit_inputs(torch: Any, name: str, dtype: Any) -> list[Any]:
    """Small inputs of KDA and its two nodes (T = 5: the chunked launches; the recurrence's terms
    KDAPrepare's) and LatentMLA (a cache of 8 rows, 3 of them new) in a
    `dtype` model (KDA's g, beta and state float32)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: Any = dtype) -> Any:
        return torch.randn(*shape, generator=gen).to(dtype)

    if name.startswith("KDA"):
        from k3plugins.kda import kda_prepare

        q, k, v = (randn(1, 5, 2, 32) * 0.2 for _ in range(3))
        g, beta = -torch.rand(1, 5, 2, 32, generator=gen), torch.rand(1, 5, 2, generator=gen)
        state = randn(1, 2, 32, 32, dtype=torch.float32)
        return {"KDA": [q, k, v, g, beta, state], "KDAPrepare": [q, k, v, g, beta],
                "KDAChunkRecurrence": [q, k, v, g, beta, *kda_prepare(q, k, v, g, beta), state]}[name]
    if name == "LatentMLACombine":  # 3 splits' partials, the last without a visible row (never written)
        lse = torch.randn(3, 1, 3, 2, generator=gen)
        lse[2] = float("-inf")
        return [randn(1, 3, 2, 48), torch.randn(3, 1, 3, 2, 32, generator=gen), lse]
    return [randn(1, 3, 2, 48), randn(1, 1, 8, 48), torch.tensor([4])]


def tensor_desc(trt: Any, dtype: Any, shape: Any) -> Any:
    """What TensorRT hands a plugin's enqueue of each tensor: a linear PluginTensorDesc."""
    desc = trt.PluginTensorDesc()
    desc.dims, desc.type, desc.format = trt.Dims(list(shape)), dtype, trt.TensorFormat.LINEAR
    return desc


def jit_main() -> None:
    """The JIT `impl`s of KDA and LatentMLA through TensorRT's own JIT plugin class, in each model dtype:
    its `enqueue` wraps TensorRT's pointers in `tensorrt.plugin` Tensors and calls our impl, which launches
    the kernels (Triton's interpreter, host memory: run with TRITON_INTERPRET=1). Prints, per op and dtype,
    whether every output equals the definition's own launch on copies of the inputs, or the error the
    enqueue raised."""
    import torch

    trt_plugin_shim.load()
    import tensorrt as trt

    from k3plugins import trt_aot
    from k3plugins.definitions import (
        KDA,
        KDA_CHUNK_RECURRENCE,
        KDA_PREPARE,
        LATENT_MLA,
        LATENT_MLA_COMBINE,
        LATENT_MLA_SPLITS,
    )

    trt_aot.register(trt)
    trt_plugin_shim.use_host_memory(torch)
    types = {torch.float32: trt.DataType.FLOAT, torch.float16: trt.DataType.HALF,
             torch.bfloat16: trt.DataType.BF16, torch.int64: trt.DataType.INT64}
    result: dict[str, Any] = {}
    mla = {"v_dim": 32, "scale": 48**-0.5}
    for definition, fields in ((KDA, {}), (KDA_PREPARE, {}), (KDA_CHUNK_RECURRENCE, {}), (LATENT_MLA, mla),
                               (LATENT_MLA_SPLITS, mla), (LATENT_MLA_COMBINE, {})):
        creator = trt.get_plugin_registry().get_creator(definition.name, "1", "k3")
        collection, _arrays = parser_fields(trt, creator, fields)  # the arrays kept while it is used
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            plugin = creator.create_plugin(definition.name, "k3", collection, trt.TensorRTPhase.RUNTIME,
                                           trt.QuickPluginCreationRequest.STRICT_JIT)
            inputs = jit_inputs(torch, definition.name, dtype)
            plugin.get_output_data_types([types[t.dtype] for t in inputs], [t.dim() for t in inputs])
            # The outputs, KDA's state aliased to its initial state (one buffer, as TensorRT hands it).
            shapes = definition.output_shapes([list(t.shape) for t in inputs], fields, int)
            dtypes = definition.output_dtypes([str(t.dtype).removeprefix("torch.") for t in inputs])
            outputs = [torch.full(shape, float("nan"), dtype=getattr(torch, d))
                       for shape, d in zip(shapes, dtypes, strict=True)]
            expected_inputs = [t.clone() for t in inputs]
            expected = [torch.full_like(o, float("nan")) for o in outputs]
            for output, aliased in definition.aliases.items():
                outputs[output], expected[output] = inputs[aliased], expected_inputs[aliased]
            definition.launch(expected_inputs, expected, fields)
            descs = [[tensor_desc(trt, types[t.dtype], t.shape) for t in ts] for ts in (inputs, outputs)]
            key = f"{definition.name} {str(dtype).removeprefix('torch.')}"
            try:
                plugin.enqueue(*descs, [t.data_ptr() for t in inputs], [t.data_ptr() for t in outputs],
                               [t.stride() for t in inputs], [t.stride() for t in outputs], 0)
                # NaN where neither wrote (a split without rows leaves its part unwritten).
                result[key] = all(torch.equal(a.nan_to_num(), b.nan_to_num())
                                  for a, b in zip(outputs, expected, strict=True))
            except Exception as error:  # reported to the test, which names it
                result[key] = f"{type(error).__name__}: {error}"
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    jit_main() if sys.argv[1:] == ["jit"] else main()
