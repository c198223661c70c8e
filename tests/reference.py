"""Independent references and input generators shared by the tests."""

import json
import re
import shutil
from pathlib import Path

import onnx
import torch
from onnx import TensorProto

from k3export.artifacts import file_record


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm of the difference over the norm of the reference, over the whole tensor."""
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def kda_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, seed: int = 0):
    """Valid KDA op inputs: k L2-normed, beta in (0, 1), g in (-5, 0], q scaled by K^-0.5."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) * K**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -5 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) ** 4  # mostly mild decay
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    state = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    gate_dtype = state_dtype
    return (q.to(dtype), k.to(dtype), v.to(dtype), g.to(gate_dtype), beta.to(gate_dtype),
            state.to(state_dtype))


def scaled_copy(export: Path, folder: Path, name: str, factor: float) -> Path:
    """A copy of the export with initializer `name` (in the external data) multiplied by `factor`,
    export.json re-recorded so that the folder is consistent: a wrong weight, not a damaged file."""
    shutil.copytree(export, folder)
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.name == name)
    info = {e.key: e.value for e in tensor.external_data}
    data = folder / info["location"]
    raw = bytearray(data.read_bytes())
    start, length = int(info["offset"]), int(info["length"])
    dtype = {TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16,
             TensorProto.BFLOAT16: torch.bfloat16}[tensor.data_type]
    values = torch.frombuffer(raw[start:start + length], dtype=dtype) * factor
    raw[start:start + length] = values.to(dtype).view(torch.uint8).numpy().tobytes()
    data.write_bytes(bytes(raw))
    rerecord_file(folder, info["location"])
    return folder


def rerecord_file(folder: Path, name: str) -> None:
    """Records a changed file's new sha256 in its export folder's export.json."""
    manifest = json.loads((folder / "export.json").read_text())
    manifest["files"][name] = file_record(folder / name)
    (folder / "export.json").write_text(json.dumps(manifest))


# Layer 0's short convolution of k: it feeds the layer's KDA state, so present.0.kda_state moves.
PERTURBED = "model.model.layers.0.self_attn.k_conv1d.weight"


def without_headroom(line: str) -> str:
    """A verdict line less its headroom ("; worst X at R of its bound, ..."), whose last digits move
    with the CPU's float32 kernels."""
    return re.sub(r"; worst [^;]*", "", line)


def assert_eager_ran(streamed: dict, in_memory: dict, stages: list[list[int]]) -> None:
    """What two checks' eager sides ran (their reports' "eager" "ran", recorded as each span ran, not
    the plan): in memory, one span a stage; streamed, one layer a span, every layer once in order;
    both read the same weights, and no streamed span read as much as the largest stage."""
    ran = {name: [(r["layers"], r["bytes"]) for r in report["eager"]["ran"]]
           for name, report in (("streamed", streamed), ("in-memory", in_memory))}
    assert [layers for layers, _ in ran["in-memory"]] == stages
    first, last = stages[0][0], stages[-1][1]
    assert [layers for layers, _ in ran["streamed"]] == [[i, i + 1] for i in range(first, last)]
    assert sum(n for _, n in ran["streamed"]) == sum(n for _, n in ran["in-memory"]) > 0
    assert max(n for _, n in ran["streamed"]) < max(n for _, n in ran["in-memory"])
