"""MXFP4 as the published checkpoint stores routed experts (compressed-tensors `mxfp4-pack-quantized`).

A weight [O, I] is held as `weight_packed` uint8 [O, I/2] and `weight_scale` uint8 [O, I/32]:
- each byte packs two E2M1 codes along the input dim, element 2i in the low nibble, 2i+1 in the high;
- an E2M1 code is bit 3 sign, bits 0-2 an index into {0, 0.5, 1, 1.5, 2, 3, 4, 6};
- each group of 32 inputs shares one E8M0 scale byte s, meaning 2^(s - 127); s = 255 is NaN.
Every decoded value is a power of two times an E2M1 value, so float32 and bfloat16 hold it exactly
unless it overflows (only possible for s >= 253). The functions are pure tensor code, so the
exported graph can run `dequantize` itself.

Words (the one description of the layout the ONNX file, the plugins and the kernels use): the
exported file holds each stacked tensor, packed [E, O, I/2] and scale [E, O, I/32], as int32 words
[E, O*I/8] and [E, O*I/128]: expert e's bytes in the order above (row-major), four at a time read
as a little-endian int32. The file's bytes are the checkpoint's; only the declared type and shape
differ (TensorRT-RTX 1.7's parser widens UINT8 initializers to INT32, one int32 per byte, but takes
INT32 as it is, so the experts reach the plugin at 4.25 bits per weight). Whole experts are
flattened because a row of scales may be shorter than a word (k3-tiny: I/32 = 1); O*I is a
multiple of 1024, so both always fit. In a flat expert, input k of row r is code c = r*I + k:
nibble c % 8 (bits 4*(c % 8) ..) of word c // 8; its scale is byte g = c // 32, bits 8*(g % 4) ..
of scale word g // 4. `to_words` converts; the eager op keeps the bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3export.errors import UserError

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NAN_SCALE = 255


class MXFP4Error(UserError):
    """Packed data that does not decode to finite weights; the message names the tensor."""


def _scale_values() -> Tensor:
    """2^(s - 127) for every byte s, built from float32 bit patterns so that each is exact
    (s = 0 is the subnormal 2^-127; s = 255 gives NaN, as OCP E8M0 defines it)."""
    bits = torch.arange(256, dtype=torch.int32) << 23
    bits[0] = 1 << 22
    bits[NAN_SCALE] = 0x7FC00000
    return bits.view(torch.float32)


# Lookup tables, built once: traced graphs then carry them as constants.
SCALE_VALUES = _scale_values()
E2M1_TABLE = torch.tensor(E2M1_VALUES)


def dequantize(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """packed [..., I/2] and scale [..., I/32] (uint8) -> weights [..., I] in `dtype`.

    Computed in float32, where every product is exact, then cast (exact for bfloat16 too)."""
    # Nibbles by integer division, not shifts: it exports to ONNX ops that every backend has
    # (the exporter's uint8 right shift is mistyped, and BitShift takes unsigned types only).
    byte = packed.long()
    codes = torch.stack([byte % 16, byte // 16], dim=-1).flatten(-2)
    magnitude = E2M1_TABLE.to(packed.device)[codes % 8]
    values = torch.where(codes >= 8, -magnitude, magnitude)
    factor = SCALE_VALUES.to(packed.device)[scale.long()]
    grouped = values.unflatten(-1, (scale.shape[-1], GROUP)) * factor[..., None]
    return grouped.flatten(-2).to(dtype)


def to_words(stacked: Tensor) -> Tensor:
    """packed [E, O, I/2] or scale [E, O, I/32] uint8 -> int32 words [E, O*I/8] or [E, O*I/128]: a
    view of the same bytes (little-endian; copied only if `stacked` is not contiguous)."""
    if stacked.dtype != torch.uint8 or stacked.dim() != 3 or stacked[0].numel() % 4:
        raise ValueError(f"MXFP4 words need uint8 [E, O, n] with O*n a multiple of 4; got {stacked.dtype} "
                         f"{list(stacked.shape)}")
    return stacked.contiguous().view(stacked.shape[0], -1).view(torch.int32)


def check(packed: Tensor, scale: Tensor, name: str, dtype: torch.dtype = torch.float32) -> None:
    """Refuses a scale byte of 255 (NaN in OCP E8M0) and values beyond the range of `dtype`, the
    dtype they will be decoded to (float16 overflows from scale byte 141 on)."""
    bad = (scale == NAN_SCALE).nonzero()
    if len(bad):
        raise MXFP4Error(f"{name}: {len(bad)} scale bytes are 255, NaN in OCP E8M0 (first at "
                         f"{bad[0].tolist()}); expected 0..254")
    largest = torch.finfo(dtype).max
    # Decode only when the largest scale can lift the largest E2M1 value (6) past the limit.
    top = int(scale.max())
    if 6 * 2.0 ** (top - 127) > largest \
            and not (dequantize(packed, scale, torch.float32).abs() <= largest).all():
        raise MXFP4Error(f"{name}: scale bytes of {top} make values beyond the "
                         f"{str(dtype).removeprefix('torch.')} range (largest finite {largest:.6g}); "
                         "expected finite weights")


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weights [..., I] -> (packed, scale), the inverse of `dequantize` up to rounding.

    Rounding rule: each group of 32 gets the smallest power-of-two scale 2^e with
    max|w| <= 6 * 2^e (so nothing saturates; e clamped to -127..127), and each w / 2^e rounds to
    the nearest E2M1 value, ties to the even code. The error is then at most half the local
    E2M1 spacing times 2^e: 0.25, 0.5 or 1 times 2^e below 2, 4 and 6 times 2^e."""
    if weight.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {GROUP}; got {list(weight.shape)}")
    groups = weight.float().unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(-1)
    powers = SCALE_VALUES
    exponent = torch.ceil(torch.log2(amax / 6)).nan_to_num(-127.0, -127.0, -127.0).clamp(-127, 127).long()
    # log2 in float is inexact: settle the exponent on exact power-of-two comparisons.
    exponent = exponent + ((amax > 6 * powers[exponent + 127]) & (exponent < 127)).long()
    exponent = exponent - ((amax <= 3 * powers[exponent + 127]) & (exponent > -127)).long()
    scaled = (groups / powers[exponent + 127][..., None]).abs()
    midpoints = (E2M1_TABLE[1:] + E2M1_TABLE[:-1]) / 2
    # Index of the nearest value; at a midpoint, the neighbour with the even index.
    index = (scaled[..., None] > midpoints).sum(-1)
    tie_up = (scaled[..., None] == midpoints) & (torch.arange(1, 8) % 2 == 0)
    index = index + tie_up.sum(-1)
    codes = (index + 8 * (groups < 0)).to(torch.uint8).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).to(torch.uint8)
