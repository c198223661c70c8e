"""The largest model at the published widths that `check --network` fits on this machine, with the
eager side in memory and streamed.

    python tools/check_memory.py [--layers 2 3 4 5] [--eager in-memory streamed] [--dtype bfloat16]

The kimi-k3 preset's widths (hidden 7168, 96 heads of 128, MLA latent 576, dense FFN 33792, latent
MoE 3584 x 3072 with a shared expert 6144) with 8 routed experts and a 512-token vocabulary, its
first N layers (N from --layers), seeded weights: each N is exported once (`k3export export --config`,
a 64-token cache, in a temporary folder in the current directory: up to 20 GB, and /tmp may be
memory), then checked in a child process per mode (`k3export check --network DIR --eager
MODE --steps 1 --prompt-len 8 --batch 1 --json`); the folder goes after each N. Each row: the export's
weights, the child's peak RSS (sampled, and the kernel's count since the eager side started), its
time, and the verdict, or the refusal or the signal that ended it (an out-of-memory kill is SIGKILL).
The eager side's own peak (report `eager.peak_memory`: from its start) and the memory available
before the child started are given too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from k3export.config import K3Config
from k3export.options import AUTO, IN_MEMORY, STREAMED, available_memory, integer


def published_widths(layers: int) -> K3Config:
    return dataclasses.replace(K3Config.from_preset("kimi-k3").first_layers(layers), num_experts=8,
                               num_experts_per_token=2, vocab_size=512)


def child(command: list[str], output: Path) -> tuple[int, int, float]:
    """(exit code, or minus the signal; peak resident bytes; seconds) of a child run to completion,
    its stdout written to `output`, its stderr beside it (.err). The peak is sampled (VmRSS every
    20 ms) as well as read from the kernel (ru_maxrss), since the check resets the kernel's mark
    when its eager side starts (`eager.peak_memory`), which hides the artifact's part of the run."""
    start, sampled = time.perf_counter(), 0
    with output.open("wb") as out, output.with_suffix(".err").open("wb") as err:
        pid = subprocess.Popen(command, stdout=out, stderr=err).pid
        while not (ended := os.wait4(pid, os.WNOHANG))[0]:
            with contextlib.suppress(OSError, StopIteration):
                with open(f"/proc/{pid}/status") as status:
                    rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
                sampled = max(sampled, rss * 1024)
            time.sleep(0.02)
    _, code, usage = ended
    return os.waitstatus_to_exitcode(code), max(sampled, usage.ru_maxrss * 1024), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=integer(1, 93), nargs="+", default=[2, 3, 4, 5])
    parser.add_argument("--eager", nargs="+", choices=[IN_MEMORY, STREAMED, AUTO],
                        default=[IN_MEMORY, STREAMED])
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "k3export"]
    print("| layers | weights GB | --eager | available GB | peak RSS GB | eager side's peak GB | seconds | "
          "verdict |\n|---|---|---|---|---|---|---|---|", flush=True)
    for layers in args.layers:
        with tempfile.TemporaryDirectory(dir=Path.cwd()) as work:
            work = Path(work)
            published_widths(layers).to_json(work / "config.json")
            subprocess.run([*cli, "export", "--config", str(work / "config.json"), "--seed", "0", "--dtype",
                            args.dtype, "--capacity", "64", "--out", str(work / "export"), "--quiet"],
                           check=True, stdout=subprocess.DEVNULL)
            weights = (work / "export" / "model.onnx.data").stat().st_size / 1e9
            for mode in args.eager:
                before = available_memory() / 1e9
                check = [*cli, "check", "--network", str(work / "export"), "--eager", mode, "--steps", "1",
                         "--prompt-len", "8", "--batch", "1", "--json", "--quiet"]
                code, peak, seconds = child(check, work / "report.json")
                if code in (0, 1):
                    report = json.loads((work / "report.json").read_text())
                    eager, verdict = report["eager"]["peak_memory"] / 1e9, "PASSED" if code == 0 else "FAILED"
                    mode = f"{mode} ({report['eager']['mode']})" if mode == AUTO else mode
                else:
                    eager = float("nan")
                    said = ((work / "report.err").read_text().strip().splitlines() or [""])[-1]
                    verdict = f"exit {code}: {said}" if code > 0 else f"killed: {signal.Signals(-code).name}"
                print(f"| {layers} | {weights:.2f} | {mode} | {before:.1f} | {peak / 1e9:.2f} | "
                      f"{eager:.2f} | {seconds:.0f} | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
