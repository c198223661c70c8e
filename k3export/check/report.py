"""`k3export check --report DIR`: a check's report as files a person reads.

    DIR/report.json   every number of the check, the verdict, and the series each plot draws
                      (read back from the plotted lines, so they are what the PNGs show)
    DIR/report.md     the verdict first, then the worst outputs, the first divergent layer, the
                      error per layer and the token agreement per step
    DIR/layers.png    relative error per layer (log scale), prefill and decode side by side: with
                      taps (export --taps) one line per sublayer and the envelope, the first
                      divergent tap marked; without, the layer's caches (present.{i}.*)
    DIR/steps.png     the logits' relative error over the prefill and decode steps, and its bound
                      (a layer range without logits: the worst output of each step)
    DIR/check.json    the folder's manifest (sha256 of each file), as DIR/check has

A sharded build's report (check --build) adds a table of its stages, each one's worst output.

Written through k3export.artifacts.OutputDir: a new or empty folder, or one a check wrote.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from k3export.artifacts import REPORT, OutputDir, write_atomic, write_json
from k3export.check.machine import machine_line
from k3export.check.taps import per_layer
from k3export.errors import UserError
from k3export.onnx.taps import SUBLAYERS

MANIFEST = "check.json"
# Log-scale plots cannot draw 0: a relative error of exactly 0 is drawn (and recorded) at this floor.
FLOOR = 1e-12
_CACHE = re.compile(r"present\.(\d+)\.")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def step_outputs(step: dict[str, Any]) -> list[dict[str, Any]]:
    """A step's output comparisons (check --build's include each stage's boundary outputs)."""
    return step["outputs"]


def layer_series(report: dict[str, Any], phase: str) -> dict[str, dict[int, float]]:
    """Per curve, layer -> relative error for `phase` ("prefill", or "decode": the largest over
    the decode steps). With taps one curve per sublayer and "envelope" (the smallest bound); without,
    "caches": the largest error of the layer's present caches."""
    steps = [s for s in report["steps"] if (s["step"] == "prefill") == (phase == "prefill")]
    if not steps:
        return {}
    if report.get("taps"):
        labels = {s["step"] for s in steps}
        tap_steps = [s for s in report["taps"]["steps"] if s["step"] in labels]
        rows = per_layer(tap_steps)
        series = {s: {row["layer"]: max(row[s]["rel"], FLOOR) for row in rows} for s in SUBLAYERS}
        series["envelope"] = {row["layer"]: min(row[s]["bound"] for s in SUBLAYERS) for row in rows}
        return series
    caches: dict[int, float] = {}
    for step in steps:
        for c in step_outputs(step):
            match = _CACHE.match(c["name"])
            if match:
                layer = int(match.group(1))
                caches[layer] = max(caches.get(layer, FLOOR), c["rel"])
    return {"caches": dict(sorted(caches.items()))}


def step_series(report: dict[str, Any]) -> tuple[str, list[str], list[float], list[float]]:
    """(what, step labels, relative error, bound) per step: the logits, or the worst output."""
    labels, rel, bound = [], [], []
    has_logits = any(c["name"] == "logits" for c in step_outputs(report["steps"][0]))
    for step in report["steps"]:
        outputs = step_outputs(step)
        c = (next(c for c in outputs if c["name"] == "logits") if has_logits
             else max(outputs, key=lambda c: c["rel"]))
        labels.append(step["step"])
        rel.append(max(c["rel"], FLOOR))
        bound.append(c["bound"])
    return ("logits" if has_logits else "worst output"), labels, rel, bound


def _lines(ax: Any) -> dict[str, dict[str, list[float]]]:
    """The data of every labelled line on `ax`, as drawn."""
    return {line.get_label(): {"x": [float(x) for x in line.get_xdata()],
                               "y": [float(y) for y in line.get_ydata()]}
            for line in ax.get_lines() if not line.get_label().startswith("_")}


def plot_layers(report: dict[str, Any], path: Path, title: str) -> dict[str, Any]:
    """layers.png; returns the drawn series per panel."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    drawn = {}
    first = (report.get("taps") or {}).get("first_divergent")
    for ax, phase in zip(axes, ("prefill", "decode"), strict=True):
        for name, values in layer_series(report, phase).items():
            style = {"linestyle": "--", "color": "black"} if name == "envelope" else {"marker": "o"}
            ax.plot(list(values), list(values.values()), label=name, **style)
        heading = "prefill" if phase == "prefill" else "decode (worst step)"
        if first is not None and (first["step"] == "prefill") == (phase == "prefill"):
            ax.axvline(first["layer"], color="red", alpha=0.5)
            heading += f": first divergent layer {first['layer']} {first['sublayer']} (red)"
        for start, _ in (report.get("stages") or [])[1:]:  # check --build: where each stage begins
            ax.axvline(start - 0.5, color="gray", linestyle=":", alpha=0.7)
        ax.set_yscale("log")
        ax.set_xlabel("layer" + (" (dotted: stage boundaries)" if report.get("stages") else ""))
        ax.set_title(heading, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
        drawn[phase] = _lines(ax)
    axes[0].set_ylabel("relative error (taps)" if report.get("taps") else "relative error (layer's caches)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return drawn


def plot_steps(report: dict[str, Any], path: Path, title: str) -> dict[str, Any]:
    """steps.png; returns the drawn series."""
    import matplotlib.pyplot as plt

    what, labels, rel, bound = step_series(report)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(rel)), rel, marker="o", label=what)
    ax.plot(range(len(bound)), bound, linestyle="--", color="black", label="bound")
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), ["prefill" if s == "prefill" else s.split()[-1] for s in labels],
                  fontsize=8)
    ax.set_xlabel("step (decode steps numbered)")
    ax.set_ylabel("relative error")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return {"labels": labels, **_lines(ax)}


def markdown(report: dict[str, Any], verdict: str, artifact: str) -> str:
    """report.md: the verdict first, then the worst outputs, the first divergent layer, per-layer
    errors and the token agreement."""
    lines = [f"# k3export check {artifact}", "", f"**{verdict}**", "",
             f"dtype {report['dtype']}; prompts of {report['prompt_lengths']} tokens; "
             f"prefill and {len(report['steps']) - 1} decode steps", "", *_headroom_lines(report),
             "## Worst outputs", "",
             "| output | step | relative error | bound | cosine | max abs |", "|---|---|---|---|---|---|"]
    everything = [(c, s["step"]) for s in report["steps"] for c in step_outputs(s)]
    for c, label in sorted(everything, key=lambda e: -e[0]["rel"] / max(e[0]["bound"], FLOOR))[:10]:
        lines.append(f"| {c['name']} | {label} | {c['rel']:.3g} | {c['bound']:.3g} | {c['cosine']:.6f} | "
                     f"{c['max_abs']:.3g} |")
    lines += ["", "## First divergent layer", ""]
    taps = report.get("taps")
    if not taps:
        how = ("build with `k3export build RECIPE --taps`" if artifact.startswith("--build")
               else "export with `--taps`")
        lines.append(f"Not localised: the check ran without `--taps` ({how} and check with `--taps`).")
    elif taps["first_divergent"] is None:
        lines.append("None: every tap is within its envelope at every step.")
    else:
        f = taps["first_divergent"]
        lines.append(f"Layer {f['layer']}, {f['sublayer']} (`{f['name']}`) at {f['step']}: relative error "
                     f"{f['rel']:.3g} > {f['bound']:.3g}, cosine {f['cosine']:.6f}."
                     + (f" It is in stage {f['stage']}." if "stage" in f else ""))
    if taps:
        lines += ["", "## Taps per layer (worst over the steps)", "",
                  "| layer | " + " | ".join(f"{s} rel / cos" for s in SUBLAYERS) + " |",
                  "|---" * (len(SUBLAYERS) + 1) + "|"]
        for row in per_layer(taps["steps"]):
            lines.append(f"| {row['layer']} | " + " | ".join(f"{row[s]['rel']:.3g} / {row[s]['cosine']:.6f}"
                                                             for s in SUBLAYERS) + " |")
    if "first_divergent_stage" in report:  # check --build: each stage's outputs at its boundary
        lines += ["", "## Stages (worst output over the steps)", "",
                  "| stage | layers | worst output | step | relative error | bound | passed |",
                  "|---|---|---|---|---|---|---|"]
        for i, (start, stop) in enumerate(report["stages"]):
            label, worst = max(((s["step"], s["stages"][i]) for s in report["steps"]),
                               key=lambda e: e[1]["rel"] / max(e[1]["bound"], FLOOR))
            passed = all(s["stages"][i]["passed"] for s in report["steps"])
            lines.append(f"| {report['stage_numbers'][i]} | {start}..{stop - 1} | {worst['worst']} | "
                         f"{label} | {worst['rel']:.3g} | {worst['bound']:.3g} | "
                         f"{'yes' if passed else 'no'} |")
        first = report["first_divergent_stage"]
        lines += ["", "First divergent stage: " + ("none." if first is None else
                                                   f"{first} (at {report['first_divergent_stage_step']}).")]
    lines += ["", "## Token agreement", "",
              "A disagreement is a tie when the graph's token is within the tie margin of the reference's "
              "top-1 in the reference's logits, a mismatch (failing) past it; the widest gap is the "
              "largest disagreement's gap over the margin (above 1: a mismatch).", "",
              "| step | agree | positions | ties | mismatches | widest gap |", "|---|---|---|---|---|---|"]
    for step in report["steps"]:
        t = step.get("tokens")
        if t:
            lines.append(f"| {step['step']} | {t['agree']} | {t['positions']} | {t['ties']} | "
                         f"{t['mismatches']} | {t['widest_gap']:.2f} |")
    if "greedy_streams_identical" in report:
        lines += ["", f"Greedy streams identical: {report['greedy_streams_identical']}."]
    lines += ["", "## Plots", "", "![error per layer](layers.png)", "", "![error per step](steps.png)", ""]
    return "\n".join(lines)


def _headroom_lines(report: dict[str, Any]) -> list[str]:
    """Each threshold statistic over its threshold, and the machine, so that two runs compare."""
    lines = ["## Headroom and machine", "", "| statistic | value over threshold | where |", "|---|---|---|"]
    room = report.get("headroom", {})
    if "relative_error" in room:
        r = room["relative_error"]
        lines.append(f"| worst relative error over its bound | {r['ratio']:.3f} | {r['output']} at "
                     f"{r['step']} ({r['rel']:.3g} of {r['bound']:.3g}) |")
    if "tie_gap" in room:
        lines.append(f"| widest disagreement's gap over the tie margin | {room['tie_gap']['ratio']:.3f} | "
                     f"{room['tie_gap']['step']} |")
    if "machine" in report:
        lines += ["", machine_line(report["machine"]) + "."]
    return [*lines, ""]


def report_dir(folder: str | Path) -> OutputDir:
    """The --report folder, refused (UserError) before the check runs if it cannot be written or
    matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--report: the plots need matplotlib; install it with "
                        "`pip install -c constraints.txt -e '.[report]'`") from None
    matplotlib.use("Agg")  # files only, no display
    return OutputDir(folder, REPORT, overwrite=None, option="--report")


def write_report(report: dict[str, Any], out: OutputDir, verdict: str, artifact: str) -> dict[str, Any]:
    """Writes the report folder (see the module docstring; `out` from report_dir); returns
    report.json's content."""
    # PASSED or FAILED and the artifact's folder name (the reasons are in report.md).
    kind, where = artifact.split(" ", 1)
    title = f"check {kind} {Path(where).name} ({report['dtype']}): {verdict.split(':')[0].split(' (')[0]}"
    with out.staged() as stage:
        plots = {"layers": plot_layers(report, stage / "layers.png", title),
                 "steps": plot_steps(report, stage / "steps.png", title)}
        full = {**report, "artifact": artifact, "verdict": verdict, "plots": plots}
        text = json.dumps(full, indent=2, default=_json_default) + "\n"
        write_atomic(stage / "report.json", text.encode())
        write_atomic(stage / "report.md", markdown(full, verdict, artifact).encode())
        write_json(stage / MANIFEST, {"passed": report["passed"], "report": "report.json",
                                      "artifact": artifact})
    return full
