"""bitsandbytes formats a merged weight is written in, as transformers serializes them: 4-bit (nf4, fp4) and
LLM.int8."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..io.safetensors_io import DTYPES, TORCH_TO_ST
from .encoder import Encoder
from .nf4 import Nf4Settings, packed_4bit_layout, pad_quant_state, require_bitsandbytes


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

    def unit(self, shape):
        return 64 // math.gcd(64, math.prod(shape[1:]))  # rows of whole blocks of 64

    def first(self, rows, dtype=torch.bfloat16):
        """quantize_4bit's kernel on whole blocks (the weight's last block may be partial): packed codes, scales."""
        flat = rows.reshape(-1)
        codes, scales = torch.ops.bitsandbytes.quantize_4bit.default(flat, 64, self.quant_type, torch.uint8)
        rem = flat.numel() % 64
        if rem:  # the last block as the GPU quantizes it: times the inverse of its scale
            tail = flat[-rem:].float()
            am = tail.abs().max().clamp(min=1e-38)
            last = _codes_4bit(torch.clamp(tail * (1.0 / am), -1, 1), self.quant_type)
            if rem % 2:  # the byte's second code: bitsandbytes pads with 0.0, and writes 0.0's code
                last = torch.cat([last, _codes_4bit(torch.zeros(1), self.quant_type)])
            codes = codes.clone()
            codes.view(-1)[(flat.numel() - rem) // 2 :] = (last[::2] << 4) | last[1::2]  # blocks start on a byte
        return codes.view(torch.uint8), scales

    def rest(self, sides, shape, dtype=torch.bfloat16):
        """quantize_4bit's second step on the whole weight's block scales (double quantization), then the quant
        state as ``Params4bit`` serializes it, its dtype the model's (what dequantization returns)."""
        import bitsandbytes.functional as F

        absmax = torch.cat(sides)
        code = F.get_4bit_type(self.quant_type, device=absmax.device)
        state_kw = dict(shape=torch.Size(shape), dtype=dtype, blocksize=64, code=code, quant_type=self.quant_type)
        if self.double_quant:
            offset = absmax.mean()
            qabsmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
            state = F.QuantState(absmax=qabsmax, offset=offset, state2=state2, **state_kw)
        else:
            state = F.QuantState(absmax=absmax, **state_kw)
        qs = state.as_dict(packed=True)
        key = f"quant_state.bitsandbytes__{self.quant_type}"
        out = []
        for suffix, _, part in self.parts(tuple(shape), TORCH_TO_ST[dtype])[1:]:
            name = suffix.removeprefix("weight.")
            out.append(pad_quant_state(qs[key], part[0]) if name == key else qs[name].reshape(part))
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

    def unit(self, shape):
        return 1  # each row's scale is its own

    def first(self, rows, dtype=torch.bfloat16):
        import bitsandbytes.functional as F

        codes, scb, _ = F.int8_vectorwise_quant(rows.to(torch.float16).contiguous())
        return codes, scb

    def rest(self, sides, shape, dtype=torch.bfloat16):
        return [torch.cat(sides), torch.tensor(0, dtype=torch.uint8)]

    def config(self, kept, dtype, unconverted=(set(), set())):
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=kept or None).to_dict()
