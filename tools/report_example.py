"""The README's example report: a localisation run on k3-tiny with one layer's weight corrupted.

    python tools/report_example.py [--layer-weight layers.5.block_sparse_moe.routed_expert_up_proj.weight]

Exports k3-tiny (float32, seed 0) with --taps into a temporary folder, scales one weight by 1.5 in
the exported files (re-recording the file's sha256 in export.json so the folder still verifies),
runs `k3export check --onnx DIR --taps --steps 4 --prompt-len 24 --report REPORT`, and copies the
two plots to docs/report-layers.png and docs/report-steps.png. Prints the check's output.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx

from k3export.artifacts import file_record
from k3export.cli import main as k3export

DOCS = Path(__file__).resolve().parent.parent / "docs"


def scale_weight(folder: Path, suffix: str, factor: float) -> str:
    """Scales the float32 initializer named ...`suffix` in folder's external data; returns its name."""
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    target = next(t for t in model.graph.initializer if t.name.endswith(suffix))
    where = {e.key: e.value for e in target.external_data}
    data = bytearray((folder / "model.onnx.data").read_bytes())
    offset, length = int(where["offset"]), int(where["length"])
    values = np.frombuffer(data, np.float32, count=length // 4, offset=offset) * np.float32(factor)
    data[offset:offset + length] = values.tobytes()
    (folder / "model.onnx.data").write_bytes(bytes(data))
    manifest = json.loads((folder / "export.json").read_text())
    manifest["files"]["model.onnx.data"] = file_record(folder / "model.onnx.data")
    (folder / "export.json").write_text(json.dumps(manifest, indent=2))
    return target.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layer-weight", default="layers.5.block_sparse_moe.routed_expert_up_proj.weight")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        export, report = Path(tmp) / "export", Path(tmp) / "report"
        assert k3export(["export", "--preset", "k3-tiny", "--taps", "--quiet", "--out", str(export)]) == 0
        name = scale_weight(export, args.layer_weight, 1.5)
        print(f"\nscaled {name} by 1.5\n\n$ k3export check --onnx DIR --taps --steps 4 --prompt-len 24 "
              "--report REPORT")
        k3export(["check", "--onnx", str(export), "--taps", "--steps", "4", "--prompt-len", "24",
                  "--report", str(report), "--quiet"])
        for plot in ("layers", "steps"):
            shutil.copy(report / f"{plot}.png", DOCS / f"report-{plot}.png")
    print(f"wrote {DOCS / 'report-layers.png'} and {DOCS / 'report-steps.png'}")


if __name__ == "__main__":
    main()
