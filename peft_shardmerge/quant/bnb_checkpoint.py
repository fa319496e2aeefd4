"""bitsandbytes base checkpoints on disk (4-bit NF4/FP4, double quant or not; 8-bit LLM.int8), read dequantized."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import CorruptFileError, InputError, MissingDependencyError
from ..io.safetensors_io import DTYPES, FLOAT_DTYPES, TORCH_TO_ST, RowReader, TensorInfo
from .formats import Decoder, QuantView, logical_info, model_dtype_name, recorded_dtype_name
from .nf4 import dequantize_4bit_exact, dequantize_blockwise_exact, dequantize_int8_exact

__all__ = ["Bnb4bitDecoder", "Bnb8bitDecoder", "view"]

#: the packed 4-bit quant state (``QuantState.as_dict(packed=True)``): a uint8 tensor holding JSON
STATE = ".quant_state.bitsandbytes__"
#: what bitsandbytes stores next to a 4-bit ``X.weight`` (``X.weight.absmax``, ...), longest suffix first
AUX_4BIT = (STATE + "nf4", STATE + "fp4", ".nested_quant_map", ".nested_absmax", ".quant_map", ".absmax")
#: what bitsandbytes stores next to an 8-bit ``X.weight``: ``X.SCB`` (row scales) and ``X.weight_format``
AUX_8BIT = (".weight_format", ".SCB")
#: block sizes ``dequantize_4bit`` accepts
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
MAX_STATE_BYTES = 65536  # a packed quant state is about 200 bytes; anything far larger is not one
#: model types with transformers' Conv1D projections ([in, out]), which bitsandbytes quantizes transposed
CONV1D_MODELS = {"gpt2", "openai-gpt", "imagegpt", "decision_transformer", "clvp"}
METHOD_4BIT = "the 4-bit format's definition (peft_shardmerge.quant.nf4.dequantize_4bit_exact)"
METHOD_8BIT = "the LLM.int8 format's definition (peft_shardmerge.quant.nf4.dequantize_int8_exact)"


def _functional():
    """bitsandbytes.functional, or a clear refusal when bitsandbytes is not installed."""
    try:
        from bitsandbytes import functional
    except ImportError as e:
        raise MissingDependencyError(
            "the base is stored quantized by bitsandbytes, and reading it needs bitsandbytes itself: "
            "pip install bitsandbytes"
        ) from e
    return functional


@dataclass(frozen=True)
class Bnb4bitDecoder(Decoder):
    """Rows of one 4-bit (NF4/FP4) weight, dequantized by the format's definition
    (:func:`~peft_shardmerge.quant.nf4.dequantize_4bit_exact`, the one dequantization of every path) on just the
    quantization blocks that hold them.

    The weight ``[out, in]`` is quantized flat, in blocks of ``blocksize`` values with one absmax each: rows
    ``[start, stop)`` are flat elements ``[start * in, stop * in)``, extended to whole blocks, whose packed bytes (two
    values a byte) and absmax are read, dequantized and cut. With double quant the absmax are 8-bit codes in blocks
    of ``nested_blocksize`` with one float32 scale each, read over whole nested blocks and dequantized as
    ``dequantize_4bit`` does (:func:`~peft_shardmerge.quant.nf4.dequantize_blockwise_exact`, plus the offset). Every
    step
    is elementwise per block: the rows equal those of the whole weight.

    Attributes:
        stored: ``(packed weight, absmax, quant_map, quant_state[, nested_absmax, nested_quant_map])``.
        shape: the weight's shape (from the quant state).
        quant_type: ``"nf4"`` or ``"fp4"``.
        blocksize: values per absmax.
        state_dtype: the dtype bitsandbytes dequantizes to (the quant state's ``dtype``).
        dtype: the logical dtype (``model.config.dtype``, to which ``model.dequantize()`` casts).
        nested_blocksize: absmax values per nested scale; 0 without double quant.
        nested_offset: the mean absmax subtracted before the nested quantization.
        method: the function doing the arithmetic.
    """

    shape: tuple[int, ...]
    quant_type: str
    blocksize: int
    state_dtype: torch.dtype
    nested_blocksize: int = 0
    nested_offset: float = 0.0
    method: ClassVar[str] = METHOD_4BIT

    def decode(self, reader: RowReader, start: int, stop: int) -> torch.Tensor:
        """The rows dequantized (:meth:`~peft_shardmerge.quant.formats.Decoder.rows`)."""
        numel = math.prod(self.shape)
        row = numel // self.shape[0] if self.shape[0] else 0
        first, last = start * row, stop * row
        if last <= first:
            return torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        b0, b1 = first // self.blocksize, -(-last // self.blocksize)
        lo, hi = b0 * self.blocksize, min(b1 * self.blocksize, numel)
        packed = reader.read_rows(self.stored[0], lo // 2, -(-hi // 2)).clone()  # the reader's buffer is reused
        flat = dequantize_4bit_exact(
            packed,
            self._absmax(reader, b0, b1),
            reader.read(self.stored[2]),
            self.blocksize,
            hi - lo,
            self.state_dtype,
            self.dtype,
        )
        return flat[first - lo : last - lo].reshape(stop - start, *self.shape[1:])

    def _absmax(self, reader: RowReader, b0: int, b1: int) -> torch.Tensor:
        """The float32 absmax of blocks ``[b0, b1)``, undoing double quant over the whole nested blocks they lie in."""
        if not self.nested_blocksize:
            return reader.read_rows(self.stored[1], b0, b1).clone()
        nbs, blocks = self.nested_blocksize, self.stored[1].shape[0]
        n0, n1 = b0 // nbs, -(-b1 // nbs)
        codes = reader.read_rows(self.stored[1], n0 * nbs, min(n1 * nbs, blocks)).clone()
        scales = reader.read_rows(self.stored[4], n0, n1).clone()
        # as dequantize_4bit does with QuantState.from_dict's state2 and offset
        absmax = dequantize_blockwise_exact(codes, scales, reader.read(self.stored[5]), nbs)
        absmax += torch.tensor(self.nested_offset, dtype=torch.float32)
        return absmax[b0 - n0 * nbs : b1 - n0 * nbs]


@dataclass(frozen=True)
class Bnb8bitDecoder(Decoder):
    """Rows of one LLM.int8 weight: int8 codes times their row's scale (``SCB``) / 127, the format's definition
    (:func:`~peft_shardmerge.quant.nf4.dequantize_int8_exact`) on just those rows, in float32. They are not cast to the
    logical dtype here: the merge adds the adapter's float32 delta and casts once (a weight without a delta is cast
    once too, as ``model.dequantize()`` casts bitsandbytes' float32 result once).

    Attributes:
        stored: ``(int8 weight, SCB)``, then ``weight_format`` when stored.
        dtype: the logical dtype (``model.config.dtype``).
        method: the function doing the arithmetic.
    """

    method: ClassVar[str] = METHOD_8BIT

    def decode(self, reader: RowReader, start: int, stop: int) -> torch.Tensor:
        """The rows dequantized (:meth:`~peft_shardmerge.quant.formats.Decoder.rows`)."""
        codes = reader.read_rows(self.stored[0], start, stop).clone()  # the reader's buffer is reused
        scales = reader.read_rows(self.stored[1], start, stop).clone()
        return dequantize_int8_exact(codes, scales)  # float32: cast once, after the delta is added


def _bits(qc: dict, tensors: list[TensorInfo]) -> int:
    """4 or 8: from the quantization_config, else from what is stored; refuses a config the weights contradict."""
    four = bool(qc.get("load_in_4bit", qc.get("_load_in_4bit")))
    eight = bool(qc.get("load_in_8bit", qc.get("_load_in_8bit")))
    if four and eight:
        raise InputError(
            "config.json's quantization_config says bitsandbytes with both load_in_4bit and "
            "load_in_8bit; "
            "fix config.json to say how the weights were saved"
        )
    stored = [
        b
        for b, aux, code in ((4, AUX_4BIT, "U8"), (8, AUX_8BIT, "I8"))
        if any(t.name.endswith(aux) or (t.dtype == code and t.name.endswith(".weight")) for t in tensors)
    ]
    if not stored:
        raise InputError(
            f"config.json's quantization_config says bitsandbytes but no tensor is stored quantized (none of the "
            f"{len(tensors)} stored tensors is a packed weight, absmax, quant state or SCB): they disagree; "
            f"remove quantization_config from config.json if the weights are unquantized"
        )
    return 4 if four else 8 if eight else stored[0]


def _refuse_variants(config: dict, qc: dict, bits: int) -> None:
    """Variants whose dequantized tensors this module cannot produce as transformers would."""
    storage = qc.get("bnb_4bit_quant_storage") or "uint8"
    if bits == 4 and storage != "uint8":
        raise InputError(
            f"the base's 4-bit weights are packed into {storage} (bnb_4bit_quant_storage); this version "
            f"reads the default uint8 only: save_pretrained the base after transformers' "
            f"model.dequantize()"
        )
    types = {config.get("model_type")} | {(config.get("text_config") or {}).get("model_type")}
    if types & CONV1D_MODELS:
        raise InputError(
            f"the base ({', '.join(sorted(t for t in types if t))}) has Conv1D projections, stored "
            f"transposed by bitsandbytes, which model.dequantize() turns into nn.Linear weights the "
            f"model class cannot load; merge into the unquantized checkpoint the quantized one was made "
            f"from"
        )


def _groups(tensors: list[TensorInfo], bits: int) -> dict[str, dict[str, TensorInfo]]:
    """Quantized weight name -> {suffix or "": stored tensor}, in checkpoint order; refuses stray pieces."""
    own, other = (AUX_4BIT, AUX_8BIT) if bits == 4 else (AUX_8BIT, AUX_4BIT)
    names = {t.name: t for t in tensors}
    groups: dict[str, dict[str, TensorInfo]] = {}
    for t in tensors:
        if any(t.name.endswith(s) for s in other):
            raise CorruptFileError(
                f"{t.path}: tensor {t.name!r} is a bitsandbytes {12 - bits}-bit piece, but config.json's "
                f"quantization_config says {bits}-bit; the config and the weights disagree: re-save the checkpoint"
            )
        suffix = next((s for s in own if t.name.endswith(s)), None)
        if suffix is not None:
            weight = t.name[: -len(suffix)] + ("" if bits == 4 else ".weight")
            groups.setdefault(weight, {})[suffix] = t
    for weight, parts in groups.items():
        if weight not in names:
            piece = next(iter(parts.values()))
            raise CorruptFileError(
                f"{piece.path}: {piece.name!r} is stored but its weight {weight!r} is not in the "
                f"checkpoint; the checkpoint is incomplete: re-download or re-save it"
            )
        parts[""] = names[weight]
    for t in tensors:  # a packed weight whose state went missing would otherwise pass through as uint8/int8
        packed = t.dtype == ("U8" if bits == 4 else "I8") and t.name.endswith(".weight")
        if packed and t.name not in groups:
            what = "quant_state/absmax" if bits == 4 else "SCB (row scales)"
            raise CorruptFileError(
                f"{t.path}: {t.name!r} is stored as {t.dtype} but has no {what} next to it; "
                f"it cannot be read without it: re-download or re-save the checkpoint"
            )
    return groups


def _read_state(reader: RowReader, info: TensorInfo, weight: str) -> dict:
    """The JSON a packed 4-bit quant state holds (bitsandbytes.utils.unpack_tensor_to_dict)."""
    if info.dtype != "U8" or len(info.shape) != 1 or info.nbytes > MAX_STATE_BYTES:
        raise CorruptFileError(
            f"{info.path}: {info.name!r} ({info.dtype} {list(info.shape)}) is not a packed "
            f"bitsandbytes quant state; re-save the checkpoint"
        )
    from bitsandbytes.utils import unpack_tensor_to_dict

    try:
        state = unpack_tensor_to_dict(reader.read(info))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptFileError(
            f"{info.path}: {info.name!r} does not hold the quant state JSON of {weight!r} "
            f"({e}); re-save the checkpoint"
        ) from e
    if not isinstance(state, dict):
        raise CorruptFileError(f"{info.path}: {info.name!r} holds {type(state).__name__}, not a quant state object")
    return state


def _state_fields(state: dict, quant_type: str, where: str) -> tuple[tuple[int, ...], int, torch.dtype, int]:
    """``(shape, blocksize, dtype, nested_blocksize)`` of a quant state, each checked."""
    shape, blocksize, dtype = state.get("shape"), state.get("blocksize"), state.get("dtype")
    if state.get("quant_type") != quant_type:
        raise CorruptFileError(
            f"{where}: quant_type {state.get('quant_type')!r} does not match the key's {quant_type!r}"
        )
    if not isinstance(shape, list) or not shape or not all(isinstance(s, int) and s > 0 for s in shape):
        raise CorruptFileError(f"{where}: shape {shape!r} is not a list of positive integers; re-save the checkpoint")
    if blocksize not in BLOCKSIZES:
        raise InputError(
            f"{where}: blocksize {blocksize!r} is not one bitsandbytes dequantizes ({', '.join(map(str, BLOCKSIZES))})"
        )
    if dtype not in ("bfloat16", "float16", "float32"):
        raise InputError(
            f"{where}: dtype {dtype!r} is not one bitsandbytes dequantizes 4-bit weights to "
            "(bfloat16, float16, float32)"
        )
    nested = 0
    if "nested_blocksize" in state:
        nested = state.get("nested_blocksize")
        fields = (nested, state.get("nested_dtype"), state.get("nested_offset"))
        if not isinstance(nested, int) or nested <= 0 or fields[1] != "float32" or not isinstance(fields[2], float):
            raise InputError(
                f"{where}: double quant with nested blocksize, dtype, offset {fields} is not the variant "
                f"this version reads (a positive block size, float32, a number)"
            )
    return tuple(shape), blocksize, getattr(torch, dtype), nested


def _expect(info: TensorInfo | None, weight: str, suffix: str, dtypes: set[str], numel: int) -> TensorInfo:
    """One stored piece of a 4-bit weight, checked to be there with the right dtype and size."""
    if info is None:
        raise CorruptFileError(
            f"4-bit weight {weight!r} has no {weight + suffix!r}; a bitsandbytes 4-bit weight "
            f"cannot be read without it: re-download or re-save the checkpoint"
        )
    if info.dtype not in dtypes or info.numel != numel or len(info.shape) != 1:
        raise CorruptFileError(
            f"{info.path}: {info.name!r} is {info.dtype} {list(info.shape)}, expected "
            f"{'/'.join(sorted(dtypes))} [{numel}] for {weight!r}; re-save the checkpoint"
        )
    return info


def _decoder_4bit(weight: str, parts: dict[str, TensorInfo], dtype: str | None, reader: RowReader) -> Bnb4bitDecoder:
    """The decoder of one 4-bit weight, every stored piece and quant-state field checked."""
    keys = [s for s in (STATE + "nf4", STATE + "fp4") if s in parts]
    if len(keys) != 1:
        found = "both an nf4 and an fp4" if keys else "no"
        raise CorruptFileError(
            f"4-bit weight {weight!r} has {found} quant state ({weight + STATE}nf4/fp4); "
            "re-download or re-save the checkpoint"
        )
    quant_type, info = keys[0].rsplit("__", 1)[1], parts[keys[0]]
    where = f"{info.path}: quant state {info.name!r}"
    state = _read_state(reader, info, weight)
    shape, blocksize, state_dtype, nested = _state_fields(state, quant_type, where)
    packed, numel = parts[""], math.prod(shape)
    if packed.dtype != "U8":
        raise InputError(
            f"{packed.path}: 4-bit weight {weight!r} is packed as {packed.dtype}; this version reads "
            f"bitsandbytes' default uint8 storage only; dequantize it with transformers first"
        )
    if packed.shape != (-(-numel // 2), 1):
        raise CorruptFileError(
            f"{packed.path}: {weight!r} is {list(packed.shape)}, but its quant state's shape "
            f"{list(shape)} packs into [{-(-numel // 2)}, 1]; re-save the checkpoint"
        )
    blocks = -(-numel // blocksize)
    functional = _functional()
    code = _expect(parts.get(".quant_map"), weight, ".quant_map", {"F32"}, 16)
    if not torch.equal(reader.read(code), functional.get_4bit_type(quant_type, device="cpu")):
        raise InputError(
            f"{code.path}: {code.name!r} is not bitsandbytes' {quant_type} table, which its kernels "
            f"use whatever is stored; this checkpoint cannot be read exactly"
        )
    absmax = _expect(parts.get(".absmax"), weight, ".absmax", {"U8"} if nested else FLOAT_DTYPES, blocks)
    stored = (packed, absmax, code, info)
    if nested:
        stored += (
            _expect(parts.get(".nested_absmax"), weight, ".nested_absmax", {"F32"}, -(-blocks // nested)),
            _expect(parts.get(".nested_quant_map"), weight, ".nested_quant_map", {"F32"}, 256),
        )
    elif ".nested_absmax" in parts or ".nested_quant_map" in parts:
        raise CorruptFileError(
            f"{where} has no double-quant fields, but nested absmax/quant_map are stored for "
            f"{weight!r}; re-save the checkpoint"
        )
    logical = DTYPES[dtype][0] if dtype else state_dtype
    return Bnb4bitDecoder(
        stored, logical, shape, quant_type, blocksize, state_dtype, nested, float(state.get("nested_offset", 0.0))
    )


def _decoder_8bit(weight: str, parts: dict[str, TensorInfo], dtype: str, reader: RowReader) -> Bnb8bitDecoder:
    """The decoder of one LLM.int8 weight, its scales and format checked."""
    codes, scales, fmt = parts[""], parts.get(".SCB"), parts.get(".weight_format")
    if scales is None:
        raise CorruptFileError(
            f"8-bit weight {weight!r} has no {weight.removesuffix('.weight') + '.SCB'!r} (row "
            f"scales); re-download or re-save the checkpoint"
        )
    if codes.dtype != "I8" or len(codes.shape) != 2:
        raise InputError(
            f"{codes.path}: {weight!r} is stored as {codes.dtype} {list(codes.shape)} next to its SCB; "
            f"this version reads LLM.int8 weights stored as int8 [out, in] only (not has_fp16_weight)"
        )
    if scales.dtype not in FLOAT_DTYPES or scales.shape != codes.shape[:1]:
        raise CorruptFileError(
            f"{scales.path}: {scales.name!r} is {scales.dtype} {list(scales.shape)}, expected "
            f"float [{codes.shape[0]}] for {weight!r}; re-save the checkpoint"
        )
    stored = (codes, scales)
    if fmt is not None:
        if fmt.numel != 1 or fmt.dtype not in ("U8", "I8", "I32", "I64"):
            raise CorruptFileError(f"{fmt.path}: {fmt.name!r} is {fmt.dtype} {list(fmt.shape)}, not a weight format")
        from bitsandbytes import utils

        formats, value = utils.INVERSE_LINEAR_8BIT_WEIGHTS_FORMAT_MAPPING, int(reader.read(fmt).reshape(-1)[0])
        if formats.get(value) != "row":
            raise InputError(
                f"{fmt.path}: {weight!r} is stored in bitsandbytes' {formats.get(value, value)!r} "
                f"layout; "
                f"only the 'row' layout is read (as bitsandbytes itself loads); re-save it with a "
                f"current bitsandbytes"
            )
        stored += (fmt,)
    return Bnb8bitDecoder(stored, DTYPES[dtype][0])


def view(tensors: list[TensorInfo], config: dict, qc: dict) -> QuantView:
    """The dequantized view of a bitsandbytes checkpoint, as transformers' ``model.dequantize()`` names it.

    Args:
        tensors: the stored tensors, in checkpoint order.
        config: the checkpoint's ``config.json``.
        qc: its ``quantization_config``.

    Returns:
        The :class:`~peft_shardmerge.quant.formats.QuantView`: each quantized ``X.weight`` in the place of its first
        stored piece, with a decoder; weights left unquantized (``llm_int8_skip_modules``, norms, embeddings)
        as stored; absmax, quant maps, quant states, SCB and weight formats consumed.

    Raises:
        InputError: both 4-bit and 8-bit are set, a variant is not read (non-uint8 quant storage,
            Conv1D models, a custom quant map, a legacy 8-bit layout), or no tensor is quantized at all.
        CorruptFileError: a quantized weight's absmax, quant state, quant map or SCB is missing or does not fit it.
        MissingDependencyError: bitsandbytes is not installed.
    """
    bits = _bits(qc, tensors)
    _refuse_variants(config, qc, bits)
    groups = _groups(tensors, bits)
    dtype = recorded_dtype_name(config)  # model.dequantize() casts to it; else the quant state's dtype
    reader = RowReader()
    try:
        if bits == 4:
            decoders = {w: _decoder_4bit(w, parts, dtype, reader) for w, parts in groups.items()}
        else:
            decoders = {
                w: _decoder_8bit(w, parts, dtype or model_dtype_name(config), reader) for w, parts in groups.items()
            }
    finally:
        reader.close()
    owner = {t.name: w for w, parts in groups.items() for t in parts.values()}
    out, placed = [], set()
    for t in tensors:
        weight = owner.get(t.name)
        if weight is None:
            out.append(t)
        elif weight not in placed:
            placed.add(weight)
            d = decoders[weight]
            shape = d.shape if bits == 4 else d.stored[0].shape
            out.append(logical_info(weight, TORCH_TO_ST[d.dtype], shape, d))
    consumed = sum(len(d.stored) for d in decoders.values()) - len(decoders)
    kinds = sorted(
        {f"{d.quant_type}, double quant" if d.nested_blocksize else d.quant_type for d in decoders.values()}
        if bits == 4
        else {"LLM.int8"}
    )
    return QuantView(out, f"bitsandbytes {bits}-bit ({'; '.join(kinds)})", len(decoders), consumed)
