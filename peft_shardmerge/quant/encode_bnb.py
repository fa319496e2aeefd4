"""bitsandbytes formats a merged weight is written in, as transformers serializes them: 4-bit (nf4, fp4) and
LLM.int8."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..io.safetensors_io import DTYPES, TORCH_TO_ST
from .encoder import Encoder, row_chunks
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

    def encode(self, weight, dtype=torch.bfloat16):
        import bitsandbytes.functional as F

        flat = weight.reshape(-1)
        # quantize_4bit's own steps (its kernel, then the double quantization of the block scales), the kernel in
        # chunks of whole blocks: its temporaries are a chunk's; the scales, quantized again, are the whole weight's
        packed = torch.empty((flat.numel() + 1) // 2, 1, dtype=torch.uint8)
        absmax = torch.empty(-(-flat.numel() // 64), dtype=torch.float32)
        step = 64 << 16
        for a in range(0, flat.numel(), step):
            b = flat.numel() if a + step >= flat.numel() else a + step  # the last chunk takes a partial block
            codes, scales = torch.ops.bitsandbytes.quantize_4bit.default(flat[a:b], 64, self.quant_type, torch.uint8)
            packed[a // 2 : a // 2 + codes.shape[0]], absmax[a // 64 : a // 64 + scales.numel()] = codes, scales
        code = F.get_4bit_type(self.quant_type, device=weight.device)
        state_kw = dict(shape=weight.shape, dtype=dtype, blocksize=64, code=code, quant_type=self.quant_type)
        if self.double_quant:
            offset = absmax.mean()
            qabsmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
            state = F.QuantState(absmax=qabsmax, offset=offset, state2=state2, **state_kw)
        else:
            state = F.QuantState(absmax=absmax, **state_kw)
        # dtype: what dequantization returns, the model's, as Params4bit records it
        rem = flat.numel() % 64
        if rem:  # the last block as the GPU quantizes it: times the inverse of its scale
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

        codes = torch.empty(weight.shape, dtype=torch.int8)
        scb = torch.empty(weight.shape[0], dtype=torch.float32)
        for a, b in row_chunks(weight.shape[0], 1, weight.shape[1]):  # each row's scale is its own
            codes[a:b], scb[a:b], _ = F.int8_vectorwise_quant(weight[a:b].to(torch.float16).contiguous())
        return [codes, scb, torch.tensor(0, dtype=torch.uint8)]

    def config(self, kept, dtype, unconverted=(set(), set())):
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=kept or None).to_dict()
