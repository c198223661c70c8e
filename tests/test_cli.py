import importlib.util
import json
import subprocess
import sys

from k3export.cli import main


def test_info_kimi_k3(capsys):
    assert main(["info", "--preset", "kimi-k3"]) == 0
    out = capsys.readouterr().out
    assert "2.7795T total, 104.19B active per token" in out
    assert "(53.3x)" in out
    # 16 chosen experts x 3 projections x 3584 x 3072 multiply-adds x 2 FLOPs = 1.057e9 per token per layer.
    assert "1.06 GFLOP in the top-16 of 896 routed experts" in out


def test_info_json_from_config_file(tmp_path, capsys, tiny_config):
    tiny_config.to_json(tmp_path / "config.json")
    assert main(["info", "--config", str(tmp_path / "config.json"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"]["total"] == sum(report["parameters"]["by_component"].values())


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"linear_attn_config": {"full_attn_layers": [200]}}))
    assert main(["info", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "'linear_attn_config.full_attn_layers'" in err


def test_demo_runs_the_pipeline(tmp_path):
    """The demo twice into one folder: a rerun is never refused and trips no hash check."""
    command = [sys.executable, "-m", "k3export.cli", "demo", "--steps", "4", "--out", str(tmp_path / "demo")]
    for _ in range(2):
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    assert "relative error" in result.stdout and "(ok)" in result.stdout
    assert "6 KDA, 3 LatentMLA, 8 RoutedExperts nodes" in result.stdout and "PASSED (float32" in result.stdout
    assert (tmp_path / "demo" / "export" / "model.onnx").exists()
    report = tmp_path / "demo" / "report"
    assert (report / "report.md").read_text().startswith("# k3export check --onnx")
    assert (report / "layers.png").exists() and "first divergent: none" in result.stdout
    if importlib.util.find_spec("tensorrt_rtx"):
        assert f"$ k3export check --network {tmp_path / 'demo' / 'export'}" in result.stdout
