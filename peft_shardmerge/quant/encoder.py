"""What a served format is to the merge: the Encoder a merged weight goes through, and the stored names and row
chunks every format shares."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

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

    def unit(self, shape: tuple[int, ...]) -> int:
        """Rows of a weight the format quantizes apart from the others (a block's rows, one row, one expert): a weight
        is encoded as its rows arrive, a whole number of units at a time."""
        raise NotImplementedError  # pragma: no cover - each format says

    def first(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, object]:
        """Rows of the float32 merge (whole units, but at the weight's end) encoded: the rows of the first stored
        tensor (the codes, written at once), and what the other stored tensors need of them (their scales)."""
        raise NotImplementedError  # pragma: no cover - each format says

    def rest(self, sides: list, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """The other stored tensors of a weight of ``shape``, from what :meth:`first` kept of each run of rows."""
        raise NotImplementedError  # pragma: no cover - each format says

    def encode(self, weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
        """The stored tensors of ``weight`` (the float32 merge), in :meth:`parts`' order; ``dtype`` is the model's
        (the dtype its other tensors are written in): :meth:`first` over runs of whole units, then :meth:`rest`."""
        shape = tuple(weight.shape)
        codes, sides = [], []
        for a, b in row_chunks(shape[0], self.unit(shape), math.prod(shape[1:])):
            c, side = self.first(weight[a:b], dtype)
            codes.append(c)
            sides.append(side)
        return [torch.cat(codes), *self.rest(sides, shape, dtype)]

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


def row_chunks(rows: int, unit: int, cols: int, elems: int = 1 << 22) -> list[tuple[int, int]]:
    """``(start, stop)`` of row chunks of about ``elems`` elements, each a whole number of ``unit`` rows (the last
    what is left): the encoders' temporaries are a chunk's, not the weight's."""
    step = unit * max(1, elems // max(1, unit * cols))
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


def block_tiles(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight [rows, cols]`` as ``[row tiles, block rows, col tiles, block cols]`` (whole blocks)."""
    rows, cols = weight.shape
    return weight.reshape(rows // block[0], block[0], cols // block[1], block[1])
