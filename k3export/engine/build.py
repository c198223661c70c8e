"""Builds a TensorRT(-RTX) engine from an export folder, with the k3 plugins in place of the functions.

    k3export build --onnx EXPORT_DIR --out model.engine --target sm89                       # TensorRT-RTX
    k3export build --onnx EXPORT_DIR --out model.engine --backend tensorrt --target sm90    # on an H200

The builder takes the TensorRT module as a parameter; what differs between the flavours is the table
in flavours.py. One engine serves both graphs of the export as two optimization profiles, each with
its own ranges: 0 prefill (batch 1..Bp, seq 1..N) and 1 decode (batch 1..Bd, seq 1). The MLA caches
[batch, 1, capacity, latent] keep the export's static capacity (TensorRT's in-place KV_CACHE_UPDATE,
which the parser makes of the graph's TensorScatter, needs it), and cache_lengths / input_lengths
[batch] int64 are plain execution inputs (their values never shape a tensor). TensorRT-RTX builds
with no GPU for a named compute capability (SM75..SM121 less SM90); an engine cannot be
deserialized without a GPU, so nothing here has run one: whether the KV_CACHE_UPDATE layers and the
KDA plugin's aliased state really write in place is TensorRT's promise, not our measurement.

The parser silently inlines a k3 node's ONNX function when no creator matches its name,
plugin_version and plugin_namespace: Scan loops for KDA (a correct but slow engine), and for the
routed experts a body it cannot import (NonZero), failing with a message that names neither the
node nor its plugin; so the builder checks every k3 node against the registry first and refuses
with a message that says which.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import onnx

from k3export.artifacts import atomic_path, require, verify
from k3export.engine.flavours import (
    flavour_of,
    network_flags,
    register_plugins,
    require_machine,
    target_problem,
)
from k3export.engine.trt_log import tensorrt_logger
from k3export.errors import UserError
from k3export.model.accounting import H200_BYTES
from k3export.onnx.domain import DOMAIN
from k3export.onnx.export import GRAPH_FILE, MANIFEST_FILE
from k3export.onnx.runner import CALL_TOKENS_PER_DRAFT
from k3export.options import call_bytes

# Layers through which a tensor is still the MLA cache (its rows moved or retyped, not combined).
_CACHE_PRESERVING = ("CAST", "IDENTITY", "SHUFFLE", "SLICE", "CONCATENATION", "KV_CACHE_UPDATE")


@dataclass(frozen=True)
class Limits:
    """The largest shapes each profile takes: prefill batch x seq tokens, decode batch x 1, and with
    `verify_seq` a verify profile, decode batch x verify_seq tokens (`run --speculate K`'s calls, up to
    3K + 1 tokens a row: tokens re-fed after rejections and up to K drafts; the cache capacity is the
    export's). A profile sized for the other's batch would make
    TensorRT reserve context memory for shapes never served (kimi-k3: 8 x 8192 prefill tokens instead of
    1 x 8192)."""

    prefill_batch: int = 4
    prefill_seq: int = 256  # prefill tokens per call, at most the capacity
    decode_batch: int = 4
    verify_seq: int = 0  # tokens a row of a verify call, at most the capacity; 0: no verify profile

    def ranges(self) -> dict[str, dict[str, tuple[int, int, int]]]:
        """Profile name -> dim name -> (min, opt, max)."""
        ranges = {"prefill": {"batch": (1, self.prefill_batch, self.prefill_batch),
                              "seq": (1, self.prefill_seq, self.prefill_seq)},
                  "decode": {"batch": (1, self.decode_batch, self.decode_batch), "seq": (1, 1, 1)}}
        if self.verify_seq:
            ranges["verify"] = {"batch": (1, self.decode_batch, self.decode_batch),
                                "seq": (1, self.verify_seq, self.verify_seq)}
        return ranges


@dataclass
class NetworkSummary:
    layers: int
    layer_types: dict[str, int]
    plugin_layers: list[str]  # "name: namespace::type v<version>" of each plugin layer
    plugin_fields: dict[str, list[dict[str, Any]]]  # op -> fields of each plugin created, in order
    kv_cache_updates: list[str]  # KV_CACHE_UPDATE layers: "name: cache input -> output"
    cache_concats: list[str]  # CONCATENATION layers on an MLA cache (a copy of it): want none


@dataclass
class BuildResult:
    engine: str
    backend: str
    target: str
    stripped: bool  # weight-stripped: load_engine refits it from the export's model.onnx
    profiles: list[dict[str, dict[str, list[int]]]]  # per profile: input -> [min, opt, max] shapes
    device_memory: list[dict[str, Any]]  # per profile: name, bytes, source (see profile_memory)
    bytes: int
    seconds: float
    network: NetworkSummary = field(repr=False)


# k3 ops with no plugin, whose ONNX function the parser inlines: none since k3plugins.moe (the routed
# experts were, until then).
FUNCTION_ONLY_OPS: frozenset[str] = frozenset()


def check_plugins(model_path: Path, trt: ModuleType) -> None:
    """Raises if a k3 node names a plugin that `trt`'s registry lacks (the parser would inline it)."""
    model = onnx.load(model_path, load_external_data=False)
    registry = trt.get_plugin_registry()
    for node in model.graph.node:
        if node.domain != DOMAIN or node.op_type in FUNCTION_ONLY_OPS:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        version = attrs.get("plugin_version", b"").decode()
        namespace = attrs.get("plugin_namespace", b"").decode()
        if registry.get_creator(node.op_type, version, namespace) is None:
            known = sorted(f"{c.plugin_namespace}::{c.name} v{c.plugin_version}"
                           for c in registry.all_creators if c.plugin_namespace == DOMAIN)
            raise UserError(
                f"{model_path}: node {node.name!r} ({DOMAIN}.{node.op_type}) asks for plugin "
                f"{namespace}::{node.op_type} version {version!r}, which is not registered "
                f"(registered k3 plugins: {', '.join(known) or 'none'}); without it the parser would "
                f"inline the node's ONNX function. Call k3export.engine.flavours.register_plugins(trt) "
                f"before parsing, or "
                f"export again with this k3plugins' plugin version.")


def parse(model_path: Path, trt: ModuleType, logger: Any, *, strict: bool = True) -> tuple[Any, Any, Any]:
    """(builder, network, parser) for `model_path`. `strict` checks the k3 nodes' plugins first."""
    if strict:
        check_plugins(model_path, trt)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(model_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UserError(f"{model_path}: the {flavour_of(trt).title} ONNX parser refused it: {errors}")
    return builder, network, parser


def summarize(network: Any, trt: ModuleType, creators: dict[str, Any] | None = None) -> NetworkSummary:
    """Layer counts by type, the plugin layers, the fields each creator was given, and the census of
    the MLA caches (`cache_census`)."""
    types: Counter[str] = Counter()
    plugins = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        types[layer.type.name] += 1
        if layer.type == trt.LayerType.PLUGIN_V3:
            layer.__class__ = trt.IPluginV3Layer  # the network hands out plain ILayer objects
            core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
            plugins.append(f"{layer.name}: {core.plugin_namespace}::{core.plugin_name} "
                           f"v{core.plugin_version}")
    fields = {name: list(c.created) for name, c in (creators or {}).items()}
    updates, concats = cache_census(network)
    return NetworkSummary(network.num_layers, dict(types), plugins, fields, updates, concats)


def is_mla_cache(name: str) -> bool:
    """Whether a network input is an MLA cache (`past.{i}.mla_latent`, export.py's name)."""
    return name.startswith("past.") and name.endswith(".mla_latent")


def cache_census(network: Any) -> tuple[list[str], list[str]]:
    """(KV_CACHE_UPDATE layers, CONCATENATION layers on a cache) of a parsed network. A tensor is a
    cache if it is an MLA cache input or comes from one through layers that only move, retype or
    update its rows (_CACHE_PRESERVING); a Concat among those copies the cache, which an in-place
    update avoids. Shape layers and the attention plugin read a cache without passing it on."""
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    caches = {network.get_input(i).name for i in range(network.num_inputs)
              if is_mla_cache(network.get_input(i).name)}
    updates, concats = [], []
    for layer in layers:  # the network's layers are in topological order
        inputs = [layer.get_input(j) for j in range(layer.num_inputs)]
        names = [t.name for t in inputs if t is not None]
        if layer.type.name not in _CACHE_PRESERVING or not caches.intersection(names):
            continue
        outputs = [layer.get_output(k).name for k in range(layer.num_outputs)]
        caches.update(outputs)
        if layer.type.name == "KV_CACHE_UPDATE":
            updates.append(f"{layer.name}: {names[0]} -> {outputs[0]}")
        elif layer.type.name == "CONCATENATION":
            concats.append(f"{layer.name}: {', '.join(names)} -> {outputs[0]}")
    return updates, concats


def profile_shapes(manifest: dict[str, Any], limits: Limits) -> list[dict[str, list[list[int]]]]:
    """[prefill, decode(, verify)]: input name -> [min, opt, max] shapes from export.json's named dims
    ("batch", "seq" dynamic, each profile its own ranges; "capacity" the export's static cache rows)."""
    capacity = manifest.get("capacity")
    if capacity is None:
        raise UserError("export.json has no \"capacity\": an export made before fixed-capacity caches; "
                        "export it again (k3export export ... --capacity N)")
    if not 1 <= limits.prefill_seq <= capacity or min(limits.prefill_batch, limits.decode_batch) < 1:
        raise UserError(f"build: --max-seq {limits.prefill_seq}, --max-batch {limits.prefill_batch} and "
                        f"--decode-batch {limits.decode_batch}: expected batches >= 1 and 1 <= seq <= the "
                        f"export's capacity {capacity} (every call writes its seq rows into the cache)")
    if limits.verify_seq and not 2 <= limits.verify_seq <= capacity:
        raise UserError(f"build: --verify-seq {limits.verify_seq}: expected 2 <= seq <= the export's "
                        f"capacity {capacity} (a verify call feeds a token and at least one draft)")
    ranges = limits.ranges()
    # An engine whose inputs and outputs alone outgrow the largest GPU could run nowhere (and a
    # profile far past it makes the TensorRT-RTX builder abort the process).
    options = {"prefill": f"--max-batch {limits.prefill_batch} --max-seq {limits.prefill_seq}",
               "decode": f"--decode-batch {limits.decode_batch}",
               "verify": f"--verify-seq {limits.verify_seq} --decode-batch {limits.decode_batch}"}
    for name, dims in ranges.items():
        needed = call_bytes([manifest], dims["batch"][2], dims["seq"][2])
        if needed > H200_BYTES:
            raise UserError(f"build: {options[name]} (the {name} profile, batch {dims['batch'][2]} x seq "
                            f"{dims['seq'][2]}): the engine's inputs and outputs at that shape hold "
                            f"{needed / 1e9:,.1f} GB, more than an H200's {H200_BYTES / 1e9:.0f} GB; lower "
                            f"{options[name].split()[0]}{' or --max-seq' if name == 'prefill' else ''}"
                            f"{' or --decode-batch' if name == 'verify' else ''}")
    profiles = []
    for dims in ranges.values():
        dims["capacity"] = (capacity,) * 3
        shapes = {}
        for spec in manifest["inputs"]:
            shapes[spec["name"]] = [[dims[d][k] if isinstance(d, str) else d for d in spec["shape"]]
                                    for k in range(3)]
        profiles.append(shapes)
    return profiles


def profile_memory(manifest: dict[str, Any], limits: Limits, engine: Any = None) -> list[dict[str, Any]]:
    """Per profile, the device memory TensorRT sizes for its execution contexts: the engine's own
    figure (`get_device_memory_size_for_profile_v2`) when a deserialized `engine` is given, else an
    estimate, a lower bound: the profile's inputs and outputs at its largest shapes. Each entry says
    which it is; the verify profile's, the largest K of `run --speculate K` it takes."""
    memory = []
    for index, (name, dims) in enumerate(limits.ranges().items()):
        if engine is not None:  # GPU only: an engine deserializes only where its GPU is
            memory.append({"profile": name, "bytes": engine.get_device_memory_size_for_profile_v2(index),
                           "source": "get_device_memory_size_for_profile_v2"})
        else:
            memory.append({"profile": name, "bytes": call_bytes([manifest], dims["batch"][2], dims["seq"][2]),
                           "source": "estimate: the profile's inputs and outputs at its largest shapes "
                                     "(a lower bound; TensorRT's figure needs the engine deserialized on "
                                     "its GPU)"})
    if limits.verify_seq:  # run --speculate K's calls take up to 3K + 1 tokens a row
        memory[-1]["speculate_up_to"] = (limits.verify_seq - 1) // CALL_TOKENS_PER_DRAFT
    return memory


def build_engine(export_dir: str | Path, out: str | Path, trt: ModuleType, *, target: str,
                 limits: Limits | None = None, strip: bool = False,
                 manifest: dict[str, Any] | None = None) -> BuildResult:
    """Parses export_dir/model.onnx with the k3 plugins of `trt`'s flavour registered and writes an
    engine to `out` (through a temporary name) for `target`, with the prefill and decode profiles
    (and verify: `limits`).
    `trt` is `tensorrt_rtx` or `tensorrt` (flavours.load_tensorrt); a target the flavour cannot build
    on this machine is refused first. `strip`: a weight-stripped engine (STRIP_PLAN, REFIT_IDENTICAL),
    which `load_engine` refits from the export's model.onnx. The folder is verified against its
    export.json first, unless the caller passes the `manifest` export_model just returned (a stage
    build's staged folder, whose file list is written when it completes)."""
    flavour = flavour_of(trt)
    problem = target_problem(flavour, target)
    if problem:
        raise UserError(f"--target {target!r}: expected {problem}")
    require_machine(flavour, target, strip=strip)
    start = time.perf_counter()
    export_dir, out = Path(export_dir), Path(out)
    if manifest is None:
        manifest = verify(export_dir, MANIFEST_FILE)
    require(manifest, export_dir / MANIFEST_FILE, "inputs")
    limits = limits or Limits()
    profiles = profile_shapes(manifest, limits)
    logger = tensorrt_logger(trt)
    creators = register_plugins(trt)
    # The parser owns the weights the network points at: keep it alive until the build is done.
    builder, network, _parser = parse(export_dir / GRAPH_FILE, trt, logger)
    summary = summarize(network, trt, creators)

    config = builder.create_builder_config()
    if flavour.targets is not None:
        # The list of targets is empty until sized; set_compute_capability fails (returns False) before.
        config.num_compute_capabilities = 1
        if not config.set_compute_capability(getattr(trt.ComputeCapability, target.upper()), 0):
            raise UserError(f"--target {target}: {flavour.title} refused this compute capability")
    # KDA's final state aliases its initial state (k3plugins' get_aliased_input): a preview feature,
    # without which the build refuses the plugin.
    for feature in flavour.preview_features:
        config.set_preview_feature(getattr(trt.PreviewFeature, feature), True)
    if strip:  # the weights stay in model.onnx.data, once; REFIT_IDENTICAL: refitted with these same values
        config.set_flag(trt.BuilderFlag.STRIP_PLAN)
        config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)
    for shapes in profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    # Streamed to the file as the builder serializes it: build_serialized_network would hold the
    # whole engine (about the weights' size) in an IHostMemory on top of the builder's own copies.
    with atomic_path(out) as tmp, open(tmp, "wb") as f:
        writer = _file_writer(trt, f)
        built = builder.build_serialized_network_to_stream(network, config, writer)
        if writer.error is not None:
            raise UserError(f"{out}: writing the engine failed: {writer.error}") from writer.error
        if not built:
            raise UserError(f"{export_dir / GRAPH_FILE}: {flavour.title} could not build an engine for "
                            f"{target} (see the log above)")
    memory = profile_memory(manifest, limits, deserialize(trt, logger, out) if flavour.needs_gpu else None)
    return BuildResult(str(out), flavour.backend, target, strip, profiles, memory, out.stat().st_size,
                       time.perf_counter() - start, summary)


def load_engine(trt: ModuleType, logger: Any, path: Path, weights: Path) -> Any:
    """The engine at `path`, ready to run: deserialized from the file as a stream and, if it was
    built weight-stripped (the only refittable engines k3export builds), refitted from the ONNX file
    `weights` (its export's model.onnx, external data beside it). GPU only."""
    engine = deserialize(trt, logger, path)
    if engine.refittable:
        refitter = trt.Refitter(engine, logger)
        if not (trt.OnnxParserRefitter(refitter, logger).refit_from_file(str(weights))
                and refitter.refit_cuda_engine()):
            raise UserError(f"{path}: refitting its weights from {weights} failed (see the log); it was "
                            f"built from another export, or the export changed since")
    return engine


def deserialize(trt: ModuleType, logger: Any, path: Path) -> Any:
    """The engine at `path`, deserialized from the file as a stream (never read whole into host
    memory). GPU only."""
    runtime = trt.Runtime(logger)
    with open(path, "rb") as f:
        engine = runtime.deserialize_cuda_engine(_file_reader(trt, f))
    if engine is None:
        raise UserError(f"{path}: TensorRT could not deserialize the engine it just built (see the log)")
    return engine


def _file_writer(trt: ModuleType, f: Any) -> Any:
    """A trt.IStreamWriter writing the serialized engine to the open file `f` chunk by chunk. An
    exception in write() is kept in .error (raising through the C++ caller is not safe) and the
    write reports 0 bytes, which fails the build."""

    class FileWriter(trt.IStreamWriter):
        def __init__(self) -> None:
            trt.IStreamWriter.__init__(self)
            self.error: BaseException | None = None

        def write(self, data: bytes) -> int:
            if self.error is not None:
                return 0
            try:
                return f.write(data)
            except BaseException as e:  # reported by build_engine
                self.error = e
                return 0

    return FileWriter()


READ_CHUNK = 256 << 20  # what one read hands TensorRT at most: host memory stays at a chunk


def _file_reader(trt: ModuleType, f: Any) -> Any:
    """A trt.IStreamReaderV2 over the open file `f`, handing the engine to TensorRT in chunks."""

    class FileReader(trt.IStreamReaderV2):
        def __init__(self) -> None:
            trt.IStreamReaderV2.__init__(self)

        def read(self, num_bytes: int, stream: int) -> bytes:
            return f.read(min(num_bytes, READ_CHUNK))

        def seek(self, offset: int, where: Any) -> bool:
            whence = {"SET": 0, "CUR": 1, "END": 2}[where.name]
            f.seek(offset, whence)
            return True

    return FileReader()
