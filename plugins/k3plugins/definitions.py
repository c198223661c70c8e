"""One definition per custom op, in plain Python that imports neither TensorRT flavour.

A definition says what a TensorRT plugin for the op must: its lookup keys (name, namespace,
version), its fields (the ONNX node's attributes that reach the plugin), output shapes as expressions
of the input dims, dtypes, formats, and the launch. The adapters in `k3plugins.trt` and
`k3plugins.trt_aot` present it to a builder; nothing here needs a GPU except `launch` itself.

Dtypes are torch's names ("float32", "float16", "bfloat16", "int64", "int32", "uint8"). Tensors whose
`group` is the same must share one dtype (the ONNX schema's type constraints in k3export/onnx/ops.py);
every tensor is linear (dense, row-major). An output may alias an input (`aliases`): TensorRT then hands the
plugin one buffer for both, and the launch must be safe in place (KDA's state is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from k3plugins.kda import CHUNK_SIZE, chunk_kda, kda_chunk_recurrence, kda_prepare, recurrent_kda
from k3plugins.mla import latent_mla, latent_mla_combine, latent_mla_splits, split_count
from k3plugins.moe import Grouping, down, gate_up, group_pairs, routed_experts, routed_experts_mxfp4

NAMESPACE = "k3"
VERSION = "1"
FLOATS = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Field:
    """A plugin field: an ONNX attribute of the node, passed to the plugin with its ONNX type."""

    name: str
    type: type  # int or float
    default: int | float | None = None  # the value when the node does not carry it (None: required)


@dataclass(frozen=True)
class TensorArg:
    name: str
    group: str  # dtype constraint group: tensors of one group share a dtype


@dataclass(frozen=True)
class PluginDefinition:
    name: str
    fields: tuple[Field, ...]
    inputs: tuple[TensorArg, ...]
    outputs: tuple[TensorArg, ...]
    groups: Mapping[str, tuple[str, ...]]  # group -> dtypes it allows
    # (input dims, fields, constant) -> output dims; `constant` turns an int into a dimension, so the
    # one expression serves ints and a builder's symbolic dims alike.
    output_shapes: Callable[[Sequence[Sequence[Any]], Mapping[str, Any], Callable[[int], Any]],
                            list[list[Any]]]
    # (input tensors, output tensors, fields): writes the outputs, on torch's current CUDA stream.
    launch: Callable[[Sequence[Tensor], Sequence[Tensor], Mapping[str, Any]], None]
    aliases: Mapping[int, int] = field(default_factory=dict)  # output index -> the input it may share
    # The plugin's inputs -> the reference op's (torch.ops.<namespace>.<name in snake case>), where
    # they differ (views, no copies); None: the same.
    reference_inputs: Callable[[Sequence[Tensor]], list[Tensor]] | None = None
    namespace: str = NAMESPACE
    version: str = VERSION

    def reference_arguments(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        """The inputs as the reference op takes them."""
        return list(inputs) if self.reference_inputs is None else self.reference_inputs(inputs)

    def aliased_input(self, output: int) -> int:
        """The input index output `output` shares its buffer with, or -1 (TensorRT's convention)."""
        return self.aliases.get(output, -1)

    def output_dtypes(self, input_dtypes: Sequence[str]) -> list[str]:
        """An output takes its group's one dtype, or else that of the group's first input."""
        dtypes = []
        for out in self.outputs:
            allowed = self.groups[out.group]
            if len(allowed) == 1:
                dtypes.append(allowed[0])
            else:
                first = next(i for i, arg in enumerate(self.inputs) if arg.group == out.group)
                dtypes.append(input_dtypes[first])
        return dtypes

    def supports(self, dtypes: Sequence[str | None]) -> bool:
        """Whether a dtype assignment to inputs then outputs is allowed; None marks a tensor that is
        not yet decided (TensorRT asks position by position, earlier positions fixed)."""
        chosen: dict[str, str] = {}
        for arg, dtype in zip(self.inputs + self.outputs, dtypes, strict=False):
            if dtype is None:
                continue
            if dtype not in self.groups[arg.group] or chosen.setdefault(arg.group, dtype) != dtype:
                return False
        return True

    def parse_fields(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The fields from what a builder passed (scalars or one-element arrays), each checked."""
        missing = [f.name for f in self.fields if f.name not in values and f.default is None]
        if missing:
            raise ValueError(f"{self.namespace}::{self.name} v{self.version}: missing fields {missing}; "
                             f"the ONNX node must carry them as attributes")
        return {f.name: f.type(_scalar(values.get(f.name, f.default))) for f in self.fields}


def _scalar(value: Any) -> Any:
    # A builder hands fields over as arrays of one element.
    return value.reshape(-1)[0].item() if hasattr(value, "reshape") else value


def _launch_kda(inputs: Sequence[Tensor], outputs: Sequence[Tensor], fields: Mapping[str, Any]) -> None:
    # As torch.ops.k3.kda: the recurrence for decode (T = 1), the chunked form for prefill. The final
    # state may be the initial state's buffer (aliased): both launchers are safe in place.
    step = recurrent_kda if inputs[0].shape[1] == 1 else chunk_kda
    step(*inputs, o=outputs[0], final_state=outputs[1])


def _launch_latent_mla(inputs: Sequence[Tensor], outputs: Sequence[Tensor],
                       fields: Mapping[str, Any]) -> None:
    # latent_mla itself picks split-KV decode (T <= 16) or prefill tiles from T.
    latent_mla(*inputs, fields["v_dim"], fields["scale"], out=outputs[0])


KDA = PluginDefinition(
    name="KDA",
    fields=(),
    inputs=tuple(TensorArg(n, g) for n, g in (("q", "T"), ("k", "T"), ("v", "T"), ("g", "TG"),
                                                 ("beta", "TG"), ("initial_state", "TS"))),
    outputs=(TensorArg("o", "T"), TensorArg("final_state", "TS")),
    # g and beta may stay float32 under a half-precision model; the state is always float32.
    groups={"T": FLOATS, "TG": FLOATS, "TS": ("float32",)},
    output_shapes=lambda dims, fields, constant: [list(dims[2]), list(dims[5])],
    launch=_launch_kda,
    aliases={1: 5},  # final_state updates initial_state in place
)

def _kda_prepare_shapes(dims: Sequence[Sequence[Any]], fields: Mapping[str, Any],
                        constant: Callable[[int], Any]) -> list[list[Any]]:
    # qg, kt, w like q; u like v; a_qk [B, T, H, CHUNK_SIZE]; decay_last [B, n_chunks, H, K] (+, // only:
    # trt.py's expressions have no -).
    B, T, H, K = dims[0]
    return [list(dims[0])] * 3 + [list(dims[2]), [B, T, H, constant(CHUNK_SIZE)],
                                  [B, (T + (CHUNK_SIZE - 1)) // CHUNK_SIZE, H, K]]


_KDA_INTERMEDIATES = (*(TensorArg(n, "T") for n in ("qg", "kt", "w", "u", "a_qk")),
                      TensorArg("decay_last", "TS"))

# kda as exports hold it since 2026-12 (k3export/onnx/ops.py): kda_prepare's chunk terms (graph tensors), then
# the recurrence over them, so that full TensorRT's AOT plugins (one launch each, no workspace) run prefill as
# chunk_kda's two kernels. The recurrence takes the token inputs too: a short call (decode) steps the
# recurrence from them, and the prepare's AOT kernel then writes nothing.
KDA_PREPARE = PluginDefinition(
    name="KDAPrepare",
    fields=(),
    inputs=KDA.inputs[:5],
    outputs=_KDA_INTERMEDIATES,
    groups=KDA.groups,
    output_shapes=_kda_prepare_shapes,
    launch=lambda inputs, outputs, fields: kda_prepare(*inputs, outputs),
)


def _launch_kda_chunk_recurrence(inputs: Sequence[Tensor], outputs: Sequence[Tensor],
                                 fields: Mapping[str, Any]) -> None:
    # As torch.ops.k3.kda_chunk_recurrence: decode (T = 1) steps the recurrence from the token inputs.
    if inputs[0].shape[1] == 1:
        recurrent_kda(*inputs[:5], inputs[11], o=outputs[0], final_state=outputs[1])
    else:
        kda_chunk_recurrence(inputs[5:11], inputs[11], o=outputs[0], final_state=outputs[1])


KDA_CHUNK_RECURRENCE = PluginDefinition(
    name="KDAChunkRecurrence",
    fields=(),
    inputs=(*KDA.inputs[:5], *_KDA_INTERMEDIATES, KDA.inputs[5]),
    outputs=KDA.outputs,
    groups=KDA.groups,
    output_shapes=lambda dims, fields, constant: [list(dims[2]), list(dims[11])],
    launch=_launch_kda_chunk_recurrence,
    aliases={1: 11},  # final_state updates initial_state in place
)


LATENT_MLA = PluginDefinition(
    name="LatentMLA",
    fields=(Field("v_dim", int), Field("scale", float)),
    # q [B, T, H, D]; kv [B, 1, capacity, D], the whole cache with this call's rows written;
    # cache_lengths [B] int64, the rows each sequence had before this call.
    inputs=(TensorArg("q", "T"), TensorArg("kv", "TKV"), TensorArg("cache_lengths", "TL")),
    outputs=(TensorArg("o", "T"),),
    groups={"T": FLOATS, "TKV": FLOATS, "TL": ("int64",)},
    output_shapes=lambda dims, fields, constant: [[*dims[0][:3], constant(fields["v_dim"])]],
    launch=_launch_latent_mla,
)


def _latent_mla_splits_shapes(dims: Sequence[Sequence[Any]], fields: Mapping[str, Any],
                              constant: Callable[[int], Any]) -> list[list[Any]]:
    # o_part [S, B, T, H, v_dim] and lse [S, B, T, H], S the kernels' split count for q [B, T, H, D].
    B, T, H = dims[0][:3]
    S = split_count(B, T, H)
    return [[S, B, T, H, constant(fields["v_dim"])], [S, B, T, H]]


# latent_mla as exports hold it since 2026-12 (k3export/onnx/ops.py): the splits of each row's cache, their
# partial outputs and lse a graph tensor, then the combine, so that full TensorRT's AOT plugins (one launch
# each, no workspace) split the cache too.
LATENT_MLA_SPLITS = PluginDefinition(
    name="LatentMLASplits",
    fields=LATENT_MLA.fields,
    inputs=LATENT_MLA.inputs,
    outputs=(TensorArg("o_part", "TP"), TensorArg("lse", "TP")),
    groups={**LATENT_MLA.groups, "TP": ("float32",)},
    output_shapes=_latent_mla_splits_shapes,
    launch=lambda inputs, outputs, fields: latent_mla_splits(*inputs, fields["v_dim"], fields["scale"],
                                                             *outputs),
)

LATENT_MLA_COMBINE = PluginDefinition(
    name="LatentMLACombine",
    fields=(),
    # q gives the output's dtype only; o_part and lse are LatentMLASplits' outputs.
    inputs=(TensorArg("q", "T"), TensorArg("o_part", "TP"), TensorArg("lse", "TP")),
    outputs=(TensorArg("o", "T"),),
    groups={"T": FLOATS, "TP": ("float32",)},
    output_shapes=lambda dims, fields, constant: [[*dims[0][:3], dims[1][4]]],
    launch=lambda inputs, outputs, fields: latent_mla_combine(inputs[1], inputs[2], outputs[0]),
)

def _launch_routed_experts(inputs: Sequence[Tensor], outputs: Sequence[Tensor],
                           fields: Mapping[str, Any]) -> None:
    # The MXFP4 form has the same leading inputs and fields, then six packed tensors, not three.
    launch = routed_experts if len(inputs) == 6 else routed_experts_mxfp4
    launch(*inputs, fields["situ_beta"], fields["situ_linear_beta"], fields["expert_offset"], out=outputs[0])


def _bytes(words: Tensor, rows: int) -> Tensor:
    """int32 words (k3export/ops/mxfp4.py, "Words": [E, O*K/8] codes, [E, O*K/128] scales) viewed back as the
    bytes the torch.ops.k3 MXFP4 references take ([E, O, K/2], [E, O, K/32] uint8), O = `rows`."""
    return words.contiguous().view(torch.uint8).view(words.shape[0], rows, -1)


def _mxfp4_bytes(inputs: Sequence[Tensor]) -> list[Tensor]:
    """RoutedExpertsMXFP4's words as bytes: O is I (the intermediate width) for w1 / w3 and L (z's width)
    for w2."""
    z, rest, words = inputs[0], list(inputs[:3]), inputs[3:]
    L = z.shape[-1]
    intermediate = words[0].shape[1] * 8 // L
    return rest + [_bytes(w, L if i >= 4 else intermediate) for i, w in enumerate(words)]


def _routed_experts(name: str, weights: tuple[str, ...], weight_dtypes: tuple[str, ...],
                    reference_inputs: Callable[[Sequence[Tensor]], list[Tensor]] | None = None
                    ) -> PluginDefinition:
    """k3.RoutedExperts / k3.RoutedExpertsMXFP4 (k3export/onnx/moe.py): z [N, L] in the model dtype,
    experts [N, k] int64 (the model's expert indices), weights [N, k] float32, the tensors of the E
    experts held (model experts expert_offset .. expert_offset + E - 1; pairs routed to others add
    nothing); u [N, L] float32."""
    return PluginDefinition(
        name=name,
        fields=(Field("situ_beta", float), Field("situ_linear_beta", float), Field("expert_offset", int, 0)),
        inputs=(TensorArg("z", "T"), TensorArg("experts", "TI"), TensorArg("weights", "TR"),
                *(TensorArg(w, "TW") for w in weights)),
        outputs=(TensorArg("u", "TU"),),
        groups={"T": FLOATS, "TI": ("int64",), "TR": ("float32",), "TW": weight_dtypes, "TU": ("float32",)},
        output_shapes=lambda dims, fields, constant: [list(dims[0])],
        launch=_launch_routed_experts,
        reference_inputs=reference_inputs,
    )


ROUTED_EXPERTS = _routed_experts("RoutedExperts", ("w1", "w3", "w2"), FLOATS)
# The packed experts arrive as int32 words holding the checkpoint's bytes (k3export/ops/mxfp4.py, "Words"):
# the export declares them so, since TensorRT-RTX 1.7's parser widens UINT8 initializers to INT32
# (one byte per int32) but keeps INT32 ones as they are. The kernels read the words.
ROUTED_EXPERTS_MXFP4 = _routed_experts(
    "RoutedExpertsMXFP4", tuple(f"{w}_{part}" for w in ("w1", "w3", "w2") for part in ("packed", "scale")),
    ("int32",), _mxfp4_bytes)

# Exports of 2026-11/12 name the routed experts version 2: the same plugins. (Version 1 is the one
# full TensorRT's tensorrt.plugin can register: it sets every plugin's version to "1".)
ROUTED_EXPERTS_V2, ROUTED_EXPERTS_MXFP4_V2 = (dataclasses.replace(d, version="2")
                                              for d in (ROUTED_EXPERTS, ROUTED_EXPERTS_MXFP4))


# The routed experts as exports since 2026-12 hold them (k3export/onnx/moe.py): the pairs grouped by expert,
# gate/up, down (each one launch with no workspace, so that full TensorRT's AOT plugins run them grouped), the
# intermediates graph tensors; each token's slots are summed in standard ops after them.
GROUP_DTYPES = {"TI": ("int64",), "TS": ("int32",)}

ROUTED_EXPERTS_GROUP = PluginDefinition(
    name="RoutedExpertsGroup",
    fields=(Field("num_experts", int), Field("expert_offset", int, 0)),
    inputs=(TensorArg("experts", "TI"),),
    outputs=(TensorArg("sorted_pairs", "TS"), TensorArg("offsets", "TS"), TensorArg("slots", "TS")),
    groups=GROUP_DTYPES,
    # sorted_pairs [N k], offsets [E + 1], slots [N, k] for experts [N, k].
    output_shapes=lambda dims, fields, constant: [[dims[0][0] * dims[0][1]],
                                                  [constant(fields["num_experts"] + 1)], list(dims[0])],
    launch=lambda inputs, outputs, fields: group_pairs(inputs[0], fields["num_experts"],
                                                       fields["expert_offset"], Grouping(*outputs)),
)


def _weights(inputs: Sequence[Tensor], dtype: torch.dtype,
             packed: bool) -> list[tuple[Tensor, Tensor | None]]:
    # (weight, None) in the activations' dtype, or (codes, scales) words, per projection.
    if packed:
        return [(w.contiguous(), s.contiguous()) for w, s in zip(inputs[::2], inputs[1::2], strict=True)]
    return [(w.to(dtype).contiguous(), None) for w in inputs]


def _launch_gate_up(inputs: Sequence[Tensor], outputs: Sequence[Tensor], fields: Mapping[str, Any]) -> None:
    z, sorted_pairs, offsets, *weights = inputs
    w1, w3 = _weights(weights, z.dtype, len(weights) == 4)
    gate_up(z.contiguous(), sorted_pairs, offsets, w1, w3, fields["situ_beta"], fields["situ_linear_beta"],
            outputs[0])


def _launch_down(inputs: Sequence[Tensor], outputs: Sequence[Tensor], fields: Mapping[str, Any]) -> None:
    h, offsets, *weights = inputs
    (w2,) = _weights(weights, h.dtype, len(weights) == 2)
    down(h, offsets, w2, outputs[0])


def _weight_rows(dims: Sequence[Sequence[Any]], weight: int, packed: bool) -> Any:
    # A weight's rows O (w [E, O, K]), or from its words: 8 words / K, K the first input's width.
    return dims[weight][1] * 8 // dims[0][1] if packed else dims[weight][1]


def _grouped(name: str, inputs: tuple[str, ...], weights: tuple[str, ...], output: TensorArg,
             fields: tuple[Field, ...], launch: Callable[..., None]) -> PluginDefinition:
    """RoutedExpertsGateUp(MXFP4) (z [N, L], sorted_pairs, offsets, w1, w3 -> h [N k, I] in z's dtype) or
    RoutedExpertsDown(MXFP4) (h, offsets, w2 -> y [N k, L] float32): the experts in a float dtype or as int32
    words (k3export/ops/mxfp4.py, "Words"), which the references take as the checkpoint's bytes."""
    packed = weights[0].endswith("_packed")
    first = len(inputs)  # the first weight's index
    pairs = 1 if output.name == "h" else 0  # the input whose first dim is N k: sorted_pairs, or h

    def reference_inputs(tensors: Sequence[Tensor]) -> list[Tensor]:
        rows = tensors[first].shape[1] * 8 // tensors[0].shape[1]
        return [*tensors[:first], *(_bytes(w, rows) for w in tensors[first:])]

    return PluginDefinition(
        name=name, fields=fields,
        inputs=(TensorArg(inputs[0], "T"), *(TensorArg(n, "TS") for n in inputs[1:]),
                *(TensorArg(w, "TW") for w in weights)),
        outputs=(output,),
        groups={"T": FLOATS, **GROUP_DTYPES, "TW": ("int32",) if packed else FLOATS, "TY": ("float32",)},
        output_shapes=lambda dims, fields, constant: [[dims[pairs][0], _weight_rows(dims, first, packed)]],
        launch=launch, reference_inputs=reference_inputs if packed else None)


_BETAS = (Field("situ_beta", float), Field("situ_linear_beta", float))
_GATE_UP = ("z", "sorted_pairs", "offsets")
ROUTED_EXPERTS_GATE_UP = _grouped("RoutedExpertsGateUp", _GATE_UP, ("w1", "w3"), TensorArg("h", "T"), _BETAS,
                                  _launch_gate_up)
ROUTED_EXPERTS_GATE_UP_MXFP4 = _grouped(
    "RoutedExpertsGateUpMXFP4", _GATE_UP, ("w1_packed", "w1_scale", "w3_packed", "w3_scale"),
    TensorArg("h", "T"), _BETAS, _launch_gate_up)
ROUTED_EXPERTS_DOWN = _grouped("RoutedExpertsDown", ("h", "offsets"), ("w2",), TensorArg("y", "TY"), (),
                               _launch_down)
ROUTED_EXPERTS_DOWN_MXFP4 = _grouped("RoutedExpertsDownMXFP4", ("h", "offsets"), ("w2_packed", "w2_scale"),
                                     TensorArg("y", "TY"), (), _launch_down)
GROUPED_EXPERTS = (ROUTED_EXPERTS_GROUP, ROUTED_EXPERTS_GATE_UP, ROUTED_EXPERTS_GATE_UP_MXFP4,
                   ROUTED_EXPERTS_DOWN, ROUTED_EXPERTS_DOWN_MXFP4)

DEFINITIONS: tuple[PluginDefinition, ...] = (KDA, KDA_PREPARE, KDA_CHUNK_RECURRENCE, LATENT_MLA,
                                             LATENT_MLA_SPLITS, LATENT_MLA_COMBINE, ROUTED_EXPERTS,
                                             ROUTED_EXPERTS_MXFP4, ROUTED_EXPERTS_V2, ROUTED_EXPERTS_MXFP4_V2,
                                             *GROUPED_EXPERTS)
