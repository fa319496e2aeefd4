"""A GGUF output type resolved (what each one is made of: the converter's type, the quantizer's on top), and values
encoded in a GGUF type."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from ..support.outtypes import CONVERTER_TYPES, UNSLOTH_NAMES, outtype_problems

#: the file type (``general.file_type``) of each type
_FILE_TYPES = {
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
    "q4_1": "MOSTLY_Q4_1",
    "q5_0": "MOSTLY_Q5_0",
    "q5_1": "MOSTLY_Q5_1",
    "q4_k_s": "MOSTLY_Q4_K_S",
    "q4_k_m": "MOSTLY_Q4_K_M",
    "q5_k_s": "MOSTLY_Q5_K_S",
    "q5_k_m": "MOSTLY_Q5_K_M",
    "q6_k": "MOSTLY_Q6_K",
}


def file_type_name(file_type) -> str:
    """The ``outtype`` of a ``general.file_type``.

    Args:
        file_type: a ``gguf.LlamaFileType``.

    Returns:
        The type's name, as ``outtype`` takes it.

    Example:
        >>> import gguf
        >>> file_type_name(gguf.LlamaFileType.MOSTLY_Q4_K_M)
        'q4_k_m'
    """
    names = {v: k for k, v in _FILE_TYPES.items()}
    if file_type.name not in names:
        raise InputError(f"GGUF file type {file_type.name} is not one written here")
    return names[file_type.name]


@dataclass(frozen=True)
class OutType:
    """A GGUF output type, resolved: the converter's type its first stage is, and the quantizer's on top.

    Attributes:
        name: the type (``q4_k_m``); ``auto`` resolved to the base's 16-bit type.
        converter: the type llama.cpp's converter writes (``f32`` under a quantizer type).
    """

    name: str
    converter: str

    @classmethod
    def parse(cls, outtype: str, base_dtype: str = "bfloat16") -> OutType:
        """The type asked for, ``auto`` turned into the base's 16-bit type.

        Args:
            outtype: one of :data:`OUTTYPES` (Unsloth's names too), any case.
            base_dtype: the base's weights' dtype, for ``auto`` (``bfloat16`` gives bf16, anything else f16, as the
                converter's ``auto`` does).

        Returns:
            The :class:`OutType`.

        Raises:
            InputError: a type not written here, naming those that are.

        Example:
            >>> OutType.parse("Q4_K_M"), OutType.parse("auto", "float32").name
            (OutType(name='q4_k_m', converter='f32'), 'f16')
        """
        problems = outtype_problems(outtype)
        if problems:
            raise InputError(problems)
        name = UNSLOTH_NAMES.get(outtype.lower(), outtype.lower())
        if name == "auto":  # the converter's: bf16 for a bf16 base, else f16
            name = "bf16" if "bfloat16" == str(base_dtype).removeprefix("torch.") else "f16"
        return cls(name, name if name in CONVERTER_TYPES else "f32")

    @property
    def quantizer(self) -> bool:
        """Whether llama.cpp makes this type with its quantizer (from the converter's f32 file), not its converter."""
        return self.name not in CONVERTER_TYPES

    @property
    def file_type(self):
        """``general.file_type``: the ``gguf.LlamaFileType``."""
        import gguf

        return gguf.LlamaFileType[_FILE_TYPES[self.name]]

    def retype(self, tensors: list, hparams: dict, arch: str) -> list:
        """The tensors with the types ``llama-quantize`` gives them from the converter's F32 file (unchanged for a
        converter type).

        Args:
            tensors: the converter's :class:`~peft_shardmerge.output.gguf_arch.GGUFTensor` list.
            hparams: the model's hyperparameters.
            arch: ``general.architecture``.

        Returns:
            ``tensors``, retyped in place.
        """
        if self.name in CONVERTER_TYPES:
            return tensors
        import gguf

        from .gguf_arch import block_count, find
        from .gguf_kquants import kquant_tensor_types

        types = kquant_tensor_types(
            self.name,
            [(t.name, tuple(reversed(t.shape))) for t in tensors],
            block_count(hparams),
            find(hparams, ("num_local_experts", "num_experts", "n_routed_experts")) or 0,
            arch=arch,
            n_head=find(hparams, ("num_attention_heads", "n_head")),
            n_head_kv=find(hparams, ("num_key_value_heads", "n_kv_heads")),
            source_types={t.name: t.qtype.name for t in tensors},
        )
        for t in tensors:
            t.qtype = gguf.GGMLQuantizationType[types[t.name]]
        return tensors


def encode(values, qtype) -> bytes:
    """Values (float32; rows on the last axis) in a GGUF type: gguf-py's encoders, bit-exact to llama.cpp's C, and
    for Q4_K, Q5_K and Q6_K, which gguf-py only decodes, :mod:`~peft_shardmerge.output.gguf_kquants`.

    Args:
        values: float32 values; quantized types take whole blocks of the last axis.
        qtype: the ``gguf.GGMLQuantizationType``.

    Returns:
        The bytes.

    Example:
        >>> import gguf, numpy as np
        >>> len(encode(np.ones((2, 32), np.float32), gguf.GGMLQuantizationType.Q8_0))
        68
    """
    import gguf
    import numpy as np

    t = gguf.GGMLQuantizationType
    if qtype == t.Q8_0 and values.shape[-1] % 32 == 0:
        from .gguf_kquants import numba_kernels

        if numba_kernels is not None:  # the same bytes as gguf-py's, on every numba thread
            blocks = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, 32)
            return numba_kernels.quantize_blocks(blocks, "Q8_0").tobytes()
    if qtype in (t.Q4_K, t.Q5_K, t.Q6_K):
        from . import gguf_kquants

        quantize = {
            t.Q4_K: gguf_kquants.quantize_q4_k,
            t.Q5_K: gguf_kquants.quantize_q5_k,
            t.Q6_K: gguf_kquants.quantize_q6_k,
        }
        return quantize[qtype](values.reshape(-1, values.shape[-1])).tobytes()
    return np.ascontiguousarray(gguf.quants.quantize(values, qtype)).tobytes()
