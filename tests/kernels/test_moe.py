"""The routed-experts Triton kernels (k3plugins.moe) against the eager ops `torch.ops.k3.routed_experts`
and `routed_experts_mxfp4`, run in float64 on the same (rounded) inputs: float32 and float16
activations, float and MXFP4 experts, both tile sets of each dtype (decode: 16 pairs a tile, prefill:
64; token counts that are not multiples of either), random routing, k = 1, experts that receive no token,
every token on one expert (several tiles of pairs), a token's slots sharing an expert, pairs held by
another rank. The MXFP4 kernels
take int32 words (k3export/ops/mxfp4.py, "Words"), made here by viewing k3export.ops.mxfp4.quantize's bytes;
the eager op takes the bytes. bfloat16 is not tested: the interpreter's bf16 arithmetic is silently
wrong."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from reference import rel_error
from torch import Tensor

import k3export.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3export.ops import mxfp4
from k3plugins import moe, trt_aot
from k3plugins.definitions import ROUTED_EXPERTS, ROUTED_EXPERTS_MXFP4

BETA, LINEAR_BETA = 4.0, 25.0
# float16: z and the weights are rounded before both sides see them; the kernel rounds h to float16
# (as the eager op does) and the products' inputs are float16 with float32 accumulation, each
# relative 2^-11 (5e-4) per element: 2e-3 leaves room for their sum.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


def routing(case: str, N: int, E: int, k: int, gen: torch.Generator) -> Tensor:
    """experts [N, k]: distinct experts per token, as the router's top-k gives them."""
    if case == "one_expert":  # every token on expert 2 (k = 1)
        return torch.full((N, 1), 2, dtype=torch.int64)
    if case == "unused":  # only the even experts receive tokens
        choice = [torch.randperm(E // 2, generator=gen)[:k] * 2 for _ in range(N)]
    elif case == "repeated":  # slots of one token sharing an expert (drawn with replacement)
        return torch.randint(0, E, (N, k), generator=gen)
    else:
        choice = [torch.randperm(E, generator=gen)[:k] for _ in range(N)]
    return torch.stack(choice)


def inputs(N: int, L: int, I: int, E: int, k: int, case: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(N, L, generator=gen)
    experts = routing(case, N, E, k, gen)
    weights = torch.rand(experts.shape, generator=gen)
    weights = weights / weights.sum(1, keepdim=True)
    w1 = torch.randn(E, I, L, generator=gen) * L**-0.5
    w3 = torch.randn(E, I, L, generator=gen) * L**-0.5
    w2 = torch.randn(E, L, I, generator=gen) * I**-0.5
    return z, experts, weights, (w1, w3, w2)


def doubles(tensors):
    return [t.double() if t.is_floating_point() else t for t in tensors]


CASES = [  # N, L, I, E, k, routing
    (13, 64, 96, 6, 2, "random"),
    (9, 32, 32, 8, 1, "random"),  # k = 1 (the tiny widths)
    (11, 64, 64, 8, 3, "unused"),  # half the experts receive no token
    (150, 32, 64, 4, 1, "one_expert"),  # one expert, several tiles of pairs (128 a prefill tile)
    (17, 64, 96, 3, 4, "repeated"),  # a token's slots sharing an expert
]


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}_L{c[1]}_I{c[2]}_E{c[3]}_k{c[4]}_{c[5]}")
def test_routed_experts(case, dtype: torch.dtype, mode: str) -> None:
    tiles = moe.tile_choices(dtype)[mode]
    z, experts, weights, (w1, w3, w2) = inputs(*case)
    z, w1, w3, w2 = (t.to(dtype) for t in (z, w1, w3, w2))
    u = moe.routed_experts(z, experts, weights, w1, w3, w2, BETA, LINEAR_BETA, tiles=tiles)
    expected = torch.ops.k3.routed_experts(*doubles([z, experts, weights, w1, w3, w2]), BETA, LINEAR_BETA)
    assert u.dtype == torch.float32 and u.shape == z.shape
    assert rel_error(u, expected) < TOLERANCES[dtype]


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}_L{c[1]}_I{c[2]}_E{c[3]}_k{c[4]}_{c[5]}")
def test_routed_experts_mxfp4(case, dtype: torch.dtype, mode: str) -> None:
    tiles = moe.tile_choices(dtype, packed=True)[mode]
    z, experts, weights, dense = inputs(*case)
    packed = [part for w in dense for part in mxfp4.quantize(w)]
    z = z.to(dtype)
    u = moe.routed_experts_mxfp4(z, experts, weights, *map(moe.words, packed), BETA, LINEAR_BETA, tiles=tiles)
    expected = torch.ops.k3.routed_experts_mxfp4(z.double(), experts, weights.double(), *packed, BETA,
                                                 LINEAR_BETA)
    assert rel_error(u, expected) < TOLERANCES[dtype]


# float32 decodes a tile at a time (the reshape form); float16 one code of each word per product (the
# tensor-core form), its scales within float16's range for these codes.
@pytest.mark.parametrize(("dtype", "scales", "tolerance"), [(torch.float32, (40, 220), 1e-5),
                                                             (torch.float16, (112, 139), 2e-3)], ids=str)
def test_mxfp4_decodes_every_code_and_scale(dtype: torch.dtype, scales: tuple[int, int],
                                            tolerance: float) -> None:
    """Every byte value in the gate and up weights, and a scale byte per down-projection row over `scales`:
    each output column, scaled by its row's 2^(s - 127), against the eager op. Below 40 the float32
    products turn subnormal."""
    E, I, L = 1, 64, 256
    gen = torch.Generator().manual_seed(3)
    gate_up = [torch.arange(256, dtype=torch.uint8).repeat(I * L // 512).view(E, I, L // 2)
               for _ in range(2)]
    # Scales near 127 keep the SiTU-GLU out of saturation.
    gate_up_scales = [torch.randint(122, 131, (E, I, L // 32), generator=gen, dtype=torch.uint8)
                      for _ in range(2)]
    down = torch.randint(0, 256, (E, L, I // 2), generator=gen, dtype=torch.uint8)
    low, high = scales
    row_scales = (low + torch.arange(L) * (high - low) // L).to(torch.uint8)
    down_scales = row_scales[None, :, None].expand(E, L, I // 32)
    args = [gate_up[0], gate_up_scales[0], gate_up[1], gate_up_scales[1], down, down_scales.contiguous()]
    z = (torch.randn(4, L, generator=gen) * 0.05).to(dtype)
    experts = torch.zeros(4, 1, dtype=torch.int64)
    weights = torch.ones(4, 1)
    u = moe.routed_experts_mxfp4(z, experts, weights, *map(moe.words, args), BETA, LINEAR_BETA)
    expected = torch.ops.k3.routed_experts_mxfp4(z.double(), experts, weights.double(), *args, BETA,
                                                 LINEAR_BETA)
    column_error = (u.double() - expected).norm(dim=0) / expected.norm(dim=0)
    assert column_error.max() < tolerance


@triton.jit
def _decoded_rows(words, scales, out, codes, factors, ROWS: tl.constexpr):
    # Rows of 32 inputs (one scale byte each) as the kernels decode them for float32 and float16 activations
    # (moe._weight_tile: float32 multiplies); for bfloat16 activations, the codes before the multiplies and
    # the scale factor, as bits.
    rows = tl.arange(0, ROWS).to(tl.int64)
    tile = moe._weight_tile(words, scales, rows, rows < ROWS, 0, 32, tl.float32, True, ROWS, 32)
    tl.store(out + rows[:, None] * 32 + tl.arange(0, 32)[None, :], tile)
    offs = rows[:, None] * 32 + 8 * tl.arange(0, 4)[None, :]
    word = tl.load(words + rows[:, None] * 4 + tl.arange(0, 4)[None, :])
    for i in tl.static_range(4):
        first, second = moe._e2m1_codes(moe._e2m1_pair(word, i), tl.bfloat16)
        tl.store(codes + offs + i, first.to(tl.int16, bitcast=True))
        tl.store(codes + offs + i + 4, second.to(tl.int16, bitcast=True))
    scale = tl.load(scales.to(tl.pointer_type(tl.uint8)) + rows).to(tl.int32)
    tl.store(factors + rows, moe._scale_factor(scale, tl.bfloat16).to(tl.int16, bitcast=True))


# Scale byte 254 overflows codes 6 and -6 to infinity, as dequantize does (the export refuses them).
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_decode_of_every_code_and_scale_byte() -> None:
    """Every E2M1 code in every nibble of a word under every scale byte 0 .. 254 (row s has scale byte s,
    its codes rotated by s) through the kernels' decode (moe._weight_tile), bit for bit against
    k3export.ops.mxfp4.dequantize in float32 (what float16 activations multiply in: denormals down to
    2^-128 included); for bfloat16 activations the codes (the value times 2^-126) and the scale factor
    2^(s - 127), as bits, against dequantize's in bfloat16. (The bfloat16 multiplies themselves run on a GPU
    only: the interpreter's bf16 arithmetic is wrong.)"""
    rows = 256  # scale bytes 0 .. 254, and 127 again (255 is NaN)
    codes = (torch.arange(32)[None, :] + torch.arange(rows)[:, None]) % 16
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8)[None]
    scale = torch.arange(rows).clamp(max=254)[None, :, None].to(torch.uint8)
    scale[0, 255] = 127
    out = torch.empty(rows, 32)
    bf16_codes = torch.empty(rows, 32, dtype=torch.int16)
    factors = torch.empty(rows, dtype=torch.int16)
    _decoded_rows[(1,)](moe.words(packed), moe.words(scale), out, bf16_codes, factors, ROWS=rows)
    expected = mxfp4.dequantize(packed, scale, torch.float32)[0]
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    unscaled = mxfp4.dequantize(packed, torch.full_like(scale, 127), torch.float32)[0] * 2.0**-126
    assert torch.equal(bf16_codes, unscaled.to(torch.bfloat16).view(torch.int16))
    bf16_scales = mxfp4.SCALE_VALUES[scale.flatten().long()].to(torch.bfloat16)
    assert torch.equal(factors, bf16_scales.view(torch.int16))


def test_words_hold_the_bytes_little_endian() -> None:
    """moe.words (the kernels' layout) against a decoder written here: byte 4j + b of an expert is
    bits 8b .. 8b + 7 of its word j, for codes and for scales of one byte per row (k3-tiny's I = 32)."""
    packed, scale = mxfp4.quantize(torch.randn(3, 32, 32))
    for stacked in (packed, scale):
        words = moe.words(stacked)
        assert words.dtype == torch.int32 and words.shape == (3, stacked[0].numel() // 4)
        unsigned = words.long() % (1 << 32)
        decoded = torch.stack([(unsigned >> (8 * b)) % 256 for b in range(4)], -1).view(stacked.shape)
        assert torch.equal(decoded.to(torch.uint8), stacked)
        assert torch.equal(moe.words(stacked), mxfp4.to_words(stacked))


def test_mxfp4_words_refuse_bytes() -> None:
    """uint8 bytes (or words of the wrong width) are refused, naming the tensor and the words expected."""
    z, experts, weights, dense = inputs(5, 32, 32, 4, 2, "random")
    packed = [part for w in dense for part in mxfp4.quantize(w)]
    with pytest.raises(ValueError, match=r"w1_packed is torch.uint8 \[4, 32, 16\]; expected"):
        moe.routed_experts_mxfp4(z, experts, weights, *packed, BETA, LINEAR_BETA)
    words = list(map(moe.words, packed))
    words[5] = words[5][:, :-1]
    expected = r"w2_scale is torch.int32 \[4, 7\]; expected torch.int32 words \[4, 8\]"
    with pytest.raises(ValueError, match=expected):
        moe.routed_experts_mxfp4(z, experts, weights, *words, BETA, LINEAR_BETA)


def check_grouping(experts: Tensor, E: int, expert_offset: int) -> None:
    """moe.group_pairs against a grouping written here: the held pairs by local expert in pair order, then
    the others in pair order; offsets the cumulative counts; each pair's slot its place, -1 when not held."""
    sorted_pairs, offsets, slots = moe.group_pairs(experts, E, expert_offset)
    flat = experts.flatten().tolist()
    local = [e - expert_offset if 0 <= e - expert_offset < E else E for e in flat]
    expected = sorted(range(len(flat)), key=lambda p: (local[p], p))
    assert sorted_pairs.tolist() == expected
    assert offsets.tolist() == [sum(g < e for g in local) for e in range(E + 1)]
    assert slots.flatten().tolist() == [expected.index(p) if local[p] < E else -1 for p in range(len(flat))]


def test_grouping() -> None:
    """Stable grouping by expert: unused experts, an expert whose pairs span chunks of the grouping kernel's
    pair blocks (GROUP_BLOCK) and a token choosing one expert in two slots."""
    gen = torch.Generator().manual_seed(1)
    check_grouping(routing("unused", 21, 8, 3, gen), 8, 0)
    many = torch.randint(0, 3, (moe.GROUP_BLOCK // 2 + 7, 3), generator=gen)
    check_grouping(many, 3, 0)
    check_grouping(torch.tensor([[1, 1], [0, 1]]), 2, 0)
    # Decode: k pairs of one token use at most k + 1 tiles, not one per expert.
    assert moe.max_tiles(16, 112, 16) == 17


def test_grouping_of_a_rank_of_experts() -> None:
    """With expert_offset 4 of 8 experts held 4: only pairs routed to 4 .. 7 get slots, the rest follow."""
    gen = torch.Generator().manual_seed(2)
    check_grouping(routing("random", 21, 8, 3, gen), 4, 4)
    check_grouping(torch.tensor([[0, 1, 3]]), 4, 4)  # nothing held here


@pytest.mark.parametrize("packed", [False, True], ids=["float", "mxfp4"])
def test_a_rank_of_experts(packed: bool) -> None:
    """Expert parallelism: experts 4 .. 7 of 8 with expert_offset 4 (the pairs held elsewhere get no slot)
    against the eager op on the same slice and offset."""
    z, experts, weights, dense = inputs(11, 64, 64, 8, 3, "random")
    held = [w[4:] for w in dense]
    if packed:
        codes = [part for w in held for part in mxfp4.quantize(w)]
        u = moe.routed_experts_mxfp4(z, experts, weights, *map(moe.words, codes), BETA, LINEAR_BETA, 4)
        expected = torch.ops.k3.routed_experts_mxfp4(z.double(), experts, weights.double(), *codes, BETA,
                                                     LINEAR_BETA, 4)
    else:
        u = moe.routed_experts(z, experts, weights, *held, BETA, LINEAR_BETA, 4)
        expected = torch.ops.k3.routed_experts(*doubles([z, experts, weights, *held]), BETA, LINEAR_BETA, 4)
    assert rel_error(u, expected) < 1e-5
    # A token routed only to experts held elsewhere gets exactly zero.
    elsewhere = torch.tensor([[0, 1, 3]])
    assert not moe.routed_experts(z[:1], elsewhere, weights[:1], *[w[4:] for w in dense], BETA, LINEAR_BETA,
                                  4).any()


def test_no_tokens_and_out_buffer() -> None:
    z, experts, weights, (w1, w3, w2) = inputs(5, 32, 32, 4, 2, "random")
    empty = moe.routed_experts(z[:0], experts[:0], weights[:0], w1, w3, w2, BETA, LINEAR_BETA)
    assert empty.shape == (0, 32)
    out = torch.full((5, 32), float("nan"))
    assert moe.routed_experts(z, experts, weights, w1, w3, w2, BETA, LINEAR_BETA, out=out) is out
    expected = torch.ops.k3.routed_experts(*doubles([z, experts, weights, w1, w3, w2]), BETA, LINEAR_BETA)
    assert rel_error(out, expected) < 1e-5


def test_plugin_launches() -> None:
    """The definitions' launches, as the adapters call them: into a given output buffer."""
    z, experts, weights, dense = inputs(7, 64, 32, 4, 2, "random")
    fields = {"situ_beta": BETA, "situ_linear_beta": LINEAR_BETA, "expert_offset": 0}
    u = torch.full((7, 64), float("nan"))
    ROUTED_EXPERTS.launch([z, experts, weights, *dense], [u], fields)
    expected = torch.ops.k3.routed_experts(*doubles([z, experts, weights, *dense]), BETA, LINEAR_BETA)
    assert rel_error(u, expected) < 1e-5
    packed = [part for w in dense for part in mxfp4.quantize(w)]
    plugin_inputs = [z, experts, weights, *map(moe.words, packed)]
    u = torch.full((7, 64), float("nan"))
    ROUTED_EXPERTS_MXFP4.launch(plugin_inputs, [u], fields)
    expected = torch.ops.k3.routed_experts_mxfp4(z.double(), experts, weights.double(), *packed, BETA,
                                                 LINEAR_BETA)
    assert rel_error(u, expected) < 1e-5
    # The reference path (check --network) views the words back as the eager op's bytes.
    reference = ROUTED_EXPERTS_MXFP4.reference_arguments(plugin_inputs)
    assert all(torch.equal(a, b) for a, b in zip(reference[3:], packed, strict=True))


def aot_routed_experts(z: Tensor, experts: Tensor, weights: Tensor, held: list[Tensor], packed: bool,
                       expert_offset: int = 0) -> Tensor:
    """The AOT plugin's kernel, launched as TensorRT would: the inputs in the plugin's order, then u."""
    N, L = z.shape
    E = held[0].shape[0]
    I = 8 * held[0].shape[1] // L if packed else held[0].shape[1]
    variant = trt_aot.routed_experts_aot_kernel(str(z.dtype).removeprefix("torch."), packed, L, I, E,
                                                experts.shape[1], expert_offset, BETA, LINEAR_BETA)
    grid, scalars = trt_aot.routed_experts_aot_launch(z.shape, L)
    u = torch.full((N, L), float("nan"))  # every element is written
    variant.fn[grid](z, experts, weights, *held, *scalars, u, **variant.constexprs,
                     num_warps=variant.num_warps)
    return u


# Each dtype with each expert form once, over the two cases (k = 2 random; k = 3, unused experts).
@pytest.mark.parametrize(("case", "dtype", "packed"), [
    (CASES[0], torch.float32, False), (CASES[2], torch.float16, False),
    (CASES[2], torch.float32, True), (CASES[0], torch.float16, True)],
    ids=["fp32_float_k2", "fp16_float_k3_unused", "fp32_mxfp4_k3_unused", "fp16_mxfp4_k2"])
def test_aot_kernel(case, dtype: torch.dtype, packed: bool) -> None:
    """The single-launch kernel RoutedExperts(MXFP4)'s aot_impl embeds, against the eager op; with
    expert_offset 2 (experts 2 .. E-1 held) so that pairs routed elsewhere add nothing."""
    z, experts, weights, dense = inputs(*case)
    z = z.to(dtype)
    held = [w[2:] for w in dense]
    if packed:
        codes = [part for w in held for part in mxfp4.quantize(w)]
        u = aot_routed_experts(z, experts, weights, [moe.words(c) for c in codes], True, 2)
        expected = torch.ops.k3.routed_experts_mxfp4(z.double(), experts, weights.double(), *codes, BETA,
                                                     LINEAR_BETA, 2)
    else:
        held = [w.to(dtype) for w in held]
        u = aot_routed_experts(z, experts, weights, held, False, 2)
        expected = torch.ops.k3.routed_experts(*doubles([z, experts, weights, *held]), BETA, LINEAR_BETA, 2)
    assert not u.isnan().any()
    assert rel_error(u, expected) < TOLERANCES[dtype]
