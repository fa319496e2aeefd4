"""The float formats a merged weight is written in: transformers' fine-grained FP8 (128x128 block scales) and
gpt-oss's MXFP4 experts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .encoder import FP8_MAX, Encoder, block_tiles


@dataclass(frozen=True)
class Fp8Block(Encoder):
    """transformers' fine-grained FP8 (``quant_method: fp8``): float8_e4m3fn weights, one float32
    ``weight_scale_inv`` per 128x128 block, as ``Fp8Quantize`` (``transformers.integrations.finegrained_fp8``) makes
    them: ``scale = 448 / amax`` of the block (1 for a block of zeros), ``weight_scale_inv = 1 / scale``, codes
    ``clamp(w * scale, -448, 448)``. A weight whose sides are not whole blocks stays as merged, as it leaves it
    (named in ``modules_to_not_convert``: its loader would look for a scale).

    Attributes:
        block: ``weight_block_size``.
        scale_fmt: ``"float"``, or ``"ue8m0"`` (scales rounded up to a power of two, stored as float8_e8m0fnu).
        keep_exact: a block whose merged values are exactly FP8 codes times a scale near the quantizer's (a block
            of an FP8 base the merge left as stored) keeps those codes and that scale: an FP8 base written back
            gives its own bytes where the adapter changed nothing.

    Example:
        >>> enc = Fp8Block()
        >>> codes, inv = enc.encode(torch.full((128, 128), 2.0, dtype=torch.bfloat16))
        >>> codes.dtype, float(codes[0, 0].float()), inv.tolist()
        (torch.float8_e4m3fn, 448.0, [[0.004464285913854837]])
    """

    name: ClassVar[str] = "fp8-block"
    tool: ClassVar[str] = "transformers.integrations.finegrained_fp8.Fp8Quantize"
    block: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"
    keep_exact: bool = False

    def keeps(self, shape):
        return shape[-2] % self.block[0] != 0 or shape[-1] % self.block[1] != 0

    def parts(self, shape, dtype):
        rows, cols = shape[-2] // self.block[0], shape[-1] // self.block[1]
        return [("", "F8_E4M3", tuple(shape)), ("weight_scale_inv", self._scale_dtype, (*shape[:-2], rows, cols))]

    @property
    def _scale_dtype(self) -> str:
        return "F8_E8M0" if self.scale_fmt == "ue8m0" else "F32"

    def unit(self, shape):
        return self.block[0]

    def first(self, rows, dtype=torch.bfloat16):
        return self._rows(rows)

    def rest(self, sides, shape, dtype=torch.bfloat16):
        return [torch.cat(sides)]

    def _rows(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and inverse scales of whole rows of blocks."""
        tiles = block_tiles(weight.to(torch.float32), self.block)
        amax = tiles.abs().amax(dim=(-3, -1))
        scales = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)), 1.0)
        inv = (1.0 / scales).to(torch.float32)
        if self.scale_fmt == "ue8m0":
            inv = torch.pow(2.0, torch.ceil(torch.log2(inv.clamp(min=torch.finfo(torch.float32).tiny))))
            inv = inv.to(torch.float8_e8m0fnu)
            scales = 1.0 / inv.to(torch.float32)
        codes = torch.clamp(tiles * scales.unsqueeze(-1).unsqueeze(-3), -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if self.keep_exact and self.scale_fmt != "ue8m0":
            codes, inv = _exact_tiles(tiles, codes, inv)
        return codes.reshape(weight.shape), inv

    def config(self, kept, dtype, unconverted=(set(), set())):
        from transformers import FineGrainedFP8Config

        outputs, experts = unconverted
        # transformers adds its own skips (the output layer) only where the list is None: a list names them too
        skip = [*sorted(outputs), *sorted(experts), *kept] if kept or experts else None
        qc = FineGrainedFP8Config(
            weight_block_size=tuple(self.block), modules_to_not_convert=skip, scale_fmt=self.scale_fmt
        )
        return qc.to_dict()


@dataclass(frozen=True)
class Mxfp4(Encoder):
    """MXFP4 as gpt-oss stores its experts (``quant_method: mxfp4``): each fused expert weight, ``[experts, in, out]``
    as transformers holds it, stored per expert as ``[out, in]`` in groups of 32 inputs, an E8M0 exponent
    (``*_scales``, ``[experts, out, groups]``) and 32 FP4 E2M1 codes, two a byte, the first in the low bits
    (``*_blocks``, ``[experts, out, groups, 16]``). Quantized as triton_kernels' ``downcast_to_mxfp_torch`` (the
    reference OpenAI's own kernels ship; the quantizer gpt-oss was made with is not published): the group's scale is
    ``amax / 6`` rounded up to a power of two, each value divided by it rounds to the nearest E2M1 value, a tie away
    from zero, clamped to 6.

    Example:
        >>> blocks, scales = Mxfp4().encode(torch.full((1, 32, 1), 3.0), torch.bfloat16)
        >>> blocks.shape, scales.tolist(), hex(blocks[0, 0, 0, 0].item())
        (torch.Size([1, 1, 1, 16]), [[[126]]], '0x77')
    """

    name: ClassVar[str] = "mxfp4"
    tool: ClassVar[str] = "triton_kernels.numerics_details.mxfp.downcast_to_mxfp_torch"

    def refuses(self, name, shape):
        if len(shape) != 3 or shape[1] % 32:
            return (
                f"{name}: MXFP4 stores [experts, in, out] weights with in a multiple of 32, this one is {list(shape)}"
            )
        return None

    def parts(self, shape, dtype):
        experts, fan_in, fan_out = shape
        return [
            ("*_blocks", "U8", (experts, fan_out, fan_in // 32, 16)),
            ("*_scales", "U8", (experts, fan_out, fan_in // 32)),
        ]

    def unit(self, shape):
        return 1  # an expert

    def rest(self, sides, shape, dtype=torch.bfloat16):
        return [torch.cat(sides)]

    def first(self, weight, dtype=torch.bfloat16):
        experts, fan_in, fan_out = weight.shape
        x = weight.to(torch.float32).transpose(1, 2).reshape(experts, fan_out, fan_in // 32, 32)
        amax = x.abs().amax(dim=-1, keepdim=True)
        bits = (amax / 6.0).view(torch.int32)
        rounded = (bits + 0x007FFFFF) & 0x7F800000  # up to a power of two
        scale = rounded.view(torch.float32)
        q = x * torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
        codes = _e2m1(q)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return packed.contiguous(), (rounded >> 23).to(torch.uint8).squeeze(-1)

    def config(self, kept, dtype, unconverted=(set(), set())):
        from transformers import Mxfp4Config

        return Mxfp4Config().to_dict()


def _e2m1(q: torch.Tensor) -> torch.Tensor:
    """The FP4 E2M1 codes (sign in bit 3) of float32 values: the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6, a tie away
    from zero, beyond 6 clamped (the bit arithmetic of the reference)."""
    bits = q.contiguous().view(torch.int32)
    sign = (bits >> 28) & 0x8
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    sub = ((0x400000 | (mantissa >> 1)) >> (126 - exponent).clamp(min=0, max=31)) & 0x7FFFFF
    mantissa = torch.where(exponent < 127, sub, mantissa)
    exponent = exponent.clamp(min=126) - 126
    code = ((((exponent << 2) | (mantissa >> 21)) + 1) >> 1).clamp(max=7)
    return (sign | code).to(torch.uint8)


def _exact_tiles(tiles: torch.Tensor, codes: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, the quantizer's codes and inverse scale, unless they do not give the block's values back exactly
    and FP8 codes times one of the four floats nearest that scale do: then those codes and that scale."""
    out_codes, out_inv = codes.view(torch.uint8).clone(), inv.clone()
    fitted = (codes.to(torch.float32) * inv.unsqueeze(-1).unsqueeze(-3) == tiles).all(dim=-1).all(dim=-2)
    up, down = inv, inv
    candidates = []
    for _ in range(2):
        up, down = torch.nextafter(up, torch.full_like(up, math.inf)), torch.nextafter(down, torch.zeros_like(down))
        candidates += [down, up]
    for s in candidates:
        if bool(fitted.all()):
            break
        s_b = s.unsqueeze(-1).unsqueeze(-3)
        c = torch.clamp(tiles / s_b, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        fits = (c.to(torch.float32) * s_b == tiles).all(dim=-1).all(dim=-2) & ~fitted
        out_codes = torch.where(fits.unsqueeze(-1).unsqueeze(-3).expand_as(tiles), c.view(torch.uint8), out_codes)
        out_inv = torch.where(fits, s, out_inv)
        fitted |= fits
    return out_codes.view(torch.float8_e4m3fn), out_inv
