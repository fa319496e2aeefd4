"""Parameters of a module put aside for a while (planning stand-ins, weights gathered in another form) and put back
as they were, the same objects in the same order."""

from __future__ import annotations

import torch
from torch import nn

_MISSING = object()


def put_stand_in(module: nn.Module, name: str, shape, dtype: torch.dtype, saved: dict) -> nn.Parameter:
    """Put a stand-in parameter of ``shape`` and ``dtype`` that holds no memory (one element, expanded) in place of
    ``module``'s parameter ``name`` (:func:`put_param`).

    Args:
        module: the module.
        name: the parameter's name in it.
        shape: the full shape.
        dtype: its dtype.
        saved: the record of what was there, for :func:`restore`.

    Returns:
        The stand-in.

    Example:
        >>> saved = {}; lin = nn.Linear(3, 2); put_stand_in(lin, "weight", (2, 3), torch.float32, saved).shape
        torch.Size([2, 3])
        >>> restore(saved); lin.weight.stride(), [n for n, _ in lin.named_parameters()]
        ((3, 1), ['weight', 'bias'])
    """
    stand_in = nn.Parameter(torch.zeros((), dtype=dtype).expand(tuple(shape)), requires_grad=False)
    put_param(module, name, stand_in, saved)
    return stand_in


def put_param(module: nn.Module, name: str, value: nn.Parameter | None, saved: dict) -> None:
    """Put ``value`` in place of ``module``'s parameter ``name`` (None: remove it), the module's parameters and the
    attribute of that name as they were first kept in ``saved``.

    Args:
        module: the module.
        name: the parameter's name in it.
        value: the parameter to put there, or None.
        saved: the record :func:`restore` reads (a dict, empty at first).

    Example:
        >>> saved = {}; lin = nn.Linear(1, 1); put_param(lin, "weight", None, saved); [n for n, _ in
        ...                                                                             lin.named_parameters()]
        ['bias']
        >>> restore(saved); [n for n, _ in lin.named_parameters()]
        ['weight', 'bias']
    """
    _, _, attrs = saved.setdefault(id(module), (module, dict(module._parameters), {}))
    attrs.setdefault(name, module.__dict__.get(name, _MISSING))
    module.__dict__.pop(name, None)
    if value is None:
        module._parameters.pop(name, None)
    else:
        module._parameters[name] = value


def restore(saved: dict) -> None:
    """Put back every module's parameters, in their order, and the attributes :func:`put_param` moved aside.

    Args:
        saved: the record it filled.

    Example:
        >>> restore({})
    """
    for module, params, attrs in saved.values():
        module._parameters.clear()
        module._parameters.update(params)
        for name, attr in attrs.items():
            if attr is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = attr


__all__ = ["put_param", "put_stand_in", "restore"]
