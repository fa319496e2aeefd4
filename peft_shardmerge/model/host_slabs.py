"""Host buffers reused for the row blocks a loaded model's merge copies off the device before they are written."""

from __future__ import annotations

import math
import threading

import torch


class HostSlabs:
    """Buffers of one size for row blocks copied out of a model and written later by another thread: taken for a
    block, given back once it is written. Reused, a buffer's pages are touched once, not faulted in afresh for every
    module; page-locked where the blocks come from a GPU, so that the GPU copies into them directly rather than
    through the driver's staging buffer.

    How many are held at once is bounded by what the executor holds (``held_limit``), not here.

    Args:
        nbytes: the size of one buffer (a row block of the plan in the output dtype); a larger block gets a buffer
            of its own, not kept.
        pinned: page-locked buffers (for blocks copied from a GPU).

    Example:
        >>> slabs = HostSlabs(64, pinned=False)
        >>> a = slabs.take((4, 2), torch.float32)
        >>> a.shape, slabs.allocated
        (torch.Size([4, 2]), 1)
        >>> slabs.give(a)
        >>> b = slabs.take((8,), torch.bfloat16)
        >>> slabs.allocated, b.data_ptr() == a.data_ptr()
        (1, True)
    """

    def __init__(self, nbytes: int, pinned: bool):
        self.nbytes, self.pinned = nbytes, pinned
        self._free: list[torch.Tensor] = []
        self._mine: dict[int, torch.Tensor] = {}  # every buffer made here, by its address
        self._lock = threading.Lock()

    @property
    def allocated(self) -> int:
        """Buffers made so far."""
        return len(self._mine)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` in a buffer of this pool (a fresh one of
        its own where it is larger than a buffer).

        Args:
            shape: the block's shape.
            dtype: its dtype.

        Returns:
            The tensor; hand it back with :meth:`give` once nothing reads it any more.
        """
        n = math.prod(shape) * dtype.itemsize
        if n > self.nbytes:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)
        with self._lock:
            slab = self._free.pop() if self._free else None
        if slab is None:
            slab = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
            with self._lock:
                self._mine[slab.data_ptr()] = slab
        return slab[:n].view(dtype).view(shape)

    def give(self, tensor: torch.Tensor) -> None:
        """Hand back a tensor from :meth:`take` (its bytes written: the buffer is reused at once); one of its own size
        is left to be freed."""
        with self._lock:
            slab = self._mine.get(tensor.untyped_storage().data_ptr())
            if slab is not None and all(f is not slab for f in self._free):
                self._free.append(slab)

    def release(self) -> None:
        """Drop every buffer (those still taken are freed when their last reader lets go); page-locked ones are
        handed back to the system, not kept in torch's cache of page-locked memory (where this torch has a call
        to empty it: ``torch.accelerator.empty_host_cache``, or before it ``torch._C._host_emptyCache``)."""
        with self._lock:
            made = bool(self._mine)
            self._free.clear()
            self._mine.clear()
        if self.pinned and made:
            empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
            empty = empty or getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()
