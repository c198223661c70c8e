"""Sharded builds of engines/k3-tiny.toml: stage graphs that chain by name, dtype and shape (read
from the ONNX files), resume after an interruption, files held to the manifest by sha256, and the
TensorRT-RTX build with one engine per stage."""

import importlib.util
import itertools
from pathlib import Path
from typing import Any

import onnx
import pytest

from k3export.artifacts import verify
from k3export.cli import main
from k3export.errors import UserError
from k3export.recipe import load_recipe
from k3export.stages import MANIFEST, build_recipe

TINY = Path(__file__).resolve().parents[1] / "engines/k3-tiny.toml"


class Interrupted(Exception):
    """Raised by the test hook after the first stage: a build stopped part way."""


def count_calls(mp: pytest.MonkeyPatch) -> dict[str, list[range]]:
    """Records the layer range of every stage export and engine build (exports are byte-identical,
    so hashes cannot tell a rebuilt stage from a skipped one)."""
    import k3export.engine.build as engine
    import k3export.onnx.export as export

    calls: dict[str, list[range]] = {"export": [], "engine": []}
    real_export, real_engine = export.export_model, engine.build_engine

    def export_model(model, out_dir, layers, *args, **kwargs):
        calls["export"].append(layers)
        return real_export(model, out_dir, layers, *args, **kwargs)

    def build_engine(export_dir, out, **kwargs):
        calls["engine"].append(Path(export_dir))
        return real_engine(export_dir, out, **kwargs)

    mp.setattr(export, "export_model", export_model)
    mp.setattr(engine, "build_engine", build_engine)
    return calls


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


@pytest.fixture(scope="session")
def onnx_build(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """engines/k3-tiny.toml with the onnx backend, built as a user would live through it: stopped
    after its first stage, rerun (resume), then one file altered and rerun (that stage rebuilt)."""
    out = tmp_path_factory.mktemp("shards") / "tiny"
    recipe = load_recipe(TINY)
    runs: dict[str, Any] = {}

    def stop_after_first(index: int) -> None:
        if index == 0:
            raise Interrupted

    with pytest.MonkeyPatch.context() as mp:
        calls = count_calls(mp)
        with pytest.raises(Interrupted):
            build_recipe(recipe, out, backend="onnx", after_stage=stop_after_first, log=lambda _: None)
        runs["interrupted"] = list(calls["export"])
        calls["export"].clear()
        manifest = build_recipe(recipe, out, backend="onnx", log=lambda _: None)
        runs["resumed"] = list(calls["export"])
        calls["export"].clear()
        flip_byte(out / "stage-1/model.onnx.data")
        with pytest.raises(UserError) as refused:
            verify(out, MANIFEST, full=True)
        runs["refused"] = str(refused.value)
        build_recipe(recipe, out, backend="onnx", log=lambda _: None)
        runs["rebuilt"] = list(calls["export"])
    runs["ranges"] = [range(*s["layers"]) for s in manifest["stages"]]
    return out, runs


def test_resume_skips_finished_stages(onnx_build) -> None:
    _, runs = onnx_build
    first, second = runs["ranges"]
    assert runs["interrupted"] == [first]
    assert runs["resumed"] == [second]  # stage 0 was not exported again


def test_altered_file_refused_and_its_stage_rebuilt(onnx_build) -> None:
    out, runs = onnx_build
    assert "stage-1/model.onnx.data" in runs["refused"] and "sha256" in runs["refused"]
    assert runs["rebuilt"] == [runs["ranges"][1]]
    verify(out, MANIFEST, full=True)  # whole again


def graph_io(path: Path) -> tuple[dict, dict]:
    """name -> (element type, dims) of the graph's inputs and outputs, as the file declares them."""
    model = onnx.load(path, load_external_data=False)

    def spec(value: onnx.ValueInfoProto) -> tuple[int, list[int | str]]:
        tensor = value.type.tensor_type
        return tensor.elem_type, [d.dim_param or d.dim_value for d in tensor.shape.dim]

    return ({v.name: spec(v) for v in model.graph.input}, {v.name: spec(v) for v in model.graph.output})


def test_stage_outputs_are_next_stage_inputs(onnx_build) -> None:
    out, runs = onnx_build
    files = [graph_io(out / f"stage-{i}/model.onnx") for i in range(len(runs["ranges"]))]
    assert "input_ids" in files[0][0] and "logits" in files[-1][1]
    for (inputs_a, outputs_a), (inputs_b, _) in itertools.pairwise(files):
        sent = {n: s for n, s in outputs_a.items() if not n.startswith("present.")}
        # What the next stage takes beyond its own caches and the per-row inputs every stage takes.
        received = {n: s for n, s in inputs_b.items() if not n.startswith("past.") and n not in inputs_a}
        assert sent and sent == received
    assert [i for r in runs["ranges"] for i in r] == list(range(load_recipe(TINY).config.num_hidden_layers))


def test_refuses_a_folder_of_user_files(tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["build", str(TINY), "--out", str(tmp_path), "--backend", "onnx"]) == 2
    assert "notes.txt" in capsys.readouterr().err and (tmp_path / "notes.txt").read_text() == "mine"
    assert main(["build", str(TINY), "--out", str(tmp_path / "new"), "--stage", "7"]) == 2


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt_rtx is not installed")
def test_tensorrt_rtx_build(tmp_path: Path) -> None:
    recipe = load_recipe(TINY)
    with pytest.MonkeyPatch.context() as mp:
        calls = count_calls(mp)
        manifest = build_recipe(recipe, tmp_path, log=lambda _: None)
    assert manifest["backend"] == "tensorrt-rtx" and len(calls["engine"]) == recipe.stage_count
    engines = [tmp_path / s["engine"] for s in manifest["stages"]]
    assert all(e.is_file() and e.stat().st_size > 0 and s["engine"] in manifest["files"]
               for e, s in zip(engines, manifest["stages"], strict=True))
    verify(tmp_path, MANIFEST, full=True)
    flip_byte(engines[0])
    with pytest.raises(UserError, match="sha256"):
        verify(tmp_path, MANIFEST, full=True)
