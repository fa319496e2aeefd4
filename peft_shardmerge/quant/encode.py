"""The served formats a merged weight is written in: each one's stored tensors, quantized as its own tool does."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import InputError
from ..io.safetensors_io import DTYPES, TORCH_TO_ST
from .names import CALIBRATED, NAMES
from .nf4 import Nf4Settings, packed_4bit_layout, pad_quant_state, require_bitsandbytes

__all__ = [
    "CALIBRATED",
    "NAMES",
    "Bnb4bit",
    "CtFp8Block",
    "CtW4A16",
    "Encoder",
    "Fp8Block",
    "Int8",
    "Mxfp4",
    "encoder_for",
]

#: float8_e4m3fn's largest value
FP8_MAX = 448.0

#: one stored tensor of an encoded weight: ``(key suffix, safetensors dtype, shape)``; the suffix replaces the
#: weight's last name part (``weight``), "" keeping the weight's own name
Part = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True)
class Encoder:
    """One served format: which stored tensors a weight becomes and how they are computed from it. Each encoder
    quantizes the float32 merge of a weight as the format's own tool quantizes a weight it is given (once: no 16-bit
    rounding first, but where the tool itself computes in the model's dtype), and says what ``config.json``'s
    ``quantization_config`` is.

    Attributes:
        name: the name ``--quantize`` takes.
        tool: the quantizer whose bytes the encoder reproduces, named for the record.
    """

    name: ClassVar[str] = ""
    tool: ClassVar[str] = ""
    #: whether transformers loads the format in a model whose experts it fuses on load (Mixtral's per-expert weights)
    loads_fused: ClassVar[bool] = True
    #: whether the format's tool takes GPT-2's ``Conv1D`` weights (stored ``[in, out]``): bitsandbytes does, as
    #: ``[out, in]``; the others replace ``nn.Linear`` only
    takes_conv1d: ClassVar[bool] = False

    def refuses(self, name: str, shape: tuple[int, ...]) -> str | None:
        """Why a weight of this shape cannot be written in the format (None: it can)."""
        return None if len(shape) == 2 else f"{name}: {self.name} quantizes 2-D weights, this one is {list(shape)}"

    def keeps(self, shape: tuple[int, ...]) -> bool:
        """Whether the format's tool leaves a weight of this shape unquantized (True: written as merged)."""
        return False

    def parts(self, shape: tuple[int, ...], dtype: str) -> list[Part]:
        """The stored tensors of one weight of ``shape`` in a model of ``dtype`` (a safetensors dtype), in the order
        they are written."""
        raise NotImplementedError  # pragma: no cover - each format says

    def encode(self, weight: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """The stored tensors of ``weight`` (the float32 merge), in :meth:`parts`' order; ``dtype`` is the model's
        (the dtype its other tensors are written in)."""
        raise NotImplementedError  # pragma: no cover - each format says

    def config(self, kept: list[str], dtype: torch.dtype, unconverted=(set(), set())) -> dict:
        """``quantization_config`` of the output; ``kept``: the modules whose weights stay unquantized although the
        format's tool would take their kind; ``unconverted``: ``(output layers, fused experts)`` the model has, by
        their names in memory (:attr:`~peft_shardmerge.engine.plan.Plan.unconverted`)."""
        raise NotImplementedError  # pragma: no cover - each format says

    def requires(self) -> None:
        """Raise :class:`~peft_shardmerge.errors.MissingDependencyError` when what the format needs is missing."""


def stored_name(weight: str, suffix: str) -> str:
    """The key of one stored tensor of ``weight``: ``"" -> weight``, ``"*_blocks"`` its name and ``_blocks``, else
    the module's name and the suffix.

    Example:
        >>> stored_name("m.q_proj.weight", ""), stored_name("m.q_proj.weight", "SCB")
        ('m.q_proj.weight', 'm.q_proj.SCB')
    """
    if suffix.startswith("*"):  # a parameter's own parts: gate_up_proj -> gate_up_proj_blocks
        return weight + suffix[1:]
    return weight.rsplit(".", 1)[0] + "." + suffix if suffix else weight


def _row_chunks(rows: int, unit: int, cols: int, elems: int = 1 << 22) -> list[tuple[int, int]]:
    """``(start, stop)`` of row chunks of about ``elems`` elements, each a whole number of ``unit`` rows (the last
    what is left): the encoders' temporaries are a chunk's, not the weight's."""
    step = unit * max(1, elems // max(1, unit * cols))
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


def _tiles(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight [rows, cols]`` as ``[row tiles, block rows, col tiles, block cols]`` (whole blocks)."""
    rows, cols = weight.shape
    return weight.reshape(rows // block[0], block[0], cols // block[1], block[1])


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

    def encode(self, weight, dtype=torch.bfloat16):
        codes = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
        inv = torch.empty(self.parts(tuple(weight.shape), "F32")[1][2], dtype=DTYPES[self._scale_dtype][0])
        for a, b in _row_chunks(weight.shape[0], self.block[0], weight.shape[1]):
            codes[a:b], inv[a // self.block[0] : -(-b // self.block[0])] = self._rows(weight[a:b])
        return [codes, inv]

    def _rows(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and inverse scales of whole rows of blocks."""
        tiles = _tiles(weight.to(torch.float32), self.block)
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

    def encode(self, weight, dtype=torch.bfloat16):
        codes = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
        scales = torch.empty(self.parts(tuple(weight.shape), "F32")[1][2], dtype=dtype)
        for a, b in _row_chunks(weight.shape[0], self.block[0], weight.shape[1]):
            codes[a:b], scales[a // self.block[0] : -(-b // self.block[0])] = self._rows(weight[a:b], dtype)
        return [codes, scales]

    def _rows(self, weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and scales of whole rows of blocks (the last padded)."""
        weight = weight.to(dtype)  # llm-compressor's observer and division run in the model's dtype
        rows, cols = weight.shape
        pad = (-rows % self.block[0], -cols % self.block[1])
        padded = torch.nn.functional.pad(weight, (0, pad[1], 0, pad[0])) if any(pad) else weight
        tiles = _tiles(padded, self.block)
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

    def encode(self, weight, dtype=torch.bfloat16):
        rows, cols = weight.shape
        packed = torch.empty(rows, cols // 8, dtype=torch.int32)
        scales = torch.empty(rows, cols // self.group, dtype=dtype)
        for a, b in _row_chunks(rows, 1, cols):
            packed[a:b], scales[a:b] = self._rows(weight[a:b], dtype)
        return [packed, scales, torch.tensor([rows, cols], dtype=torch.int64)]

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


@dataclass(frozen=True)
class Bnb4bit(Encoder):
    """bitsandbytes 4-bit (nf4/fp4) as ``Params4bit`` stores it: ``bitsandbytes.functional.quantize_4bit`` (flat
    blocks of 64, two codes a byte, double quantization of the block scales) on the float32 merge, the quant
    state recording the model's dtype (what dequantization returns).
    On a CPU, that routine divides the last block of a weight that is not whole blocks by its scale where its GPU
    kernel (and every other block) multiplies by the inverse: that block's codes are made the GPU's way here. The
    quant-state JSON is padded with spaces to a length fixed before the merge (room for any ``nested_offset``; the
    file's header is written before its data).

    Attributes:
        quant_type: ``"nf4"`` or ``"fp4"``.
        double_quant: ``bnb_4bit_use_double_quant``.
    """

    tool: ClassVar[str] = "bitsandbytes.functional.quantize_4bit"
    takes_conv1d: ClassVar[bool] = True
    quant_type: str = "nf4"
    double_quant: bool = True

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.quant_type

    @property
    def settings(self) -> Nf4Settings:
        return Nf4Settings(quant_type=self.quant_type, blocksize=64, double_quant=self.double_quant)

    def requires(self):
        require_bitsandbytes()

    def parts(self, shape, dtype):
        torch_dtype = DTYPES[dtype][0]
        return [
            ("weight." + s if s else "", d, sh) for s, d, sh in packed_4bit_layout(shape, torch_dtype, self.settings)
        ]

    def encode(self, weight, dtype=torch.bfloat16):
        import bitsandbytes.functional as F

        flat = weight.reshape(-1)
        packed, state = F.quantize_4bit(
            weight, blocksize=64, compress_statistics=self.double_quant, quant_type=self.quant_type
        )
        state.dtype = dtype  # what dequantization returns: the model's dtype, as Params4bit records it
        rem = flat.numel() % 64
        if rem:  # the last block as the GPU quantizes it: times the inverse of its scale
            packed = packed.clone()
            tail = flat[-rem:].float()
            am = tail.abs().max().clamp(min=1e-38)
            codes = _codes_4bit(torch.clamp(tail * (1.0 / am), -1, 1), self.quant_type)
            start = flat.numel() - rem
            if start % 2:  # the block starts in the low nibble of a byte shared with the block before
                raise AssertionError("blocks of 64 start on a byte")  # pragma: no cover - 64 is even
            if rem % 2:  # the byte's second code: bitsandbytes pads with 0.0, and writes 0.0's code
                codes = torch.cat([codes, _codes_4bit(torch.zeros(1), self.quant_type)])
            packed.view(-1)[start // 2 :] = (codes[::2] << 4) | codes[1::2]
        qs = state.as_dict(packed=True)
        key = f"quant_state.bitsandbytes__{self.quant_type}"
        layout = self.parts(tuple(weight.shape), TORCH_TO_ST[dtype])
        out = [packed.view(torch.uint8).reshape(layout[0][2])]
        for suffix, _, shape in layout[1:]:
            name = suffix.removeprefix("weight.")
            out.append(pad_quant_state(qs[key], shape[0]) if name == key else qs[name].reshape(shape))
        return out

    def config(self, kept, dtype, unconverted=(set(), set())):
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=dtype,
            llm_int8_skip_modules=kept or None,
        ).to_dict()


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

    def encode(self, weight, dtype=torch.bfloat16):
        experts, fan_in, fan_out = weight.shape
        x = weight.to(torch.float32).transpose(1, 2).reshape(experts, fan_out, fan_in // 32, 32)
        amax = x.abs().amax(dim=-1, keepdim=True)
        bits = (amax / 6.0).view(torch.int32)
        rounded = (bits + 0x007FFFFF) & 0x7F800000  # up to a power of two
        scale = rounded.view(torch.float32)
        q = x * torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
        codes = _e2m1(q)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return [packed.contiguous(), (rounded >> 23).to(torch.uint8).squeeze(-1)]

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


def _codes_4bit(scaled: torch.Tensor, quant_type: str) -> torch.Tensor:
    """The 4-bit codes of values scaled to [-1, 1], as bitsandbytes' kernels pick them (the nearest level; a value
    halfway between two levels takes the lower one)."""
    from bitsandbytes.backends.default.ops import _get_4bit_quantize_bounds

    bounds, order = _get_4bit_quantize_bounds(quant_type, scaled.device)
    q = torch.bucketize(scaled, bounds, out_int32=True)
    if quant_type != "nf4":
        q = order[q]
    return q.to(torch.uint8)


@dataclass(frozen=True)
class Int8(Encoder):
    """bitsandbytes LLM.int8 as ``Int8Params`` stores it: the weight cast to float16, one float32 scale per row
    (``SCB``, the row's absolute maximum) and int8 codes ``round(w * 127 / SCB)``
    (``bitsandbytes.functional.int8_vectorwise_quant``), with the ``weight_format`` byte (0: row-major).

    Example:
        >>> codes, scb, fmt = Int8().encode(torch.tensor([[1.0, -0.5], [0.0, 0.25]], dtype=torch.bfloat16))
        >>> codes.tolist(), scb.tolist(), fmt.item()
        ([[127, -64], [0, 127]], [1.0, 0.25], 0)
    """

    name: ClassVar[str] = "int8"
    tool: ClassVar[str] = "bitsandbytes.functional.int8_vectorwise_quant"
    takes_conv1d: ClassVar[bool] = True

    def requires(self):
        require_bitsandbytes()

    def parts(self, shape, dtype):
        return [("", "I8", tuple(shape)), ("SCB", "F32", (shape[0],)), ("weight_format", "U8", ())]

    def encode(self, weight, dtype=torch.bfloat16):
        import bitsandbytes.functional as F

        codes, scb, _ = F.int8_vectorwise_quant(weight.to(torch.float16).contiguous())
        return [codes, scb, torch.tensor(0, dtype=torch.uint8)]

    def config(self, kept, dtype, unconverted=(set(), set())):
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=kept or None).to_dict()


def name_problems(name) -> list[str]:
    """What is wrong with a ``quantize`` name, before any base is read (empty: a name this version writes).

    Example:
        >>> name_problems("nf4"), name_problems("gptq")[0][:40]
        ([], "quantize='gptq': GPTQ needs calibration ")
    """
    if not isinstance(name, str):
        return [f"quantize must be a format name ({', '.join(NAMES)}), got {name!r}"]
    if name.strip().lower() == "base":  # its format is the base's: known once the base is read
        return []
    try:
        encoder_for(name)
    except InputError as e:
        return list(e.problems)
    return []


def encoder_for(name: str, base_qc: dict | None = None) -> Encoder:
    """The encoder ``--quantize NAME`` asks for; ``base`` the one of the base checkpoint's own format.

    Args:
        name: one of :data:`NAMES`.
        base_qc: the base's ``quantization_config`` (for ``base``).

    Returns:
        The :class:`Encoder`.

    Raises:
        InputError: an unknown name, a format that needs calibration data, or ``base`` for a base stored in 16-bit
            or in a format this version cannot write back.

    Example:
        >>> base = {"quant_method": "fp8", "weight_block_size": [64, 64]}
        >>> encoder_for("fp8-block").name, encoder_for("base", base).block
        ('fp8-block', (64, 64))
    """
    key = str(name).strip().lower()
    if key in CALIBRATED:
        raise InputError(
            f"quantize={name!r}: {CALIBRATED[key]} needs calibration data, which a merge does not have; merge to "
            "16-bit, then quantize the merged folder with llm-compressor (oneshot with a GPTQ/AWQ recipe) or "
            "GPTQModel (see docs/quantized.md)"
        )
    simple = {
        "fp8-block": Fp8Block,
        "ct-fp8-block": CtFp8Block,
        "ct-w4a16": CtW4A16,
        "int8": Int8,
        "nf4": lambda: Bnb4bit("nf4"),
        "fp4": lambda: Bnb4bit("fp4"),
    }
    if key in simple:
        return simple[key]()
    if key != "base":
        raise InputError(f"quantize={name!r} is not a format this version writes; choose one of {', '.join(NAMES)}")
    if not base_qc:
        raise InputError(
            "quantize='base' writes the base checkpoint's own quantized format, and this base is not stored "
            f"quantized; name a format instead ({', '.join(NAMES[:-1])})"
        )
    method = str(base_qc.get("quant_method", "bitsandbytes" if base_qc.get("load_in_4bit") else "unknown"))
    if method == "fp8":
        if not base_qc.get("weight_block_size") or base_qc.get("activation_scheme", "dynamic") != "dynamic":
            raise InputError(
                "quantize='base': the base is FP8 with "
                + ("one scale per tensor" if not base_qc.get("weight_block_size") else "static activation scales")
                + ", which this version reads but does not write back (only block scales with dynamic activations); "
                "name a format instead (fp8-block writes 128x128 blocks)"
            )
        block = tuple(base_qc["weight_block_size"])
        return Fp8Block(block=block, scale_fmt=str(base_qc.get("scale_fmt") or "float"), keep_exact=True)
    if method == "bitsandbytes" and base_qc.get("load_in_4bit"):
        return Bnb4bit(
            str(base_qc.get("bnb_4bit_quant_type", "nf4")), bool(base_qc.get("bnb_4bit_use_double_quant", False))
        )
    if method == "bitsandbytes" and base_qc.get("load_in_8bit"):
        return Int8()
    if method == "mxfp4":
        return Mxfp4()
    raise InputError(
        f"quantize='base': the base is stored as quant_method={method!r}, which this version reads but does not "
        f"write back; name a format instead ({', '.join(NAMES[:-1])})"
    )


def encoder_record(encoder: Encoder) -> dict:
    """What the merge record keeps of an encoder, for verify to make the same one (:func:`encoder_from_record`).

    Example:
        >>> encoder_record(Fp8Block())
        {'format': 'fp8-block', 'block': [128, 128], 'scale_fmt': 'float', 'keep_exact': False}
    """
    from dataclasses import asdict

    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(encoder).items()}
    return {"format": encoder.name, **fields}


def encoder_from_record(record: dict) -> Encoder:
    """The encoder a merge record names (:func:`encoder_record`).

    Raises:
        InputError: the record names a format this version does not write.

    Example:
        >>> encoder_from_record({"format": "nf4", "quant_type": "nf4", "double_quant": False})
        Bnb4bit(quant_type='nf4', double_quant=False)
    """
    kinds = {"fp8-block": Fp8Block, "ct-fp8-block": CtFp8Block, "ct-w4a16": CtW4A16, "int8": Int8, "mxfp4": Mxfp4}
    kinds.update({"nf4": Bnb4bit, "fp4": Bnb4bit})
    if record.get("format") not in kinds:
        raise InputError(f"the merge record names quantized format {record.get('format')!r}, unknown to this version")
    kind = kinds[record["format"]]
    names = {f.name for f in dataclasses.fields(kind)}
    return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in names})
