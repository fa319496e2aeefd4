"""A model partitioned by DeepSpeed ZeRO-3: the unpartitioned view its plan is made from, and each module's full
parameters gathered with ``deepspeed.zero.GatheredParameters``, one module at a time.

Outside a gather, ZeRO-3 leaves each parameter an empty tensor (``shape (0,)``) and keeps its full shape in
``ds_shape``; the view puts a stand-in of that shape in its place. A gather is a collective (DeepSpeed all-gathers
a module's parameters together), so every rank must gather the same parameters in the same order: the plan's order,
which every rank agreed on.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn

from .param_swap import put_param, put_stand_in, restore


def inner_model(model: nn.Module) -> nn.Module:
    """The model a DeepSpeed engine wraps (``deepspeed.initialize``'s first result), else the model itself.

    Args:
        model: a ``DeepSpeedEngine``, or the module it wraps.

    Returns:
        The wrapped module (the PeftModel).

    Example:
        >>> inner_model(nn.Linear(1, 1))
        Linear(in_features=1, out_features=1, bias=True)
    """
    if type(model).__name__ == "DeepSpeedEngine" and isinstance(getattr(model, "module", None), nn.Module):
        return model.module
    return model


def _partitioned(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters(recurse=False) if hasattr(p, "ds_id")]


@contextmanager
def planning_view(model: nn.Module) -> Iterator[nn.Module]:
    """The model as if it were not partitioned, for planning only: every ZeRO-3 parameter replaced by a stand-in of
    its full shape and dtype that holds no memory (one element, expanded).

    Args:
        model: the partitioned PeftModel, or the DeepSpeed engine around it.

    Returns:
        A context manager yielding the PeftModel; on exit every parameter is the one it was.
    """
    inner = inner_model(model)
    saved: dict = {}
    stand_ins: dict[int, nn.Parameter] = {}
    try:
        for module in inner.modules():
            for name, p in _partitioned(module):
                if id(p) in stand_ins:  # tied: the same stand-in, so that the tie is seen
                    put_param(module, name, stand_ins[id(p)], saved)
                else:
                    stand_ins[id(p)] = put_stand_in(module, name, tuple(p.ds_shape), p.dtype, saved)
                    if getattr(p, "quant_state", None) is not None:  # a 4-bit weight's unquantized shape
                        stand_ins[id(p)].quant_state = p.quant_state
        yield inner
    finally:
        restore(saved)


class Zero3Units:
    """The modules of a ZeRO-3 model that hold partitioned parameters of their own, in module order: each is a unit
    gathered on its own (its parameters, not its children's). A module whose parameters are tied to earlier ones
    (a tied head) is owned by every unit that holds one of them.

    Args:
        model: the partitioned PeftModel, or the DeepSpeed engine around it.
    """

    label = "ZeRO-3 module"

    def __init__(self, model: nn.Module):
        self.units: list[list[nn.Parameter]] = []
        self.homes: list[list[tuple[nn.Module, str]]] = []  # where each of a unit's parameters is registered
        self.owner: dict[int, tuple[int, ...]] = {}
        unit_of: dict[int, int] = {}
        for module in inner_model(model).modules():
            params = _partitioned(module)
            new = [(n, p) for n, p in params if id(p) not in unit_of]
            if new:
                unit_of.update((id(p), len(self.units)) for _, p in new)
                self.units.append([p for _, p in new])
                self.homes.append([(module, n) for n, _ in new])
            if params:  # a parameter tied to an earlier module's is gathered with that module's unit
                self.owner[id(module)] = tuple(sorted({unit_of[id(p)] for _, p in params}))
        self.open: dict[int, tuple[object, dict]] = {}
        self.masters: set[int] = set()  # the parameters read from their fp32 masters

    def gather(self, i: int) -> None:
        """All-gather unit ``i``'s parameters in full onto its module (collectives).

        A trainable parameter whose optimizer keeps an fp32 master copy (DeepSpeed's ``bf16``/``fp16`` modes hold
        16-bit copies in the module) is read from that master (``deepspeed.utils.safe_get_full_fp32_param``), the
        weights the optimizer trained, rather than their rounding."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        ctx = deepspeed.zero.GatheredParameters(self.units[i], modifier_rank=None)
        ctx.__enter__()
        saved: dict = {}
        self.open[i] = (ctx, saved)
        for p, (module, name) in zip(self.units[i], self.homes[i]):
            if not (p.requires_grad and hasattr(p, "_z3_optimizer")):
                continue
            master = safe_get_full_fp32_param(p)  # a collective, taken by every rank for the same parameters
            if master is not None and master.dtype != p.dtype:
                put_param(module, name, nn.Parameter(master.to(p.device).view(p.shape), requires_grad=False), saved)
                self.masters.add(id(p))

    def release(self, i: int) -> None:
        """Partition unit ``i``'s parameters again."""
        ctx, saved = self.open.pop(i)
        restore(saved)
        ctx.__exit__(None, None, None)

    def numel(self, i: int) -> int:
        """Elements unit ``i`` holds when gathered."""
        return sum(int(p.ds_numel) for p in self.units[i])


__all__ = ["inner_model", "planning_view", "Zero3Units"]
