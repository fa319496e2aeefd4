"""A model sharded by FSDP inside a distributed job: which sharding a model carries, what of it is supported, and
its units' full weights gathered one unit at a time, in the same order on every rank (FSDP2 here, FSDP1 through
:mod:`peft_shardmerge.distributed.fsdp1`)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..quant.bnb_layers import bnb_kind, bnb_layer_kind, is_bnb_layer, quant_state_of
from .param_swap import put_param, restore

log = logging.getLogger(__name__)

#: what each sharding a model can carry is called in messages
SHARDINGS = {
    "fsdp2": "FSDP2 (fully_shard)",
    "fsdp1": "FSDP1 (FullyShardedDataParallel)",
    "zero3": "DeepSpeed ZeRO-3",
    "dtensor": "DTensor parameters outside FSDP (tensor parallelism)",
}


def sharding_of(model: nn.Module) -> str | None:
    """Which data-parallel sharding holds the model's weights.

    Args:
        model: any model.

    Returns:
        ``"fsdp2"``, ``"fsdp1"``, ``"zero3"``, ``"dtensor"`` (DTensor parameters with no FSDP: tensor parallelism,
        refused), or None for a model whose weights each process holds whole.

    Example:
        >>> sharding_of(nn.Linear(2, 2)) is None
        True
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    for m in model.modules():
        if isinstance(m, FSDPModule):
            return "fsdp2"
        if isinstance(m, FullyShardedDataParallel):
            return "fsdp1"
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "zero3"
    if any(hasattr(p, "placements") and hasattr(p, "device_mesh") for p in model.parameters()):
        return "dtensor"
    return None


def sharding_problems(model: nn.Module, base_precision: str) -> list[str]:
    """What stops ``merge_and_save`` on a sharded model: FSDP2, FSDP1 and DeepSpeed ZeRO-3 are supported over
    unquantized weights and over bitsandbytes 4-bit ``Linear4bit`` layers (QLoRA); 8-bit layers are not.

    Args:
        model: the model passed to ``merge_and_save``.
        base_precision: the option given.

    Returns:
        The problems, each naming the sharding and what to do instead; empty for a model that is not sharded.

    Example:
        >>> sharding_problems(nn.Linear(2, 2), "auto")
        []
    """
    kind = sharding_of(model)
    if kind is None:
        return []
    instead = (
        "save the adapter on rank 0 (model.save_pretrained) and merge from disk, on as many processes as you "
        "like: torchrun --nproc_per_node N -m peft_shardmerge merge BASE ADAPTER OUT"
    )
    name = SHARDINGS[kind]
    if kind == "dtensor":
        return [
            f"the model holds {name}, which merge_and_save does not gather (FSDP2, FSDP1 and DeepSpeed ZeRO-3 are "
            f"supported); {instead}"
        ]
    problems = []
    if kind == "fsdp2" and any(_tensor_parallel(p) for p in model.parameters()):
        problems.append(
            f"the model is sharded by {name} over a mesh that also splits weights by tensor parallelism "
            f"(DTensor placements beyond FSDP's Shard(0)), which merge_and_save does not gather; "
            f"{instead}"
        )
    if kind == "zero3" and any(
        hasattr(getattr(p, t, None), "ds_quant_scale")
        for p in model.parameters()
        for t in ("ds_tensor", "ds_secondary_tensor")
    ):
        problems.append(
            f"the model is sharded by {name} with quantized weights (ZeRO++ "
            "zero_quantized_nontrainable_weights or a quantized secondary partition): their gathers are "
            f"lossy, so the merge would not be of the weights trained; turn it off, or {instead}"
        )
    if base_precision == "original":
        problems.append(
            f"base_precision='original' is not available for a model sharded by {name} (each rank "
            f"would read the original checkpoint whole): use 'auto' or 'dequantized', or {instead}"
        )
    odd = [
        f"{n} ({type(m).__name__}{', no quant state' if is_bnb_layer(m, 'Linear4bit') else ''})"
        for n, m in model.named_modules()
        if is_bnb_layer(m) and not _four_bit_with_state(m)
    ]
    odd += [f"{n} (Int8Params)" for n, p in model.named_parameters() if bnb_kind(p) == "8bit"]
    if odd:
        problems.append(
            f"the model is sharded by {name} over bitsandbytes layers, of which merge_and_save gathers "
            f"only 4-bit Linear4bit ones with their quant state (QLoRA): {', '.join(odd[:3])}"
            f"{f' and {len(odd) - 3} more' if len(odd) > 3 else ''}; load the base in 4-bit with "
            f"BitsAndBytesConfig(load_in_4bit=True) before sharding it, or {instead}"
        )
    if kind in ("fsdp1", "zero3") and not any(type(m).__name__.startswith("PeftModel") for m in model.modules()):
        problems.append(
            f"the model is sharded by {name} but holds no PeftModel; pass the model wrapped after get_peft_model"
        )
    return problems


class UnitGatherer:
    """Gathers FSDP units' full weights for each planned tensor, in plan order, on every rank: the units that
    hold the tensor's module (its base layer and adapter factors) are unsharded, and the others released first.

    Every rank must call :meth:`before` for the same tensors in the same order (``unshard`` is a collective), and
    :meth:`close` at the end; after a failure, :meth:`drain` takes the remaining gathers so no rank waits.

    Args:
        model: the sharded model (the root the plan's entries belong to).
        tensors: the planned tensors in the order they are written, each with its ``entry``.

    Attributes:
        peak_numel: the most elements held unsharded at once (a unit or two, never the model).
    """

    def __init__(self, model: nn.Module, tensors: list):
        if sharding_of(model) == "fsdp1":
            from .fsdp1 import Fsdp1Units

            self.units = Fsdp1Units(model)
        elif sharding_of(model) == "zero3":
            from .zero3 import Zero3Units

            self.units = Zero3Units(model)
        else:
            self.units = Fsdp2Units(model)
        owner = self.units.owner
        self.tensors = list(tensors)
        self.schedule = []
        for t in self.tensors:
            e = t.recipe.entry
            # a plain tensor needs its holder alone (not the holder's children); a LoRA layer its whole subtree
            mods = [e.holder] if e.module is None or e.kind == "plain" else list(e.module.modules()) + [e.holder]
            self.schedule.append(tuple(sorted({u for m in mods for u in _units(owner.get(id(m)))})))
        self.step = 0
        self.held: tuple[int, ...] = ()
        self.peak_numel = 0

    def before(self, t) -> None:
        """Gather the units tensor ``t`` is read from (the next tensor of the plan), releasing the others.

        Args:
            t: the next planned tensor.

        Raises:
            RuntimeError: ``t`` is not the next tensor of the plan (ranks would gather in different orders).
        """
        if self.step >= len(self.tensors) or self.tensors[self.step] is not t:
            raise RuntimeError(f"{getattr(t, 'name', t)} was asked for out of plan order")
        self._hold(self.schedule[self.step])
        self.step += 1

    def _hold(self, want: tuple[int, ...]) -> None:
        if want == self.held:
            return
        for i in reversed(self.held):  # held is kept true after each call, so a drain retakes a failed gather
            if i not in want:
                self.units.release(i)
                self.held = tuple(j for j in self.held if j != i)
        for i in want:
            if i not in self.held:
                self.units.gather(i)
                self.held = tuple(sorted(self.held + (i,)))
        self.peak_numel = max(self.peak_numel, sum(self.units.numel(i) for i in want))

    def drain(self) -> None:
        """Take every gather left (after a failure), so that the other ranks are not left waiting."""
        while self.step < len(self.tensors):
            self.before(self.tensors[self.step])
        self.close()

    def abandon(self) -> bool:
        """After a failure: take the gathers left so that no rank waits in one (:meth:`drain`).

        Returns:
            False when even that failed: the ranks are out of step, and no message can follow on their group.
        """
        try:
            self.drain()
            return True
        except Exception as e:
            log.debug("the gathers left could not be taken: %s", e)
            return False

    def close(self) -> None:
        """Release every unit still gathered."""
        self._hold(())


def _tensor_parallel(p) -> bool:
    """Whether a DTensor parameter is split otherwise than FSDP2 splits one: a shard on a dim other than 0, or on
    more than one mesh dim (HSDP replicates on one dim and shards dim 0 on the other)."""
    shards = [x for x in getattr(p, "placements", ()) if not x.is_replicate()]
    return len(shards) > 1 or any(not x.is_shard(0) for x in shards)


def _four_bit_with_state(module: nn.Module) -> bool:
    return (
        is_bnb_layer(module, "Linear4bit") and bnb_layer_kind(module) == "4bit" and quant_state_of(module) is not None
    )


def _units(owned) -> tuple[int, ...]:
    """The units an ``owner`` entry names: none, one index, or several (a module tied into several ZeRO-3 units)."""
    return () if owned is None else owned if isinstance(owned, tuple) else (owned,)


class Fsdp2Units:
    """The units of an FSDP2 model (every module ``fully_shard`` was applied to), outermost first, and which unit
    holds each module's parameters (the nearest unit above it).

    Args:
        model: the sharded model.
    """

    label = "FSDP unit"

    def __init__(self, model: nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self.units: list[nn.Module] = [m for m in model.modules() if isinstance(m, FSDPModule)]
        order = {id(u): i for i, u in enumerate(self.units)}
        self.owner: dict[int, int] = {}
        stack = [(model, None)]
        while stack:
            module, unit = stack.pop()
            unit = order.get(id(module), unit)
            if unit is not None:
                self.owner[id(module)] = unit
            stack.extend((child, unit) for child in module.children())
        self.saved: dict[int, dict] = {}

    def gather(self, i: int) -> None:
        """All-gather unit ``i``'s parameters onto its modules as plain tensors, in the dtype they are stored in
        (collectives).

        ``unshard`` follows the unit's ``MixedPrecisionPolicy``: where it gathers a parameter in another dtype
        (``param_dtype``), that parameter is gathered again whole from its shards (``DTensor.full_tensor``), so that
        the merge reads the weights trained rather than their rounding."""
        from torch.distributed.tensor import DTensor

        unit = self.units[i]
        unit.reshard()  # a unit a forward left unsharded holds its parameters in the compute dtype
        owned = [m for m in unit.modules() if self.owner.get(id(m)) == i]
        sharded = [(m, n, p) for m in owned for n, p in m._parameters.items() if isinstance(p, DTensor)]
        unit.unshard()
        saved: dict = {}
        self.saved[i] = saved
        with torch.no_grad():
            for m, name, p in sharded:
                if m._parameters[name].dtype != p.dtype:
                    if p.device.type != p.device_mesh.device_type:  # offloaded shards, gathered on the mesh's device
                        p = p.to(p.device_mesh.device_type)
                    put_param(m, name, nn.Parameter(p.full_tensor(), requires_grad=False), saved)

    def release(self, i: int) -> None:
        """Free them again (the DTensor shards come back)."""
        restore(self.saved.pop(i, {}))
        self.units[i].reshard()

    def numel(self, i: int) -> int:
        """Elements unit ``i`` holds unsharded: its own parameters, not those of units inside it."""
        from torch.distributed.tensor import DTensor

        return sum(
            p.numel()
            for m in self.units[i].modules()
            if self.owner.get(id(m)) == i
            for p in m.parameters(recurse=False)
            if not isinstance(p, DTensor)
        )
