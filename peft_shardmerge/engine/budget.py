"""The memory budget: how much accelerator (or, without one, host) memory a merge step may use, and OOM kinds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError


def host_memory() -> tuple[int, int]:
    """Host memory ``(used, total)`` in bytes, from ``/proc/meminfo`` (used = total - available).

    Returns:
        ``(used, total)``; ``(0, 0)`` where ``/proc/meminfo`` is not available.

    Example:
        >>> used, total = host_memory()
        >>> 0 <= used <= total
        True
    """
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
        total = fields["MemTotal"]
        return total - fields.get("MemAvailable", fields.get("MemFree", 0)), total
    except (OSError, KeyError, ValueError):
        return 0, 0


@dataclass
class MemoryBudget:
    """The share of a device's memory the merge may occupy (Unsloth's ``maximum_memory_usage``).

    Attributes:
        fraction: 0 < fraction <= 0.95.

    Example:
        >>> MemoryBudget(0.9).fits(1024, torch.device("cpu"))
        True
    """

    fraction: float = 0.9

    def __post_init__(self) -> None:
        if (
            isinstance(self.fraction, bool)
            or not isinstance(self.fraction, (int, float))
            or not (0 < self.fraction <= 0.95)
        ):
            raise InputError(
                f"maximum_memory_usage must be a fraction in (0, 0.95], got {self.fraction!r}; 0.9 is a good default"
            )

    def fits(self, nbytes: int, device: torch.device) -> bool:
        """Whether ``nbytes`` more can be used on ``device`` without going over the budget.

        On CUDA the process-wide use is ``total - free`` from ``torch.cuda.mem_get_info``, which counts the
        blocks torch's caching allocator keeps for reuse as used: when ``nbytes`` does not fit and the cache
        holds such blocks, they are handed back (``torch.cuda.empty_cache``) and the use read again, so
        that a module is not sent to the CPU for memory this process could reuse, and the device-wide use
        stays within the budget. On the CPU it is the host's used memory.

        Args:
            nbytes: the working set about to be allocated.
            device: where.

        Returns:
            True when current use + ``nbytes`` <= fraction x total.
        """
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            if (total - free) + nbytes <= self.fraction * total:
                return True
            if torch.cuda.memory_reserved(device) <= torch.cuda.memory_allocated(device):
                return False
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            return (total - free) + nbytes <= self.fraction * total
        if device.type == "cpu":
            used, total = host_memory()
            return total == 0 or used + nbytes <= self.fraction * total
        return True


def is_out_of_memory(err: BaseException) -> bool:
    """Whether an exception means an allocation failed (CUDA, other accelerators or the host).

    Args:
        err: the exception.

    Returns:
        True for ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``), ``MemoryError`` and torch's
        "can't allocate memory" / "out of memory" runtime errors.

    Example:
        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
        True
    """
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def free_accelerator_cache() -> None:
    """Release cached accelerator memory after an out-of-memory (no-op without CUDA).

    Returns:
        None.

    Example:
        >>> free_accelerator_cache()
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
