"""The Source protocol: which base tensors a merge reads (name, dtype, shape) and their rows on a chosen device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

__all__ = ["BaseTensor", "Source"]


@dataclass(frozen=True)
class BaseTensor:
    """One base tensor a source holds, as the merged checkpoint names it.

    Attributes:
        name: its key.
        dtype: its dtype once read (a quantized weight's dequantized dtype).
        shape: its shape once read.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@runtime_checkable
class Source(Protocol):
    """Where a merge's base weights come from. Two implementations: a checkpoint on disk
    (:class:`~peft_shardmerge.checkpoint.source.CheckpointSource`: bounded reads, quantized formats dequantized per
    row block)
    and a loaded model (:class:`~peft_shardmerge.model.planner.LiveSource`: bitsandbytes layers dequantized, offloaded
    modules brought in). Changes, plans, the row merge and the sinks are the same for both.

    Example:
        >>> from peft_shardmerge.checkpoint.source import open_checkpoint
        >>> src = open_checkpoint("tiny-llama")                        # doctest: +SKIP
        >>> isinstance(src, Source), src.base_tensors()[0].name       # doctest: +SKIP
        (True, 'model.embed_tokens.weight')
    """

    def base_tensors(self) -> list[BaseTensor]:
        """Every base tensor, in the order the merged checkpoint lists them."""
        ...  # pragma: no cover - a protocol

    def base_rows(self, name: str, device: torch.device) -> Callable[[int, int], torch.Tensor]:
        """``rows(start, stop)``: rows of base tensor ``name`` along dimension 0 (reshaped ``[rows, -1]`` for more
        than two dimensions), in float32 or the stored dtype, on ``device``; a returned block is valid until the
        next call."""
        ...  # pragma: no cover - a protocol
