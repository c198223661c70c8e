"""tools/kernel_estimate.py on what runs in seconds: its reading of compiled code (a tiny kernel with tl.dot
shows tensor-core instructions, one without shows none; each loop named by its `for`), its arithmetic on one
row against figures worked by hand, and the rank's routing the MoE rows assume. (The published-width
kernels take minutes to compile: the tool itself does that, not CI.)"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import triton
import triton.language as tl
from test_gpu_check import tool

import k3plugins
from k3plugins.variants import KernelVariant

kernel_estimate = tool("kernel_estimate")

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="TRITON_INTERPRET is set: these compile kernels")


@triton.jit
def _dot_kernel(a, b, c, K, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(a + offs[:, None] * K + k0 + offs[None, :])
        y = tl.load(b + (k0 + offs[:, None]) * BLOCK + offs[None, :])
        acc = tl.dot(x, y, acc)
    tl.store(c + offs[:, None] * BLOCK + offs[None, :], acc)


@triton.jit
def _scale_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for i0 in range(0, n, BLOCK):
        v = tl.load(x + i0 + offs, mask=i0 + offs < n)
        tl.store(y + i0 + offs, v * 2.0, mask=i0 + offs < n)


@triton.jit
def _dot_step(a, b, k0, K, offs, acc, BLOCK: tl.constexpr):
    x = tl.load(a + offs[:, None] * K + k0 + offs[None, :])
    y = tl.load(b + (k0 + offs[:, None]) * BLOCK + offs[None, :])
    return tl.dot(x, y, acc)


@triton.jit
def _helper_loop_kernel(a, b, c, K, BLOCK: tl.constexpr):
    # The loop's body is an inlined helper: sm_100a's backward branch carries one of its lines.
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        acc = _dot_step(a, b, k0, K, offs, acc, BLOCK)
    tl.store(c + offs[:, None] * BLOCK + offs[None, :], acc)


def variant(fn: triton.JITFunction, signature: dict[str, str], name: str) -> KernelVariant:
    return KernelVariant(name, fn, {**signature, "BLOCK": "constexpr"}, {"BLOCK": 64}, num_warps=4,
                         num_stages=2)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(kernel_estimate, "CACHE", tmp_path)
    return tmp_path


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_a_dot_shows_tensor_cores_and_a_loop_without_none(cache: Path, target: str) -> None:
    dot = kernel_estimate.analyse(variant(_dot_kernel, {"a": "*bf16", "b": "*bf16", "c": "*fp32", "K": "i32"},
                                          "dot"), target)
    assert dot.ptx["mma.sync"] + dot.ptx["wgmma"] + dot.ptx["tcgen05"] > 0 and dot.tensor_cores != "none"
    loop = dot.loops[dot.loop("for k0 in range(0, K, BLOCK)")]
    assert loop.where == f"{Path(__file__).name}:{_dot_kernel.starting_line_number + 4}"
    assert loop.size >= loop.own["ALL"] > 0
    plain = kernel_estimate.analyse(variant(_scale_kernel, {"x": "*fp32", "y": "*fp32", "n": "i32"}, "scale"),
                                    target)
    assert plain.tensor_cores == "none" and plain.loop("for i0 in range(0, n, BLOCK)") == 0
    # The loop's own opcodes plus the straight-line code are every instruction.
    assert sum(lp.own["ALL"] for lp in plain.loops) + plain.straight["ALL"] == plain.loops[0].size + \
        plain.straight["ALL"]
    assert len(list(cache.glob("*.json"))) == 2  # cached: a second call reads the file
    assert kernel_estimate.analyse(variant(_scale_kernel, {"x": "*fp32", "y": "*fp32", "n": "i32"}, "scale"),
                                   target) == plain


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_a_loop_whose_body_is_an_inlined_helper_is_named_by_its_for(cache: Path, target: str) -> None:
    """MLA's decode loop calls _attend_block: on sm_100a its branch's line is the helper's, and the loop
    went unnamed (the tool's rows then failed with a KeyError)."""
    helper = kernel_estimate.analyse(variant(_helper_loop_kernel, {"a": "*bf16", "b": "*bf16", "c": "*fp32",
                                                                   "K": "i32"}, "helper_loop"), target)
    named = [lp for lp in helper.loops if lp.text == "for k0 in range(0, K, BLOCK)"]
    line = _helper_loop_kernel.starting_line_number + 5
    assert named and {lp.where for lp in named} == {f"{Path(__file__).name}:{line}"}
    # Left unnamed: only a wait's few instructions (sm_100a's barrier spins), which the model may skip.
    assert not [w for w in helper.warnings if "unnamed" in w]


def test_the_estimate_of_a_row_against_figures_worked_by_hand() -> None:
    Loop, Analysis = kernel_estimate.Loop, kernel_estimate.Analysis
    # 4 warps at 128 registers: 4 blocks an SM; 100 instructions outside the loop, 50 a trip, 10 trips.
    loop = Loop("for t in range(T)", "k.py:3", 16, 800, 50, {"ALL": 50, "BAR": 2, "SHFL": 2, "LDG": 1}, None,
                shuffle_depth=1)  # 2 shuffles, one path waiting for 1 of them
    analysis = Analysis("k", "sm90", 4, 128, 0, 0, 0, {"mma.sync": 0, "wgmma": 0, "tcgen05": 0},
                        {"ALL": 100}, [loop])
    launch = kernel_estimate.Launch(variant(_scale_kernel, {}, "k"), (264,), {"for t in range(T)": 10},
                                    hot="for t in range(T)", hot_units=64, unit="FLOP",
                                    chain="for t in range(T)")
    row = kernel_estimate.Row("kda", "AOT", "test", [launch], bytes=1e6, flops=0.0)
    est = kernel_estimate.estimate(row, kernel_estimate.MACHINES["h100"], [analysis])
    clock = 1.755e9
    # 264 programs on 132 SMs: 2 an SM, both resident (8 warps, 4 issue slots); each warp 100 + 10 x 50.
    assert est.details[0]["occupancy"] == 4
    assert est.issue_s == pytest.approx(2 * 4 * 600 / 4 / clock)
    # A trip waits 2 barriers and the shuffle on its path at 30 clocks, and an unprefetched load at 600; the
    # 2 programs overlap.
    assert est.latency_s == pytest.approx(10 * (2 * 30 + 30 + 600) / clock)
    assert est.memory_s == pytest.approx(1e6 / 3.35e12) and est.tensor_s == 0
    assert est.time_s == pytest.approx(4.6154e-6, rel=1e-4)  # issue 0.684 us + latency 3.932 us
    assert est.percent == pytest.approx(100 * 0.29851 / 4.6154, rel=1e-3)
    assert est.details[0]["hot_per_unit"] == 50 * 128 / 64  # SASS x threads / FLOPs a trip
    line = kernel_estimate.table([est])[2]
    assert "| 2/1 |" in line and "| 4.6 |" in line and f"| {est.percent:.3g} |" in line


def test_the_moe_rows_routing_puts_two_slots_of_each_token_on_the_rank() -> None:
    routing = kernel_estimate.moe_routing(112)
    held = [[e for e in token if e < kernel_estimate.MOE_HELD] for token in routing]
    assert all(len(set(token)) == kernel_estimate.MOE_TOP_K for token in routing)
    assert all(len(h) == 2 for h in held)  # 16 x 112 / 896
    counts = [sum(e == x for h in held for e in h) for x in range(kernel_estimate.MOE_HELD)]
    assert min(counts) == max(counts) == 2  # spread evenly over the rank's experts
    assert math.isclose(kernel_estimate.MXFP4_BYTES * 32, 17)


def test_the_kda_step_sums_within_a_warp(cache: Path) -> None:
    """The decode step at the published widths (bf16, K = V = 128) as the JIT plugin (recurrent_kda) and
    KDAChunkRecurrence's AOT kernel compile it for sm_90a: its sums over the key channels are in-thread adds
    and shuffles between the lanes along K, so a token's step has no barrier and at most log2(lanes) shuffles
    a sum (8 lanes; the AOT kernel's two steps, each on its path through the code: 16 and 4). With Triton's
    own layout for the state it had 11-17 barriers and 24-27 shuffles."""
    from k3plugins import trt_aot

    jit = next(v for v in k3plugins.kernel_variants() if v.name == "recurrent_kda_bf16_k128")
    aot = trt_aot.kda_two_node_aot_kernels("bfloat16", 128, 128)[1]
    # KDAChunkRecurrence's steps: its NARROW_BV columns (16 lanes on K) and its BV (4), each in its part.
    paths = kernel_estimate.KDA_AOT_PATHS
    for variant, lanes, path in ((jit, jit.constexprs["LANES_K"], None),
                                 (aot, aot.constexprs["NARROW_LANES_K"], paths["narrow step"]),
                                 (aot, aot.constexprs["LANES_K"], paths["step"])):
        analysis = kernel_estimate.analyse(variant, "sm90")
        loop = analysis.loops[analysis.loop("for t in range(T)", analysis.part(path))]
        rounds = lanes.bit_length() - 1  # log2(lanes) shuffles a sum
        assert loop.own.get("BAR", 0) == 0 and 0 < loop.own["SHFL"] <= 3 * rounds, (variant.name, loop.own)
        # The three sums are reduced side by side: their shuffles overlap, one sum's rounds on the path.
        assert loop.shuffle_depth == rounds, (variant.name, loop.shuffle_depth)
    chunks = analysis.part(paths["chunks"]).loops
    assert [analysis.loops[i].text for i in chunks] == ["for i_t in range(n_chunks)"]


def test_the_shuffle_depth_counts_the_shuffles_one_path_waits_for() -> None:
    """SASS as nvdisasm prints it: three butterfly sums side by side (the KDA step's) wait for 2 shuffles,
    not 6; a sum whose input comes through shared memory past a barrier waits for the shuffles before it."""
    def butterfly(sums: list[str], rounds: int, first: int) -> list[tuple[str, str]]:
        body, regs = [], {name: name for name in sums}
        for r in range(rounds):
            for n, name in enumerate(sums):
                out = f"R{first + 10 * r + n}"
                body += [("SHFL", f" PT, {out}, {regs[name]}, 0x{1 << r:x}, 0x1f"),
                         ("FADD", f" {out}, {regs[name]}, {out}")]
                regs[name] = out
        return body
    side_by_side = butterfly(["R1", "R2", "R3"], 2, 100)
    assert kernel_estimate.shuffle_depth(side_by_side) == 2
    chained = [*butterfly(["R1"], 2, 100), ("FMUL", " R5, R110, R110"), *butterfly(["R5"], 2, 200)]
    assert kernel_estimate.shuffle_depth(chained) == 4
    # Through shared memory: the store reads R110 and writes no register; the barrier orders the load after.
    shared = [*butterfly(["R1"], 2, 100), ("STS", " [R9], R110"), ("BAR", " SYNC.DEFER_BLOCKING 0x0"),
              ("LDS", " R6, [R9]"), *butterfly(["R6"], 2, 200)]
    assert kernel_estimate.shuffle_depth(shared) == 4
    assert kernel_estimate.shuffle_depth([*butterfly(["R1"], 2, 100), *butterfly(["R2"], 3, 200)]) == 3


@triton.jit
def _two_paths_kernel(x, y, n, fast, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if fast > 0:
        for i0 in range(0, n, BLOCK):
            tl.store(y + i0 + offs, tl.load(x + i0 + offs) * 2.0)
    else:
        for j0 in range(0, n, 2 * BLOCK):
            v = tl.load(x + j0 + offs)
            tl.store(y + j0 + offs, tl.exp(v) + tl.sqrt(v))


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_a_launch_is_charged_only_the_path_it_runs(cache: Path, target: str) -> None:
    """A kernel that picks its path at run time: a launch naming the loop it runs is charged the code on the
    paths through it and that loop, never the other path's (sm_90a ends each path in an EXIT, sm_100a joins
    them before one)."""
    signature = {"x": "*fp32", "y": "*fp32", "n": "i32", "fast": "i32"}
    a = kernel_estimate.analyse(variant(_two_paths_kernel, signature, "paths"), target)
    texts = ["for i0 in range(0, n, BLOCK)", "for j0 in range(0, n, 2 * BLOCK)"]
    trips = dict(zip(texts, (3, 5), strict=True))
    whole = kernel_estimate.program_instructions(a, trips)
    for text in texts:
        part = a.part((text, 0))
        [loop] = [a.loops[i] for i in part.loops]
        assert loop.text == text and 0 < part.own["ALL"] < a.straight["ALL"]
        charged = kernel_estimate.program_instructions(a, trips, part=part)
        assert charged == part.own["ALL"] + loop.own["ALL"] * trips[text] < whole
    # exp and sqrt (MUFU) are the other path's only, some of them compiled outside its loop.
    assert "MUFU" not in a.part((texts[0], 0)).own and "MUFU" in a.part((texts[1], 0)).own
    assert not a.warnings
