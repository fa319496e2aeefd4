"""The merge maths: pure functions from tensors to tensors (no I/O, no logging)."""

from __future__ import annotations

import torch


def lora_delta_rows(
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: float,
    start: int,
    stop: int,
    *,
    transposed: bool,
) -> torch.Tensor:
    """Rows ``[start, stop)`` of a LoRA module's weight delta, in fp32.

    For a Linear stored as ``[out, in]`` the delta is ``(B @ A) * scaling`` and its rows come from rows of
    ``B``. For a weight stored as ``[in, out]`` (GPT-2's Conv1D, ``fan_in_fan_out``) and for an embedding
    (``[num_embeddings, dim]`` with ``lora_embedding_A`` as ``[r, num_embeddings]``), the delta is the
    transpose, and its rows come from columns of ``A``. The order of operations follows PEFT's
    ``get_delta_weight`` so the result agrees with it to fp32 rounding.

    Args:
        a: the A factor ``[r, n]``.
        b: the B factor ``[m, r]``.
        scaling: alpha / r (or alpha / sqrt(r) for rsLoRA).
        start: first row of the stored weight.
        stop: one past the last row.
        transposed: True when the stored weight is ``(B @ A).T``-shaped.

    Returns:
        A float32 tensor of shape ``(stop - start, ...)`` matching the stored weight's rows.

    Example:
        >>> a, b = torch.ones(2, 3), torch.ones(4, 2)
        >>> lora_delta_rows(a, b, 0.5, 0, 2, transposed=False)
        tensor([[1., 1., 1.],
                [1., 1., 1.]])
    """
    a32 = a.to(torch.float32)
    b32 = b.to(torch.float32)
    if transposed:
        return (b32 @ a32[:, start:stop]).T * scaling
    return (b32[start:stop] @ a32) * scaling


def merge_rows(base_rows: torch.Tensor, deltas: list[torch.Tensor]) -> torch.Tensor:
    """Add fp32 deltas to rows of a base weight, in fp32.

    Args:
        base_rows: rows of the base weight, any float dtype.
        deltas: fp32 tensors of the same shape.

    Returns:
        The merged rows in float32 (cast once by the caller).

    Example:
        >>> merge_rows(torch.ones(2, dtype=torch.bfloat16), [torch.full((2,), 0.25)])
        tensor([1.2500, 1.2500])
    """
    out = base_rows.to(torch.float32, copy=True)
    for d in deltas:
        out += d
    return out


def lora_bias_delta(bias_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The change a ``lora_bias=True`` adapter makes to the base bias: ``lora_B.bias * scaling`` in fp32.

    Args:
        bias_b: the ``lora_B.bias`` tensor.
        scaling: the module's LoRA scaling.

    Returns:
        The fp32 bias delta.

    Example:
        >>> lora_bias_delta(torch.ones(2), 2.0)
        tensor([2., 2.])
    """
    return bias_b.to(torch.float32) * scaling
