"""Estimate the k3 kernels' speed from their compiled code, with no GPU: one table row per op and shape.

    PYTHONPATH=.:plugins python tools/kernel_estimate.py                 # every op, H100 (sm_90a)
    PYTHONPATH=.:plugins python tools/kernel_estimate.py --ops kda --machines h100,b200
    PYTHONPATH=.:plugins python tools/kernel_estimate.py --kernels       # each kernel's loops, as compiled

Each kernel (the AOT ones of k3plugins.trt_aot that full TensorRT embeds, and the JIT ones) is compiled
with `k3plugins.aot.compile_variant` for the machine's target at the published widths; then read:
registers and spills (`ptxas -v`), shared memory (Triton), the tensor-core instructions in the PTX
(`mma.sync`, `wgmma.mma_async`), and the SASS (`nvdisasm -g` on the cubin, the disassembler
`cuobjdump -sass` runs, with the source lines that name each loop). A loop is a backward branch; it is
named by the source line of that branch: its `for` statement. The rows (`moe_rows`, `mla_rows`,
`kda_rows`) say how often each loop runs per program; the model below turns that into time.

The model (printed with every table; `Machine` holds the figures, each cited):
- issue: a program executes every SASS instruction of its straight-line code once and of each loop's
  own body (nested loops apart) once per trip; a branch not taken counts as taken, except that a launch
  of a kernel that picks its path at run time may name the loop its programs run (`Launch.path`): then
  only the code on the paths from the entry to an EXIT through that loop counts (`Part`), with the loops
  on them. An SM issues
  min(4, resident warps) warp-instructions a clock; the busiest SM runs ceil(programs / SMs) programs,
  min(that, occupancy) at a time. Occupancy from registers (64K an SM, allocated per warp in units of
  256), shared memory (228 KB an SM, 1 KB reserved a block) and warps (64 an SM, 32 blocks).
- latency, for a launch with a dependent chain (a loop whose trips depend on the one before): a trip
  waits BARRIER_CYCLES for each BAR it executes and SHUFFLE_CYCLES for each SHFL on its longest register
  dependency path (`shuffle_depth`: independent shuffles, such as three sums reduced side by side, overlap;
  nested loops included), and LOAD_CYCLES once if it loads global memory without cp.async / TMA (no
  prefetch); the programs resident on an SM at once overlap, the rest follow.
- a launch takes issue + latency; a row the sum of its launches; the row's bound is the larger of its
  bytes over HBM bandwidth and its FLOPs over the bf16 tensor-core rate; the estimate is the larger
  of the bound and the launches' time; % of bound = bound / estimate.
Not modelled: launch gaps (a few us a launch), L2 hits and misses, bank conflicts, tensor-core and
memory pipe throughput within the issue slots, tails of partial waves beyond the busiest SM. A GPU
run calibrates it: `tools/gpu_check --estimate` times the same rows and prints this estimate beside.

Compiled results are cached (`CACHE`, $K3_KERNEL_CACHE or ~/.cache/k3export/kernels) keyed by the
kernel's source hash (Triton's `cache_key`, which covers the functions it calls), its specialisation,
options, target, Triton's version and this file's analysis version: a re-run compiles only what changed.

For a kernel helper: each op's rows are built by one function (`moe_rows`, `mla_rows`, `kda_rows`)
returning `Row`s; a row holds one or more `Launch`es (a KernelVariant, its grid, the trips of each of
its loops by `for` text, the hot loop and the work a trip of it does, the dependent loop if any). Point
a row at a new kernel by building its `Launch`es there; `--kernels` lists each compiled kernel's loops
by the text the trips are keyed on.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import triton

from k3plugins import kernel_variants
from k3plugins.aot import PTXAS, compile_variant, kernel_stats
from k3plugins.variants import KernelVariant

ANALYSIS_VERSION = 6  # bump when what `analyse` records changes: the cache is keyed on it
CACHE = Path(os.environ.get("K3_KERNEL_CACHE", Path.home() / ".cache" / "k3export" / "kernels"))
NVDISASM = PTXAS.parent / "nvdisasm"

# The published widths (../shared/ARCHITECTURE.md; k3export.config's kimi-k3 preset), one rank of 8.
RANKS = 8
MOE_L, MOE_I, MOE_EXPERTS, MOE_TOP_K = 3584, 3072, 896, 16
MOE_HELD = MOE_EXPERTS // RANKS  # 112 experts a rank
MOE_BETAS = (4.0, 25.0)  # SiTU-GLU's beta and linear beta
MXFP4_BYTES = 17 / 32  # a weight: 4 bits of code and 8 bits of scale per 32
MLA_HEADS, MLA_D, MLA_V = 96, 576, 512
MLA_SCALE = 192 ** -0.5
KDA_HEADS, KDA_K, KDA_V = 96, 128, 128
BF16 = 2

# Latency a dependent step waits, in clocks: order-of-magnitude figures (a barrier with every warp
# arriving, a shuffle's result, an L2-missing global load), to be calibrated by the first GPU run.
BARRIER_CYCLES = 30
SHUFFLE_CYCLES = 30
LOAD_CYCLES = 600


@dataclass(frozen=True)
class Machine:
    name: str
    target: str  # k3plugins.aot.TARGETS
    sms: int
    clock_ghz: float
    hbm_tbs: float
    bf16_tflops: float  # dense
    source: str
    issue_per_sm: int = 4  # warp-instructions a clock: 4 schedulers
    registers_per_sm: int = 65536
    shared_per_sm: int = 228 * 1024
    warps_per_sm: int = 64
    blocks_per_sm: int = 32


MACHINES = {
    "h100": Machine("H100 SXM", "sm90", 132, 1.755, 3.35, 989.0,
                    "NVIDIA H100 data sheet (SXM5: 3.35 TB/s, 989 TFLOP/s dense bf16) and Hopper whitepaper "
                    "(132 SMs, 4 schedulers an SM); 1.755 GHz boost"),
    "h200": Machine("H200 SXM", "sm90", 132, 1.755, 4.8, 989.0,
                    "NVIDIA H200 data sheet (4.8 TB/s, 989 TFLOP/s dense bf16); the H100's SMs and clock"),
    "b200": Machine("B200 (HGX, 1000 W)", "sm100", 148, 1.98, 8.0, 2250.0,
                    "NVIDIA HGX B200 figures as listed at glennklockwood.com/garden/processors/B200 (8 TB/s, "
                    "2,250 TFLOP/s dense bf16 at 1,000 W); 148 SMs and 1.98 GHz boost from hmc-tech.com's "
                    "B200 spec page"),
}


# ---- what a compiled kernel holds ----

@dataclass
class Loop:
    text: str  # the `for` statement of its backward branch, stripped: what rows key trips on
    where: str  # file:line
    start: int  # SASS byte offsets of the body
    end: int
    size: int  # SASS instructions in the body, nested loops included
    own: dict[str, int]  # opcode counts in the body outside nested loops ("ALL": every instruction)
    parent: int | None  # index of the enclosing loop
    shuffle_depth: int = 0  # the most SHFL on one dependency path through its own body (shuffle_depth)


@dataclass
class Part:
    """The code on the paths from the entry to an EXIT through one outermost loop: what a program running
    that loop executes in a kernel that picks its path at run time (the other paths' code is on none)."""

    loop: int  # the loop's index
    own: dict[str, int]  # opcode counts outside loops
    loops: list[int]  # the loops on the paths


@dataclass
class Analysis:
    name: str
    target: str
    num_warps: int
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int
    ptx: dict[str, int]  # mma.sync, wgmma, cp.async, tma instruction counts in the PTX
    straight: dict[str, int]  # opcode counts outside every loop
    loops: list[Loop]
    parts: list[Part] = field(default_factory=list)

    @property
    def tensor_cores(self) -> str:
        used = [f"{self.ptx.get(k, 0)} {k}" for k in ("mma.sync", "wgmma", "tcgen05") if self.ptx.get(k)]
        return " + ".join(used) or "none"

    @property
    def warnings(self) -> list[str]:
        """What the issue model cannot place: a loop no `for` names (a wait on a barrier has a few
        instructions; more is work left uncounted), and a `for` compiled into several loops (sm_100a's
        pipelining or warp specialisation: each is counted with the statement's full trips)."""
        texts = [lp.text for lp in self.loops]
        unnamed = [lp for lp in self.loops if lp.text == "?" and lp.own.get("ALL", 0) > 16]
        # Loops of one `for` on separate paths (picked at run time) are each a path's, not a split.
        split = sorted({lp.text for i, lp in enumerate(self.loops) if lp.text != "?" and sum(
            self.loops[j].text == lp.text for j in self.on_paths_with(i)) > 1})
        found = [f"`{t}` compiled into {texts.count(t)} loops, each counted" for t in split]
        if unnamed:
            found.insert(0, f"{len(unnamed)} unnamed loops of {sum(lp.own['ALL'] for lp in unnamed)} SASS "
                            "not counted")
        return found

    def loop(self, text: str, part: Part | None = None) -> int:
        """The first loop `text` names (on `part`'s paths where given)."""
        matches = [i for i in self.in_part(part) if self.loops[i].text == text]
        if not matches:
            raise KeyError(f"{self.name}: no loop `{text}`; its loops: {[lp.text for lp in self.loops]}")
        return matches[0]

    def in_part(self, part: Part | None) -> list[int]:
        """The loops on `part`'s paths (None: every loop of the kernel)."""
        return list(range(len(self.loops))) if part is None else part.loops

    def on_paths_with(self, index: int) -> list[int]:
        """The loops on the paths through loop `index` (through its outermost enclosing loop)."""
        while self.loops[index].parent is not None:
            index = self.loops[index].parent
        return next((p.loops for p in self.parts if p.loop == index), list(range(len(self.loops))))

    def part(self, path: tuple[str, int] | None) -> Part | None:
        """The paths through the loop `path` names: its `for` text and which of that text's loops, in code
        order (None: the whole kernel)."""
        if path is None:
            return None
        text, nth = path
        named = [p for p in self.parts if self.loops[p.loop].text == text]
        if len(named) <= nth:
            raise KeyError(f"{self.name}: no outermost loop {path}; loops: {[lp.text for lp in self.loops]}")
        return named[nth]

    def inside(self, index: int) -> list[int]:
        """The loop and every loop nested in it."""
        found = [index]
        for i, lp in enumerate(self.loops):
            if lp.parent in found:
                found.append(i)
        return found


PTX_PATTERNS = {"mma.sync": r"\bmma\.sync\b", "wgmma": r"\bwgmma\.mma_async\b",
                "tcgen05": r"\btcgen05\.mma\b",
                "cp.async": r"\bcp\.async\.(?:ca|cg)\b", "tma": r"\bcp\.async\.bulk\.tensor\b"}
# One SASS instruction: /*offset*/ [predicate] OPCODE[.modifiers] operands ;
SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]*)?([^;]*);")
SASS_SHOWN = ("BAR", "SHFL", "HMMA", "HGMMA", "UTCHMMA", "LDG", "LDGSTS", "UTMALDG")
LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
LABEL = re.compile(r"^\.(L_x_\d+):")


def ptx_counts(ptx: str) -> dict[str, int]:
    return {k: len(re.findall(p, ptx)) for k, p in PTX_PATTERNS.items()}


class ForStatement(NamedTuple):
    text: str  # its first line, stripped, without the colon
    where: str  # file:line
    first: int
    last: int


@functools.cache
def for_statements(path: Path) -> tuple[ForStatement, ...]:
    """Every `for` statement of a source file, innermost (shortest) first."""
    source = path.read_text()
    lines = source.splitlines()
    found = [ForStatement(lines[n.lineno - 1].strip().rstrip(":"), f"{path.name}:{n.lineno}", n.lineno,
                          n.end_lineno or n.lineno)
             for n in ast.walk(ast.parse(source)) if isinstance(n, ast.For)]
    return tuple(sorted(found, key=lambda f: f.last - f.first))


def statements(sources: Path, name: str) -> tuple[ForStatement, ...]:
    """The `for` statements of source file `name` in `sources` (none where it is not there)."""
    return for_statements(sources / name) if (sources / name).exists() else ()


def sass_loops(disassembly: str, sources: Path) -> tuple[dict[str, int], list[Loop], list[Part]]:
    """Straight-line opcode counts, the loops and the parts of `nvdisasm -g -c` output (one kernel).

    A loop is named by the innermost source `for` statement around the line of its backward branch (the
    `for` line on sm_90a, a line of the body on sm_100a) not already naming a loop nested in it; where that
    line is in an inlined helper (sm_100a), by the innermost such statement whose `for` line one of the
    loop's instructions carries (its induction step), static_range excepted (unrolled, never a loop). The
    files are read from `sources` (the imported kernels' folder): the line numbers are those of the
    imported source (Triton's cache key holds them), the path in the line table the first compile's."""
    instructions: list[tuple[int, str, str, tuple[str, int] | None]] = []  # offset, opcode, target, line
    operands: dict[int, str] = {}
    conditional: set[int] = set()  # offsets of predicated instructions (uniform predicates included)
    labels: dict[str, int] = {}
    pending_labels: list[str] = []
    where: tuple[str, int] | None = None
    for raw in disassembly.splitlines():
        line = raw.strip()
        if m := LINE.search(line):
            where = (Path(m.group(1)).name, int(m.group(2)))
            continue
        if m := LABEL.match(line):
            pending_labels.append(m.group(1))
            continue
        if m := SASS.search(line):
            offset, opcode = int(m.group(1), 16), m.group(2)
            for name in pending_labels:
                labels[name] = offset
            pending_labels = []
            target = re.search(r"\.(L_x_\d+)", m.group(4)) if opcode == "BRA" else None
            if line.split("*/", 1)[1].lstrip().startswith("@") or re.match(r"\s*!?UP\d", m.group(4)):
                conditional.add(offset)
            instructions.append((offset, opcode, target.group(1) if target else "", where))
            operands[offset] = m.group(4)
    spans: dict[int, tuple[int, tuple[str, int] | None]] = {}  # start -> (last backward branch, its line)
    for offset, _, target, line in instructions:
        if target and labels.get(target, offset) < offset and offset >= spans.get(labels[target], (-1,))[0]:
            spans[labels[target]] = (offset, line)
    loops: list[Loop] = []
    for start, (end, _) in sorted(spans.items()):
        parent = next((i for i in range(len(loops) - 1, -1, -1)
                       if loops[i].start <= start and end <= loops[i].end), None)
        loops.append(Loop("?", "?", start, end, 0, {}, parent))
    # Innermost loops first, so that an outer loop skips the statements its nested loops took.
    claimed: dict[int, set[ForStatement]] = {}
    for i in sorted(range(len(loops)), key=lambda i: loops[i].end - loops[i].start):
        taken = set().union(*(claimed.get(j, set()) for j, lp in enumerate(loops) if lp.parent == i))
        branch = spans[loops[i].start][1]
        carried = {line for offset, _, _, line in instructions
                   if line is not None and loops[i].start <= offset <= loops[i].end}
        candidates = [] if branch is None else [
            s for s in statements(sources, branch[0]) if s.first <= branch[1] <= s.last and s not in taken]
        candidates = candidates or [
            s for name, _ in carried for s in statements(sources, name)
            if (name, s.first) in carried and s not in taken and "static_range" not in s.text]
        if candidates:
            statement = min(candidates, key=lambda s: s.last - s.first)
            loops[i].text, loops[i].where = statement.text, statement.where
            taken = taken | {statement}
        claimed[i] = taken
    straight: dict[str, int] = {}
    bodies: list[list[tuple[str, str]]] = [[] for _ in loops]
    for offset, opcode, _, _ in instructions:
        inner = [i for i, lp in enumerate(loops) if lp.start <= offset <= lp.end]
        for i in inner:
            loops[i].size += 1
        counts = loops[inner[-1]].own if inner else straight
        for key in (opcode, "ALL"):
            counts[key] = counts.get(key, 0) + 1
        if inner:
            bodies[inner[-1]].append((opcode, operands[offset]))
    for loop, body in zip(loops, bodies, strict=True):
        loop.shuffle_depth = shuffle_depth(body)
    return straight, loops, paths(instructions, labels, loops, conditional)


REGISTER = re.compile(r"\bR(\d+)(\.64)?\b")


def registers(operand: str) -> set[str]:
    """The general registers an operand names (a .64 pair as both)."""
    found = set()
    for m in REGISTER.finditer(operand):
        found |= {f"R{m.group(1)}", f"R{int(m.group(1)) + 1}"} if m.group(2) else {f"R{m.group(1)}"}
    return found


def shuffle_depth(body: Sequence[tuple[str, str]]) -> int:
    """The most SHFL on one dependency path through `body` (opcode, operands; in order, branches read as
    straight-line code): shuffles on independent paths (three sums reduced side by side) overlap, those
    on one path wait for each other. Dependencies are through general registers (the first operand is
    the destination, SHFL's second after its predicate; stores write none); a BAR orders everything
    after it behind everything before (shared memory carries values past it)."""
    depth: dict[str, int] = {}
    floor = 0
    for opcode, text in body:
        if opcode == "BAR":
            floor = max([floor, *depth.values()])
            continue
        parts = [p.strip() for p in text.split(",")]
        writes = not (opcode.startswith(("ST", "RED", "BRA")) or parts[0].startswith("["))
        first = 2 if opcode == "SHFL" else 1
        dests = set().union(*map(registers, parts[:first])) if writes else set()
        sources = set().union(*map(registers, parts[first if writes else 0:]))
        reached = max([floor, *(depth.get(r, 0) for r in sources)]) + (opcode == "SHFL")
        depth.update(dict.fromkeys(dests, reached))
    return max([floor, *depth.values()])


def paths(instructions: Sequence[tuple[int, str, str, Any]], labels: dict[str, int], loops: list[Loop],
          conditional: set[int]) -> list[Part]:
    """A `Part` for each outermost loop: the instructions both on a path from the entry to the loop and on
    one from the loop to an EXIT (a call's subroutine, past the kernel's EXITs, is on none)."""
    offsets = [o for o, *_ in instructions]
    index = {o: i for i, o in enumerate(offsets)}
    after: list[list[int]] = []
    for i, (offset, opcode, target, _) in enumerate(instructions):
        ends = opcode in ("EXIT", "RET") or (opcode == "BRA" and target)
        nxt = [] if (ends and offset not in conditional) or i + 1 == len(instructions) else [i + 1]
        jump = [index[labels[target]]] if target and labels.get(target) in index else []
        after.append(nxt + jump)
    before: list[list[int]] = [[] for _ in instructions]
    for i, nxt in enumerate(after):
        for j in nxt:
            before[j].append(i)

    def reach(starts: list[int], edges: list[list[int]]) -> set[int]:
        seen, todo = set(starts), list(starts)
        while todo:
            for j in edges[todo.pop()]:
                if j not in seen:
                    seen.add(j)
                    todo.append(j)
        return seen

    exits = [i for i, (o, opcode, *_) in enumerate(instructions) if opcode == "EXIT"]
    entered, exiting = reach([0], after), reach(exits, before)
    parts = []
    for n, lp in enumerate(loops):
        if lp.parent is not None or lp.start not in index:
            continue
        start = index[lp.start]
        on = (entered & reach([start], before)) | (exiting & reach([start], after))
        on_loops = [j for j, other in enumerate(loops) if other.start in index and index[other.start] in on]
        own: dict[str, int] = {}
        for i in on:
            if not any(other.start <= offsets[i] <= other.end for other in loops):
                for key in (instructions[i][1], "ALL"):
                    own[key] = own.get(key, 0) + 1
        parts.append(Part(n, own, on_loops))
    return parts


def cache_key(variant: KernelVariant, target: str) -> str:
    constexprs = {k: repr(v) for k, v in variant.constexprs.items()}
    spec = json.dumps([variant.fn.cache_key, variant.signature, constexprs,
                       variant.num_warps, variant.num_stages, list(variant.divisible_by_16), target,
                       triton.__version__, ANALYSIS_VERSION], sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:24]


def analyse(variant: KernelVariant, target: str) -> Analysis:
    """The compiled kernel's figures, from the cache when its source and options are unchanged."""
    path = CACHE / f"{variant.name}.{target}.{cache_key(variant, target)}.json"
    if path.exists():
        data = json.loads(path.read_text())
        return Analysis(**{**data, "loops": [Loop(**lp) for lp in data["loops"]],
                           "parts": [Part(**p) for p in data["parts"]]})
    kernel = compile_variant(variant, target)
    stats = kernel_stats(kernel)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        disassembly = subprocess.run([str(NVDISASM), "-g", "-c", str(cubin)], capture_output=True, text=True,
                                     check=True).stdout
    straight, loops, parts = sass_loops(disassembly, Path(inspect.getsourcefile(variant.fn.fn)).parent)
    result = Analysis(variant.name, target, variant.num_warps, stats.registers, stats.spill_stores,
                      stats.spill_loads, stats.shared_bytes, ptx_counts(kernel.asm["ptx"]), straight, loops,
                      parts)
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(f".{os.getpid()}.tmp")  # other helpers may fill the cache at once
    tmp_path.write_text(json.dumps(asdict(result)))
    tmp_path.replace(path)
    return result


# ---- rows ----

@dataclass
class Launch:
    """One kernel launch of a row. `trips`: executions of each loop's body per program, summed over
    the enclosing loops' trips (a loop absent from the dict or 0 is not taken). `hot`: the loop whose
    instructions per unit of work the table shows, and the units (weights or FLOPs) a trip does.
    `chain`: the loop whose trips depend on each other (a latency term), if any. `programs`: those
    that do the work (default: the whole grid; the rest exit at once). `path`: for a kernel that picks its
    path at run time, the loop the programs run (its `for` text and which of that text's outermost loops, in
    code order): only the code on the paths through it is charged (`Part`; default: the whole kernel)."""

    variant: KernelVariant
    grid: tuple[int, ...]
    trips: dict[str, float]
    hot: str | None = None
    hot_units: float = 0.0
    unit: str = "weight"
    chain: str | None = None
    programs: int | None = None
    path: tuple[str, int] | None = None

    @property
    def active(self) -> int:
        return self.programs if self.programs is not None else math.prod(self.grid)


@dataclass
class Row:
    op: str  # moe | mla | kda
    form: str  # AOT (full TensorRT) | JIT (TensorRT-RTX, eager)
    shape: str
    launches: list[Launch]
    bytes: float  # the fewest the op must move
    flops: float
    note: str = ""
    # How tools/gpu_check --estimate times the row: its Case's fields (kernel, B, T, S, heads, held,
    # gate_dtype; the dtype is bfloat16).
    case: dict[str, Any] = field(default_factory=dict)


@dataclass
class Estimate:
    row: Row
    analyses: list[Analysis]
    issue_s: float = 0.0
    latency_s: float = 0.0
    memory_s: float = 0.0
    tensor_s: float = 0.0
    details: list[dict[str, Any]] = field(default_factory=list)

    @property
    def bound_s(self) -> float:
        return max(self.memory_s, self.tensor_s)

    @property
    def time_s(self) -> float:
        return max(self.bound_s, self.issue_s + self.latency_s)

    @property
    def percent(self) -> float:
        return 100 * self.bound_s / self.time_s


def occupancy(a: Analysis, m: Machine) -> int:
    """Blocks an SM holds at once, from registers, shared memory and warps."""
    warp_registers = math.ceil(max(a.registers, 1) * 32 / 256) * 256
    by_registers = (m.registers_per_sm // warp_registers) // a.num_warps
    by_shared = m.shared_per_sm // (a.shared + 1024) if a.shared else m.blocks_per_sm
    return max(0, min(by_registers, by_shared, m.warps_per_sm // a.num_warps, m.blocks_per_sm))


def program_instructions(a: Analysis, trips: dict[str, float], kind: str = "ALL",
                         part: Part | None = None) -> float:
    """Warp-instructions of `kind` (an opcode or ALL) one warp of a program executes (running `part`)."""
    known = {lp.text for lp in a.loops}
    unknown = set(trips) - known
    if unknown:
        raise KeyError(f"{a.name}: trips for loops it does not have: {sorted(unknown)}; "
                       f"its loops: {sorted(known)}")
    total = (a.straight if part is None else part.own).get(kind, 0)
    for i in a.in_part(part):
        total += a.loops[i].own.get(kind, 0) * trips.get(a.loops[i].text, 0)
    return total


def chain_step(a: Analysis, launch: Launch) -> dict[str, float]:
    """Per trip of the chain loop: its BAR, the SHFL on its longest dependency path ("SHFL": each loop's
    shuffle_depth; nested loops included, each trip after the last), and whether it loads global memory
    with no cp.async / TMA in it."""
    index = a.loop(launch.chain, a.part(launch.path))
    steps = launch.trips[launch.chain]
    inner = a.inside(index)
    sums = {k: sum(a.loops[i].own.get(k, 0) * launch.trips.get(a.loops[i].text, 0) for i in inner) / steps
            for k in ("BAR", "LDG", "LDGSTS", "UTMALDG")}
    sums["SHFL"] = sum(a.loops[i].shuffle_depth * launch.trips.get(a.loops[i].text, 0) for i in inner) / steps
    sums["unprefetched"] = 1.0 if sums["LDG"] and not (sums["LDGSTS"] or sums["UTMALDG"]) else 0.0
    return sums


def estimate(row: Row, m: Machine, analyses: list[Analysis] | None = None) -> Estimate:
    """The row's figures on `m`; `analyses` (one per launch) default to its kernels compiled for `m`."""
    analyses = analyses or [analyse(launch.variant, m.target) for launch in row.launches]
    est = Estimate(row, analyses, memory_s=row.bytes / (m.hbm_tbs * 1e12),
                   tensor_s=row.flops / (m.bf16_tflops * 1e12))
    clock = m.clock_ghz * 1e9
    for launch, a in zip(row.launches, analyses, strict=True):
        resident = occupancy(a, m)
        per_sm = math.ceil(launch.active / m.sms)
        at_once = max(1, min(resident, per_sm))
        part = a.part(launch.path)
        warp_instr = program_instructions(a, launch.trips, part=part)
        issue = per_sm * a.num_warps * warp_instr / min(m.issue_per_sm, at_once * a.num_warps) / clock
        detail: dict[str, Any] = {"kernel": a.name, "grid": launch.grid, "programs": launch.active,
                                  "occupancy": resident, "waves": launch.active / max(1, resident * m.sms),
                                  "warp_instr": warp_instr, "issue_s": issue}
        if launch.hot:
            hot = a.loops[a.loop(launch.hot, part)]
            detail["hot_per_unit"] = hot.size * a.num_warps * 32 / launch.hot_units
            detail["hot_bar"] = hot.own.get("BAR", 0)
        latency = 0.0
        if launch.chain:
            step = chain_step(a, launch)
            cycles = (step["BAR"] * BARRIER_CYCLES + step["SHFL"] * SHUFFLE_CYCLES
                      + step["unprefetched"] * LOAD_CYCLES)
            latency = math.ceil(per_sm / at_once) * launch.trips[launch.chain] * cycles / clock
            detail.update(chain_bar=step["BAR"], chain_shfl=step["SHFL"],
                          chain_load=bool(step["unprefetched"]), latency_s=latency)
        est.issue_s += issue
        est.latency_s += latency
        est.details.append(detail)
    return est


# ---- the rows: one function per op (each kernel helper edits its own) ----

def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def moe_routing(tokens: int) -> list[list[int]]:
    """experts [N][k] over all 896: each token has exactly 2 of its 16 slots on rank 0 (experts 0..111, the
    mean at 8 ranks), and the tokens' experts spread evenly over the rank's (token n takes j * 56 + o_n,
    o_n = 17 n mod 56, for j = 0..15: distinct within a token)."""
    stride = MOE_EXPERTS // MOE_TOP_K  # 56
    return [[j * stride + (17 * n) % stride for j in range(MOE_TOP_K)] for n in range(tokens)]


def moe_grouped_launches(mode: str, tokens: int, counts: dict[int, int], aot: bool = False) -> list[Launch]:
    """k3plugins.moe's four launches (group, gate/up, down, combine) for MXFP4 experts and bf16 activations
    with `mode`'s tiles, `counts` the pairs of each expert held. `aot`: the kernels full TensorRT's grouped
    nodes compile (trt_aot: widths, expert count and betas compiled in); its sum of the slots is standard ops
    there, which the combine kernel stands in for."""
    from k3plugins import moe
    from k3plugins.trt_aot import GROUPED_TACTICS, grouped_experts_aot_kernels

    pairs = tokens * MOE_TOP_K
    scan = cdiv(pairs, moe.GROUP_BLOCK)
    scans = {"for p0 in range(0, num_pairs, BLOCK)": scan, "for q0 in range(0, num_pairs, BLOCK)": scan}
    if aot:
        tactic = next(t for t, m in GROUPED_TACTICS.items() if m == mode)
        group = moe.group_variant({"E": MOE_HELD, "OFFSET": 0})
        gate_up, down = grouped_experts_aot_kernels("bfloat16", True, MOE_L, MOE_I, MOE_HELD, MOE_BETAS,
                                                    tactic)
    else:
        group = moe.group_variant()
        gate_up, down = moe.grouped_variants("bf16", True, moe.tile_choices(_torch_bf16(), packed=True)[mode],
                                             mode)
    launches = [Launch(group, (MOE_HELD + 1,), scans)]
    # Each kernel's tile as compiled: a gate/up program's product has BLOCK_W rows of w1 and BLOCK_W of w3.
    products = ((gate_up, MOE_I, MOE_L, "L", 2), (down, MOE_L, MOE_I, "I", 1))
    for variant, rows, reduce, width, matrices in products:
        block_p, block_w, block_k = (variant.constexprs[k] for k in ("BLOCK_P", "BLOCK_W", "BLOCK_K"))
        used = sum(cdiv(n, block_p) for n in counts.values())  # tiles of the rank's own pairs
        columns = cdiv(rows, block_w)
        loop = f"for k0 in range(0, {width}, BLOCK_K)"
        launches.append(Launch(variant, (moe.max_tiles(pairs, MOE_HELD, block_p), columns),
                               {loop: cdiv(reduce, block_k)}, loop, matrices * block_w * block_k,
                               programs=used * columns))
    launches.append(Launch(moe.combine_variant(), (tokens, cdiv(MOE_L, moe.COMBINE_BLOCK)),
                           {"for j in range(TOP_K)": MOE_TOP_K}))
    return launches


def moe_rows() -> list[Row]:
    """The routed experts (MXFP4 experts, bf16 activations) on one rank of 8: 112 experts held, top-16 of
    896, decode with 1 and 16 tokens a rank, prefill with 512 and 8192."""
    from k3plugins import moe

    rows = []
    packed_expert = 3 * MOE_I * MOE_L * MXFP4_BYTES
    for tokens, phase in ((1, "decode"), (16, "decode"), (512, "prefill"), (8192, "prefill")):
        routing = moe_routing(tokens)
        counts: dict[int, int] = {}
        for token in routing:
            for e in token:
                if e < MOE_HELD:
                    counts[e] = counts.get(e, 0) + 1
        pairs = sum(counts.values())
        nbytes = len(counts) * packed_expert + tokens * (MOE_L * (BF16 + 4) + MOE_TOP_K * 12)
        flops = 2 * pairs * 3 * MOE_I * MOE_L
        shape = f"{phase} {tokens} tok ({pairs} pairs, {len(counts)} experts)"
        case = {"B": tokens, "T": 1, "held": MOE_HELD}
        # AOT: full TensorRT's grouped nodes in the tiles of the tactic for the rank's own pairs (assumed: the
        # one TensorRT times fastest for a profile of that shape; the JIT launcher counts all N k pairs).
        held_mode = moe.tile_mode(pairs, MOE_HELD)
        aot = moe_grouped_launches(held_mode, tokens, counts, aot=True)
        rows.append(Row("moe", "AOT", shape, aot, nbytes, flops, note=f"{held_mode} tiles",
                        case={"kernel": "aot:moe_mxfp4", **case}))
        # JIT: k3plugins.moe's grouped launches (all N k pairs pick the tiles: no host sync for the count).
        mode = moe.tile_mode(tokens * MOE_TOP_K, MOE_HELD)
        rows.append(Row("moe", "JIT", shape, moe_grouped_launches(mode, tokens, counts), nbytes, flops,
                        note=f"{mode} tiles", case={"kernel": "moe_mxfp4", **case}))
    return rows


def mla_rows() -> list[Row]:
    """LatentMLA decode (one new token a row) at cache 4K / 16K / 64K and batch 1 / 8 / 64, 12 heads a rank
    of 8 and 96 unsplit; every row sees the whole length, in a cache of twice that capacity (as
    tools/gpu_check allocates it). Both forms run the same two launches: the attention kernel over
    (row, 16 heads, split) on `decode_tiles`' warps, `split_count` splits (B x head blocks x splits <= 264),
    then the combine."""
    from k3plugins.mla import COMBINE_SPLITS, DECODE, DECODE_MANY_HEADS, SPLIT_ROWS, decode_tiles, split_count
    from k3plugins.trt_aot import (
        latent_mla_aot_kernel,
        latent_mla_aot_launch,
        latent_mla_combine_aot_kernel,
        latent_mla_combine_aot_launch,
    )

    # Whole blocks of rows every query sees, then the masked rest (the last partial block).
    step, tail = "for s0 in range(lo, unmasked_end, BLOCK_S)", "for s0 in range(unmasked_end, hi, BLOCK_S)"
    # The combine's two loops: the max over every split's lse, then the sum over the splits holding rows.
    combine_max, combine_sum = ("for s0 in range(0, n_splits, BLOCK_SPLITS)",
                                "for s0 in range(0, n_live, BLOCK_SPLITS)")
    rows = []
    for heads in (MLA_HEADS // RANKS, MLA_HEADS):
        tiles = decode_tiles(heads, half=True)
        mode = "decode_many_heads" if tiles == DECODE_MANY_HEADS else "decode"
        for cache in (4096, 16384, 65536):
            for batch in (1, 8, 64):
                nbytes = BF16 * (batch * cache * MLA_D + batch * heads * (MLA_D + MLA_V))
                flops = 2 * batch * heads * cache * (MLA_D + MLA_V)
                shape = f"decode H{heads} S{cache // 1024}K B{batch}"
                case = {"B": batch, "T": 1, "S": cache, "heads": heads, "full": True}
                splits = split_count(batch, 1, heads)
                split_len = max(cdiv(cache, splits), SPLIT_ROWS)
                head_blocks = cdiv(heads, DECODE.block_h)
                useful = 2 * DECODE.block_s * min(heads, DECODE.block_h) * (MLA_D + MLA_V)
                trips = {step: split_len // DECODE.block_s, tail: int(split_len % DECODE.block_s > 0)}
                live = cdiv(cache, split_len)  # splits holding rows
                programs = batch * head_blocks * live
                combine_trips = {combine_max: cdiv(splits, COMBINE_SPLITS),
                                 combine_sum: cdiv(live, COMBINE_SPLITS)}
                # AOT: k3::LatentMLASplits then k3::LatentMLACombine, two nodes.
                attn = latent_mla_aot_kernel("bfloat16", "bfloat16", MLA_D, MLA_V, MLA_SCALE, heads,
                                             splits=True)
                grid, _ = latent_mla_aot_launch([batch, 1, heads, MLA_D], [batch, 1, 2 * cache, MLA_D],
                                                splits=True)
                combine = latent_mla_combine_aot_kernel("bfloat16", MLA_V)
                combine_grid, _ = latent_mla_combine_aot_launch([splits, batch, 1, heads, MLA_V])
                launches = [Launch(attn, grid, trips, step, useful, unit="FLOP", programs=programs),
                            Launch(combine, combine_grid, combine_trips)]
                rows.append(Row("mla", "AOT", shape, launches, nbytes, flops, note=f"{splits} splits",
                                case={"kernel": "aot:latent_mla", **case}))
                # JIT: the same kernels launched by latent_mla.
                launches = [Launch(jit_variant(f"mla_{mode}_bf16_splits_v512_r64"), grid, trips, step, useful,
                                   unit="FLOP", programs=programs),
                            Launch(jit_variant("mla_combine_bf16_v512"), combine_grid, combine_trips)]
                rows.append(Row("mla", "JIT", shape, launches, nbytes, flops, note=f"{splits} splits",
                                case={"kernel": "mla_decode", **case}))
    return rows


def kda_chunk_flops(tokens: int, heads: int, chunk: int = 16) -> float:
    """FLOPs of the chunked form at chunk_kda's chunk of 16 (tools/gpu_check.py's count): scores, W, U, the
    state's products and the triangular solve, a partial chunk counted whole."""
    chunks = cdiv(tokens, chunk)
    return heads * chunks * (6 * chunk ** 2 * KDA_K + 4 * chunk ** 2 * KDA_V + 6 * chunk * KDA_K * KDA_V
                             + 2 * chunk ** 3 / 3)


def kda_bytes(tokens: int, heads: int) -> float:
    """q, k, v, o in bf16, g and beta in float32, the float32 state read and written."""
    per_token = heads * (2 * KDA_K * BF16 + KDA_K * 4 + 2 * KDA_V * BF16 + 4)
    return tokens * per_token + 2 * heads * KDA_K * KDA_V * 4


def kda_rows() -> list[Row]:
    """KDA (bf16): prefill T = 8192 (one row) and decode (one token a row, batch 1, 8 and 64), 96 heads and 12
    a rank of 8."""
    from k3plugins.trt_aot import (
        KDA_STEP_TOKENS,
        kda_chunk_recurrence_aot_launch,
        kda_prepare_aot_launch,
        kda_two_node_aot_kernels,
    )

    prepare, recurrence = kda_two_node_aot_kernels("bfloat16", KDA_K, KDA_V)
    rows = []
    for tokens, phase, batches in ((8192, "prefill", (1,)), (1, "decode", (1, 8, 64))):
        for heads in (KDA_HEADS, KDA_HEADS // RANKS):
            for batch in batches:
                nbytes = batch * kda_bytes(tokens, heads)
                flops = batch * (kda_chunk_flops(tokens, heads) if tokens > 1 else 7 * heads * KDA_K * KDA_V)
                shape = f"{phase} T{tokens} H{heads}" + (f" B{batch}" if phase == "decode" else "")
                case = {"B": batch, "T": tokens, "heads": heads, "gate_dtype": "float32"}
                # AOT: the export's two nodes, KDAPrepare then KDAChunkRecurrence (trt_aot); a call of at most
                # KDA_STEP_TOKENS steps the recurrence from the token inputs, and the prepare's programs exit
                # at once (the kernels' T picks the path at run time).
                q, v = [batch, tokens, heads, KDA_K], [batch, tokens, heads, KDA_V]
                if tokens <= KDA_STEP_TOKENS:
                    loop = "for t in range(T)"
                    grid = kda_chunk_recurrence_aot_launch(q, v, recurrence)[0]
                    narrow = grid[1] > cdiv(KDA_V, recurrence.constexprs["BV"])
                    launches = [
                        Launch(prepare, kda_prepare_aot_launch(q)[0], {}, programs=0),
                        Launch(recurrence, grid, {loop: tokens}, loop, 7 * KDA_K * cdiv(KDA_V, grid[1]),
                               "FLOP", chain=loop, path=KDA_AOT_PATHS["narrow step" if narrow else "step"])]
                else:
                    launches = kda_chunk_launches(tokens, batch * heads, prepare, recurrence,
                                                  KDA_AOT_PATHS["chunks"])
                rows.append(Row("kda", "AOT", shape, launches, nbytes, flops,
                                note="KDAPrepare + KDAChunkRecurrence", case={"kernel": "aot:kda", **case}))
                jit = "chunk_kda" if tokens > 1 else "recurrent_kda"
                launches = (kda_chunk_launches(tokens, batch * heads, jit_variant("kda_prepare_bf16_k128"),
                                               jit_variant("kda_chunk_recurrence_bf16_k128"))
                            if tokens > 1 else kda_recurrent_launches(tokens, batch * heads))
                rows.append(Row("kda", "JIT", shape, launches, nbytes, flops,
                                note=f"{jit} ({len(launches)} launches)", case={"kernel": jit, **case}))
    return rows


def kda_recurrent_launches(tokens: int, heads: int) -> list[Launch]:
    """What k3plugins.kda launches for a call of `tokens` on `heads` (row, head) pairs: the recurrence."""
    from k3plugins import kda

    loop = "for t in range(T)"
    grid = (heads, cdiv(KDA_V, kda.STEP_BLOCK_V))
    return [Launch(jit_variant("recurrent_kda_bf16_k128"), grid, {loop: tokens}, loop,
                   7 * KDA_K * kda.STEP_BLOCK_V, "FLOP", chain=loop)]


# KDAChunkRecurrence's AOT kernel's paths (`Launch.path`): its token loops in code order, the step in
# NARROW_BV columns first, then in the chunk path's BV (tests/test_kernel_estimate.py checks them by their
# shuffles), and its chunk loop.
KDA_AOT_PATHS = {"narrow step": ("for t in range(T)", 0), "step": ("for t in range(T)", 1),
                 "chunks": ("for i_t in range(n_chunks)", 0)}


def kda_chunk_launches(tokens: int, heads: int, prepare: KernelVariant, recurrence: KernelVariant,
                       path: tuple[str, int] | None = None) -> list[Launch]:
    """chunk_kda's launches for a prompt on `heads` (row, head) pairs, the JIT plugin's or the AOT nodes'
    (`prepare`, `recurrence`): the parallel prepare over (chunk, head), then the recurrence over the chunks
    (the dependent chain)."""
    from k3plugins import kda

    chunk = kda.CHUNK_SIZE
    chunks = cdiv(tokens, chunk)
    block_v = recurrence.constexprs["BV"]
    chain = "for i_t in range(n_chunks)"
    # The scores' factored products take 16 key channels a trip; the steep chunks' loop is not taken; the
    # 16-row solve compiles unrolled (straight-line code), and so do the value blocks where V is compiled in
    # (the AOT kernel: a constant trip count).
    trips = {"for c0 in range(0, K, BC)": cdiv(KDA_K, 16)}
    if "V" not in prepare.constexprs:
        trips["for v0 in range(0, V, BV)"] = cdiv(KDA_V, prepare.constexprs["BV"])
    return [
        Launch(prepare, (chunks, heads), trips),
        Launch(recurrence, (heads, cdiv(KDA_V, block_v)), {chain: chunks},
               chain, 2 * chunk * (3 * KDA_K + chunk) * block_v, "FLOP", chain=chain, path=path),
    ]


def _torch_bf16() -> Any:
    import torch

    return torch.bfloat16


@functools.cache
def _jit_variants() -> dict[str, KernelVariant]:
    return {v.name: v for v in kernel_variants()}


def jit_variant(name: str) -> KernelVariant:
    """One of k3plugins.kernel_variants() by name."""
    if name not in _jit_variants():
        raise KeyError(f"no JIT kernel variant {name}")
    return _jit_variants()[name]


OPS: dict[str, Callable[[], list[Row]]] = {"moe": moe_rows, "mla": mla_rows, "kda": kda_rows}

# The anchors' published figures (../shared/KERNELS.md gives the sources).
ANCHORS = {
    "moe": ["DeepGEMM grouped GEMMs (FP8, H800, its README): about 2 TB/s at masked decode shapes, "
            "1,100-1,300 TFLOP/s contiguous",
            "vLLM fused experts, bf16 weights, EP8, H200 at 1,024 local tokens: 322 TFLOP/s a GPU "
            "(InferenceX's K3 profile)"],
    "mla": ["FlashMLA (H800): up to about 3,000 GB/s memory-bound decode, about 90% of HBM"],
    "kda": ["prefill T = 8192: FlashKDA 2.62 ms vs fla 4.51 ms on an H20; H200, 64 heads: fla 1.78 ms, "
            "FlashKDA 1.21 ms (cuLA's table); cuLA context parallelism 0.32 ms at 8 heads",
            "B200, T = 8192, 96 heads: TIRx's evolved KDA forward 0.31-0.37 ms",
            "decode: bound by the state's bytes (96 x 128 x 128 float32 read and written a layer a row)"],
}


# ---- the table ----

COLUMNS = ("op", "form", "shape", "kernel", "regs", "spill", "smem KB", "tensor cores", "hot SASS/unit",
           "chain BAR/SHFL", "MB", "GFLOP", "waves", "occ", "HBM us", "TC us", "issue us", "lat us", "est us",
           "% bound")


def fmt(x: float, digits: int = 1) -> str:
    if x == 0:
        return "0"
    return f"{x:,.{digits}f}" if abs(x) >= 10 ** -digits else f"{x:.1e}"


def table(estimates: Sequence[Estimate]) -> list[str]:
    """A markdown table: one line per row, a launch's kernel figures joined by ' / '."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for est in estimates:
        r, a, d = est.row, est.analyses, est.details

        def each(f: Callable[[Analysis, dict[str, Any], Launch], str], a: list[Analysis] = a,
                 d: list[dict[str, Any]] = d, launches: list[Launch] = r.launches) -> str:
            return " / ".join(f(x, y, z) for x, y, z in zip(a, d, launches, strict=True))

        cells = [r.op, r.form, r.shape + (f" ({r.note})" if r.note else ""),
                 each(lambda x, y, z: x.name + ("!" if x.warnings else "")),
                 each(lambda x, y, z: str(x.registers)),
                 each(lambda x, y, z: str(x.spill_stores + x.spill_loads)),
                 each(lambda x, y, z: fmt(x.shared / 1024)),
                 each(lambda x, y, z: x.tensor_cores),
                 each(lambda x, y, z: f"{y['hot_per_unit']:.3g}/{z.unit}" if "hot_per_unit" in y
                      else "-"),
                 each(lambda x, y, z: f"{y['chain_bar']:.0f}/{y['chain_shfl']:.0f}" if "chain_bar" in y
                      else "-"),
                 fmt(r.bytes / 1e6), fmt(r.flops / 1e9), each(lambda x, y, z: f"{y['waves']:.2g}"),
                 each(lambda x, y, z: str(y["occupancy"])),
                 fmt(est.memory_s * 1e6), fmt(est.tensor_s * 1e6), fmt(est.issue_s * 1e6),
                 fmt(est.latency_s * 1e6), fmt(est.time_s * 1e6), f"{est.percent:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    warned = {a.name: a.warnings for est in estimates for a in est.analyses if a.warnings}
    lines += [f"! {name}: {'; '.join(warnings)}" for name, warnings in warned.items()]
    return lines


def assumptions(m: Machine) -> list[str]:
    return [f"machine: {m.name} ({m.target}a): {m.sms} SMs, {m.issue_per_sm} warp-instructions a clock an "
            f"SM, {m.clock_ghz} GHz, {m.hbm_tbs} TB/s HBM, {m.bf16_tflops:,.0f} TFLOP/s dense bf16; "
            f"{m.registers_per_sm} registers, {m.shared_per_sm // 1024} KB shared, {m.warps_per_sm} warps an "
            f"SM (source: {m.source})",
            f"latency a dependent step: {BARRIER_CYCLES} clocks a BAR, {SHUFFLE_CYCLES} a SHFL on its "
            "longest dependency path, "
            f"{LOAD_CYCLES} once for an unprefetched global load (guesses to calibrate); not modelled: "
            "launch gaps, L2, bank conflicts, pipe throughput",
            "est = max(HBM, TC, issue + latency); % bound = max(HBM, TC) / est; hot SASS/unit = the hot "
            "loop's SASS x threads / the weights or FLOPs a trip does; chain = per step of the dependent "
            "loop, BARs / the SHFL on its longest path; "
            "bytes: the fewest the op moves (MoE: the chosen experts' packed MXFP4, 4.25 bits a weight); "
            "a kernel marked ! has loops the model cannot place (listed under the table)",
            f"Triton {triton.__version__}; widths: MoE L {MOE_L}, I {MOE_I}, {MOE_HELD} of {MOE_EXPERTS} "
            f"experts a rank, top-{MOE_TOP_K}; MLA latent {MLA_D}, values {MLA_V}; KDA K = V = {KDA_K}; bf16"]


def kernels_report(rows: Sequence[Row], m: Machine) -> list[str]:
    """Each kernel the rows launch, with its loops as compiled (what the rows' trips are keyed on)."""
    lines, seen = [], set()
    for row in rows:
        for launch in row.launches:
            a = analyse(launch.variant, m.target)
            if a.name in seen:
                continue
            seen.add(a.name)
            lines.append(f"{a.name} ({m.target}a): {a.registers} registers, spills {a.spill_stores}/"
                         f"{a.spill_loads} B, {a.shared} B shared, {a.num_warps} warps; PTX {a.ptx}; "
                         f"{a.straight.get('ALL', 0)} SASS outside loops")
            for part in a.parts if len(a.parts) > 1 else []:
                lines.append(f"  paths through loop {part.loop}: {part.own.get('ALL', 0)} SASS outside "
                             f"loops, loops {part.loops}")
            for i, lp in enumerate(a.loops):
                counts = ", ".join(f"{k} {lp.own[k]}" for k in SASS_SHOWN if lp.own.get(k))
                lines.append(f"  loop {i} `{lp.text}` ({lp.where}) in {lp.parent}: {lp.size} SASS "
                             f"({lp.own.get('ALL', 0)} its own{'; ' + counts if counts else ''})")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of %(default)s")
    p.add_argument("--machines", default="h100", help=f"comma-separated subset of {','.join(MACHINES)}")
    p.add_argument("--forms", default="AOT,JIT", help="comma-separated subset of %(default)s")
    p.add_argument("--kernels", action="store_true", help="list each kernel's compiled loops instead")
    args = p.parse_args(argv)
    for name, known in (("ops", OPS), ("machines", MACHINES), ("forms", ("AOT", "JIT"))):
        values = [v for v in getattr(args, name).split(",") if v]
        if not values or set(values) - set(known):
            p.error(f"--{name}: {getattr(args, name)!r}; choose from {','.join(known)}")
        setattr(args, name, values)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the tables; an op whose rows or kernels fail (a kernel being rewritten) is reported and the
    others still printed: exit 1 then."""
    args = parse_args(argv)
    failed = False
    for name in args.machines:
        m = MACHINES[name]
        if not args.kernels:
            print("\n".join(f"- {line}" for line in assumptions(m)))
        for op in args.ops:
            try:
                rows = [r for r in OPS[op]() if r.form in args.forms]
                lines = (kernels_report(rows, m) if args.kernels else
                         [f"\n{op}: anchors (published): " + "; ".join(ANCHORS[op]),
                          *table([estimate(r, m) for r in rows])])
            except Exception as exc:  # one op's failure must not hide the others
                failed = True
                lines = [f"\n{op} ({m.target}a): FAILED: {type(exc).__name__}: {exc}"]
            print("\n".join(lines), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
