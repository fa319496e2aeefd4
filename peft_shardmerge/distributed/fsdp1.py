"""A model sharded by FSDP1 (``FullyShardedDataParallel``): the unsharded view its plan is made from, and its units'
full weights gathered with ``summon_full_params``, one unit at a time.

Outside a gather, FSDP1 holds each original parameter as a 1-D slice of its rank's shard (``use_orig_params=True``)
or not as a parameter at all (``False``), and puts its wrappers into the module names. PyTorch offers no public
call that gives the full shapes without gathering, so the view reads them from each unit's flat parameter
(``_param_infos``, ``_shapes``: the same fields FSDP's own state-dict code uses).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn

from .param_swap import put_param, put_stand_in, restore


def _flat(unit):
    handle = getattr(unit, "_handle", None)
    return handle.flat_param if handle is not None else None


@contextmanager
def planning_view(root: nn.Module) -> Iterator[nn.Module]:
    """The model inside an FSDP1 root as if it were not sharded, for planning only: no wrapper in the module tree,
    and every parameter a stand-in of its full shape and dtype that holds no memory (one element, expanded).

    Args:
        root: the outermost ``FullyShardedDataParallel`` (wrapping a ``PeftModel``).

    Returns:
        A context manager yielding the wrapped model; on exit the tree and the parameters are as they were.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    swapped, saved = [], {}
    units = FSDP.fsdp_modules(root)  # before the wrappers leave the tree
    try:
        for parent in list(root.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, FSDP) and child is not root:
                    parent._modules[name] = child.module  # the wrapped module in the wrapper's place
                    swapped.append((parent, name, child))
        for unit in units:
            fp = _flat(unit)
            if fp is None:
                continue
            for m in unit.modules():  # use_orig_params=False registers the flat parameter itself: not a weight
                for name, p in list(m._parameters.items()):
                    if p is fp:
                        put_param(m, name, None, saved)
            stand_ins = {}
            for info, shape in zip(fp._param_infos, fp._shapes):
                stand_ins[(id(info.module), info.param_name)] = put_stand_in(
                    info.module, info.param_name, shape, fp.dtype, saved
                )
            for info in fp._shared_param_infos:  # tied: the same stand-in, so that the tie is seen
                stand_in = stand_ins[(id(info.prim_module), info.prim_param_name)]
                put_param(info.module, info.param_name, stand_in, saved)
        yield root.module
    finally:
        restore(saved)
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child


class Fsdp1Units:
    """The units of an FSDP1 model, root first, and which unit holds each module's parameters.

    Args:
        root: the outermost ``FullyShardedDataParallel``.
    """

    label = "FSDP unit"

    def __init__(self, root: nn.Module):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        self.units = FSDP.fsdp_modules(root)
        self.owner: dict[int, int] = {}
        for i, unit in enumerate(self.units):
            fp = _flat(unit)
            for info in (list(fp._param_infos) + list(fp._shared_param_infos)) if fp is not None else ():
                self.owner[id(info.module)] = i
        self.open: dict[int, object] = {}
        self.gather(0)  # the root first: FSDP initializes every unit when the root is first used
        self.release(0)

    def gather(self, i: int) -> None:
        """Gather unit ``i``'s full parameters onto its modules (a collective)."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        ctx = FSDP.summon_full_params(self.units[i], recurse=False, writeback=False)
        ctx.__enter__()
        self.open[i] = ctx

    def release(self, i: int) -> None:
        """Free unit ``i``'s gathered parameters."""
        self.open.pop(i).__exit__(None, None, None)

    def numel(self, i: int) -> int:
        """Elements unit ``i`` holds when gathered."""
        fp = _flat(self.units[i])
        return sum(fp._numels) if fp is not None else 0
