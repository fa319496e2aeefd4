"""compressed-tensors formats a merged weight is written in, as llm-compressor writes them for vLLM: FP8_BLOCK and
W4A16."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .encoder import FP8_MAX, Encoder, block_tiles


@dataclass(frozen=True)
class _Ct(Encoder):
    """compressed-tensors, as llm-compressor writes it: the scale from the weight's min and max in its own dtype
    (llm-compressor's memoryless min-max observer, then ``compressed_tensors``' ``calculate_qparams``), the codes
    ``weight / scale`` in that dtype, rounded (the compressor's ``quantize``)."""

    tool: ClassVar[str] = "compressed_tensors (llm-compressor's min-max observer)"
    fmt: ClassVar[str] = ""

    @staticmethod
    def _scale(amax_pos: torch.Tensor, half_range: float) -> torch.Tensor:
        """``calculate_qparams`` of a symmetric scheme: ``max(|min|, |max|) / (range / 2)`` in the weight's dtype,
        a zero scale replaced by that dtype's epsilon."""
        scales = amax_pos / torch.tensor(half_range, dtype=amax_pos.dtype)
        eps = torch.finfo(scales.dtype).eps
        return torch.where(scales == 0, torch.tensor(eps, dtype=scales.dtype), scales)

    def config(self, kept, dtype, unconverted=(set(), set())):
        return {
            "config_groups": {"group_0": {"targets": ["Linear"], **self.scheme(), "format": None}},
            "quant_method": "compressed-tensors",
            "kv_cache_scheme": None,
            "format": self.fmt,
            "quantization_status": "compressed",
            "global_compression_ratio": None,
            "ignore": [*(sorted(unconverted[0]) or ["lm_head"]), *kept],
            "moe_sparsity_config": None,
        }

    def scheme(self) -> dict:
        """The scheme's ``weights``/``input_activations``/``output_activations``, as llm-compressor's preset."""
        raise NotImplementedError  # pragma: no cover - each format says


@dataclass(frozen=True)
class CtFp8Block(_Ct):
    """compressed-tensors ``FP8_BLOCK``: float8_e4m3fn ``weight`` and a ``weight_scale`` per 128x128 block in the
    weight's dtype (``amax / 448``); a side that is not whole blocks is padded with zeros for its scales, as the
    compressor pads it.

    Example:
        >>> codes, scale = CtFp8Block().encode(torch.full((130, 128), 2.0, dtype=torch.bfloat16))
        >>> codes.shape, scale.shape, scale.dtype
        (torch.Size([130, 128]), torch.Size([2, 1]), torch.bfloat16)
    """

    name: ClassVar[str] = "ct-fp8-block"
    fmt: ClassVar[str] = "float-quantized"
    block: tuple[int, int] = (128, 128)

    def refuses(self, name, shape):
        if len(shape) != 2:
            return super().refuses(name, shape)
        if shape[1] % 128:  # the scheme's dynamic activation scales come in groups of 128 inputs
            return (
                f"{name}: ct-fp8-block quantizes the activations in groups of 128 inputs, and this weight has "
                f"{shape[1]} (not a multiple of 128: the model would not run); choose fp8-block (which keeps such a "
                "weight in 16-bit), nf4 or int8"
            )
        return None

    def parts(self, shape, dtype):
        rows, cols = -(-shape[0] // self.block[0]), -(-shape[1] // self.block[1])
        return [("", "F8_E4M3", tuple(shape)), ("weight_scale", dtype, (rows, cols))]

    def unit(self, shape):
        return self.block[0]

    def first(self, rows, dtype=torch.bfloat16):
        return self._rows(rows, dtype)

    def rest(self, sides, shape, dtype=torch.bfloat16):
        return [torch.cat(sides)]

    def _rows(self, weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and scales of whole rows of blocks (the last padded)."""
        weight = weight.to(dtype)  # llm-compressor's observer and division run in the model's dtype
        rows, cols = weight.shape
        pad = (-rows % self.block[0], -cols % self.block[1])
        padded = torch.nn.functional.pad(weight, (0, pad[1], 0, pad[0])) if any(pad) else weight
        tiles = block_tiles(padded, self.block)
        lo = torch.minimum(tiles.amin(dim=(-3, -1)), torch.zeros((), dtype=weight.dtype))
        hi = torch.maximum(tiles.amax(dim=(-3, -1)), torch.zeros((), dtype=weight.dtype))
        scale = self._scale(torch.maximum(lo.abs(), hi.abs()), FP8_MAX)
        scaled = tiles / scale.unsqueeze(-1).unsqueeze(-3)
        scaled = scaled + torch.zeros((), dtype=weight.dtype)  # the symmetric zero point: -0.0 becomes 0.0
        codes = torch.clamp(scaled, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return codes.reshape(padded.shape)[:rows, :cols], scale

    def scheme(self):
        return {
            "weights": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "group_size": None,
                "strategy": "block",
                "block_structure": list(self.block),
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "group_size": 128,
                "strategy": "group",
                "dynamic": True,
            },
            "output_activations": None,
        }


@dataclass(frozen=True)
class CtW4A16(_Ct):
    """compressed-tensors ``W4A16``: int4 codes in groups of 128 along the input side, symmetric, ``scale = amax /
    7.5`` in the weight's dtype; stored as ``weight_packed`` (int32, eight codes + 8 a word, the first in the low
    bits), ``weight_scale`` and ``weight_shape``. The input side must be whole groups.

    Example:
        >>> packed, scale, shape = CtW4A16().encode(torch.ones(2, 128, dtype=torch.bfloat16))
        >>> packed.shape, scale.shape, shape.tolist(), hex(packed[0, 0].item() & 0xFFFFFFFF)
        (torch.Size([2, 16]), torch.Size([2, 1]), [2, 128], '0xffffffff')
    """

    name: ClassVar[str] = "ct-w4a16"
    fmt: ClassVar[str] = "pack-quantized"
    loads_fused: ClassVar[bool] = False  # transformers 5.23 does not fuse a packed checkpoint's per-expert weights
    group: int = 128

    def refuses(self, name, shape):
        if len(shape) != 2:
            return super().refuses(name, shape)
        if shape[1] % self.group:
            return (
                f"{name}: ct-w4a16 quantizes groups of {self.group} inputs, and this weight has {shape[1]} "
                f"(not a multiple of {self.group}); choose fp8-block (which keeps such a weight in 16-bit), nf4 "
                "or int8"
            )
        return None

    def parts(self, shape, dtype):
        return [
            ("weight_packed", "I32", (shape[0], shape[1] // 8)),
            ("weight_scale", dtype, (shape[0], shape[1] // self.group)),
            ("weight_shape", "I64", (2,)),
        ]

    def unit(self, shape):
        return 1

    def first(self, rows, dtype=torch.bfloat16):
        return self._rows(rows, dtype)

    def rest(self, sides, shape, dtype=torch.bfloat16):
        return [torch.cat(sides), torch.tensor(list(shape), dtype=torch.int64)]

    def _rows(self, weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed codes and scales of some rows."""
        weight = weight.to(dtype)  # llm-compressor's observer and division run in the model's dtype
        rows, cols = weight.shape
        groups = weight.reshape(rows, cols // self.group, self.group)
        lo = torch.minimum(groups.amin(dim=-1), torch.zeros((), dtype=weight.dtype))
        hi = torch.maximum(groups.amax(dim=-1), torch.zeros((), dtype=weight.dtype))
        scale = self._scale(torch.maximum(lo.abs(), hi.abs()), 7.5)
        scaled = groups / scale.unsqueeze(-1) + torch.zeros((), dtype=weight.dtype)
        codes = torch.round(torch.clamp(scaled, -8, 7)).to(torch.int8).reshape(rows, cols)
        nibbles = (codes.to(torch.int32) + 8).reshape(rows, cols // 8, 8)
        packed = torch.zeros(rows, cols // 8, dtype=torch.int32)
        for i in range(8):
            packed |= nibbles[..., i] << (4 * i)
        return packed, scale

    def scheme(self):
        return {
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "group_size": self.group,
                "strategy": "group",
                "dynamic": False,
            },
            "input_activations": None,
            "output_activations": None,
        }
