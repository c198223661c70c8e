"""k3-small (337M parameters, the published layer pattern) in every dtype and artifact: the eager side
streamed one layer at a time gives the in-memory eager side's report, number for number, and both
pass. k3-tiny's tests prove the same on every path in CI; this is the size the tests cannot afford
there (6 minutes on 2 cores, 2026-12-04): `pytest -m slow tests/test_k3_small.py`.

Artifacts: `--onnx` (ONNX Runtime; not bfloat16, which its CPU provider cannot run), `--network` (the
parsed TensorRT network on CPU), `--build` of a 2-stage chain and of a 2 x 2 grid (ONNX Runtime per
stage or rank, so float32 and float16). Half-precision artifacts carry their routing outputs, as a
user checks them.
"""

import json

import pytest
from reference import assert_eager_ran

from k3export.cli import main

pytestmark = pytest.mark.slow

CASES = [("float32", "onnx"), ("float32", "network"), ("float32", "chain"), ("float32", "grid"),
         ("float16", "onnx"), ("float16", "network"), ("float16", "chain"), ("float16", "grid"),
         ("bfloat16", "network")]
CHECK = ["--steps", "4", "--prompt-len", "24", "--json", "--quiet"]


def recipe(dtype: str, ranks: int) -> str:
    return f"""[model]
preset = "k3-small"
[weights]
seed = 0
dtype = "{dtype}"
[stages]
count = 2
[parallel]
ranks = {ranks}
[cache]
capacity = 64
batch = 2
[profiles]
prefill = {{ batch = 2, seq = 32 }}
decode = {{ batch = 2 }}
[build]
backend = "onnx"
routing_outputs = {"true" if dtype != "float32" else "false"}
"""


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], list[str]]:
    """(dtype, artifact) -> the check command's artifact arguments, each export and build made once."""
    root = tmp_path_factory.mktemp("k3-small")
    made: dict[tuple[str, str], list[str]] = {}
    for dtype in ("float32", "float16", "bfloat16"):
        export = root / f"export-{dtype}"
        routing = [] if dtype == "float32" else ["--routing-outputs"]
        assert main(["export", "--preset", "k3-small", "--seed", "0", "--dtype", dtype, "--capacity", "64",
                     *routing, "--out", str(export), "--quiet"]) == 0
        made[dtype, "network"] = ["--network", str(export)]
        if dtype == "bfloat16":
            continue
        made[dtype, "onnx"] = ["--onnx", str(export)]
        for kind, ranks in (("chain", 1), ("grid", 2)):
            (root / f"{kind}-{dtype}.toml").write_text(recipe(dtype, ranks))
            assert main(["build", str(root / f"{kind}-{dtype}.toml"), "--out", str(root / f"{kind}-{dtype}"),
                         "--quiet"]) == 0
            made[dtype, kind] = ["--build", str(root / f"{kind}-{dtype}")]
    return made


@pytest.mark.parametrize(("dtype", "artifact"), CASES)
def test_streamed_eager_side_gives_the_in_memory_report(artifacts: dict, dtype: str, artifact: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    reports = {}
    for mode in ("in-memory", "streamed"):
        assert main(["check", *artifacts[dtype, artifact], *CHECK, "--eager", mode]) == 0
        reports[mode] = json.loads(capsys.readouterr().out)
        assert reports[mode]["passed"] and reports[mode]["eager"]["mode"] == mode
    in_memory, streamed = reports["in-memory"], reports["streamed"]
    assert_eager_ran(streamed, in_memory, in_memory.get("stages", [[0, 9]]))
    # Here (unlike k3-tiny's few MB) the weights show in the process's peak: streaming lowers it.
    assert streamed["eager"]["peak_memory"] < in_memory["eager"]["peak_memory"]
    assert streamed["steps"] == in_memory["steps"]
    assert streamed.get("routing_flips") == in_memory.get("routing_flips")
    with capsys.disabled():  # what the note reports: each side's memory and time, the worst error
        print(json.dumps({"case": [dtype, artifact], "worst_rel": max(
            o["rel"] for step in streamed["steps"] for o in step["outputs"]), **{
            mode: {key: r["eager"][key] for key in ("seconds", "peak_memory", "bytes_read")}
            for mode, r in reports.items()}}))
