"""The served formats a merged weight is written in, by name: which encoder ``quantize`` asks for, what the record
keeps of it, and the names refused."""

from __future__ import annotations

import dataclasses

from ..errors import InputError
from .encode_bnb import Bnb4bit, Int8
from .encode_ct import CtFp8Block, CtW4A16
from .encode_float import Fp8Block, Mxfp4
from .encoder import Encoder, stored_name
from .names import CALIBRATED, NAMES

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
    "encoder_from_record",
    "encoder_record",
    "name_problems",
    "stored_name",
]


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
