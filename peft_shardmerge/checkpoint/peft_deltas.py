"""PEFT adapters merged from disk through PEFT's own layers (LoHa, LoKr, VeRA, IA3, LoRA on parameters), rebuilt on a
meta-device model."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from ..engine.changes import expert_factors, peft_delta
from ..errors import InputError, UnsupportedError

log = logging.getLogger(__name__)

ADAPTER = "default"
#: PEFT types merged from disk through PEFT's own layers
DELTA_TYPES = ("LOHA", "LOKR", "VERA", "IA3")


@dataclass
class PeftOp:
    """One change a PEFT layer makes to one base tensor.

    Attributes:
        key: a unique name (``"<module>::<attribute>"``), used by the count check.
        path: the module's in-memory name, e.g. ``model.layers.0.self_attn.q_proj``.
        attr: ``"weight"`` or ``"bias"``.
        kind: ``"delta"`` (add PEFT's ``get_delta_weight``) or ``"scale"`` (IA3: multiply by its vector).
        layer: the PEFT layer holding the adapter's tensors (its base layer is on the meta device).
    """

    key: str
    path: str
    attr: str
    kind: str
    layer: torch.nn.Module

    def delta(self) -> torch.Tensor:
        """PEFT's weight delta in the layout of the in-memory tensor, float32 (``kind == "delta"``)."""
        return peft_delta(self.layer, ADAPTER)

    def scale(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, bool]:
        """IA3's multiplier for the stored tensor of ``shape`` (``kind == "scale"``); see
        :func:`~peft_shardmerge.engine.maths.ia3_multiplier`."""
        from ..engine.maths import ia3_multiplier

        return ia3_multiplier(
            self.layer.ia3_l[ADAPTER].detach(),
            shape,
            feedforward=self.layer.is_feedforward,
            fan_in_fan_out=getattr(self.layer, "fan_in_fan_out", False),
            bias=self.attr == "bias",
        )


@dataclass
class PartOp:
    """A PEFT delta of an in-memory tensor, for one of the checkpoint keys that store it.

    Attributes:
        op: the PEFT layer's change (:class:`PeftOp`).
        memory_name: the in-memory tensor, e.g. ``model.layers.0.mlp.experts.gate_up_proj``.
        file_name: the checkpoint key this part is written to.
        count: how many checkpoint keys share the delta.
    """

    op: PeftOp
    memory_name: str
    file_name: str
    count: int

    @property
    def key(self) -> str:
        return f"{self.op.key}@{self.file_name}"

    @property
    def kind(self) -> str:
        return "part"


@dataclass
class PeftLayers:
    """The layers of a non-LoRA adapter, rebuilt without the base weights.

    Attributes:
        peft_type: ``"LOHA"``, ``"LOKR"``, ``"VERA"``, ``"IA3"`` or ``"LORA"`` (with ``target_parameters``).
        ops: every change to a base tensor, by in-memory tensor name.
        model: the meta-device PeftModel carrying the layers (kept alive for them).
    """

    peft_type: str
    ops: dict[str, PeftOp] = field(default_factory=dict)
    model: object = None
    _rows: dict = field(default_factory=dict, repr=False)

    def split(self, memory_name: str, delta: torch.Tensor) -> dict[str, torch.Tensor]:
        """A delta of an in-memory tensor that the checkpoint stores in parts (fused MoE experts stored per expert),
        cut into those parts by transformers' own reverse conversion (what ``save_pretrained`` does).

        Args:
            memory_name: the in-memory tensor name, e.g. ``model.layers.0.mlp.experts.gate_up_proj``.
            delta: its delta.

        Returns:
            The delta of each checkpoint key.
        """
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.model.base_model.model, {memory_name: delta})

    def part_delta(self, op: PeftOp, memory_name: str, file_key: str) -> torch.Tensor | None:
        """One checkpoint key's delta of a fused expert parameter, computed from that expert's LoRA factors alone.

        Which expert and which rows a key holds is learned once per parameter by running transformers' reverse
        conversion on a small stand-in (one value per expert row). When the conversion does more than pick
        experts and rows (e.g. transposes), None is returned and the caller cuts the whole delta instead.

        Args:
            op: the LoRA-on-parameter change.
            memory_name: the fused parameter's in-memory name.
            file_key: the checkpoint key.

        Returns:
            The float32 delta of ``file_key``, or None.
        """
        if type(op.layer).__name__ != "ParamWrapper":
            return None
        if memory_name not in self._rows:
            self._rows[memory_name] = self._expert_rows(op.layer.get_param().shape, memory_name)
        rows = self._rows[memory_name]
        if rows is None or file_key not in rows:
            return None
        expert, index = rows[file_key]
        lhs, rhs, scaling = expert_factors(op.layer, ADAPTER)  # float32, not PEFT's factors cast to the base dtype
        return (lhs[expert][index] @ rhs[expert]) * scaling

    def _expert_rows(self, shape: torch.Size, memory_name: str) -> dict[str, tuple[int, torch.Tensor]] | None:
        if len(shape) != 3:
            return None
        experts, rows = shape[0], shape[1]
        stand_in = torch.arange(experts * rows, dtype=torch.float64).reshape(experts, rows, 1)
        try:
            pieces = self.split(memory_name, stand_in)
        except Exception:  # the whole-delta route remains
            return None
        out = {}
        for key, piece in pieces.items():
            if piece.dim() != 2 or piece.shape[1] != 1:
                return None
            ids = piece.reshape(-1).long()
            expert = ids // rows
            if not bool((expert == expert[0]).all()):
                return None
            out[key] = (int(expert[0]), ids % rows)
        return out


def rebuild(
    adapter_folder: str,
    adapter_config: dict,
    base_config: object,
    model_class: type | None,
    skip: "set[str] | frozenset[str]" = frozenset(),
) -> PeftLayers:
    """Rebuild a LoHa, LoKr, VeRA or IA3 adapter's layers with PEFT on a meta-device copy of the base model and
    load the adapter's tensors into them (on the CPU); the base weights are never read.

    Args:
        adapter_folder: the adapter folder (``adapter_config.json``, ``adapter_model.safetensors``).
        adapter_config: its parsed config.
        base_config: the base model's transformers config.
        model_class: the transformers class of the base (None: the config's Auto class).
        skip: adapter tensor names merged another way (``modules_to_save`` copies, trainable-token rows).

    Returns:
        The :class:`PeftLayers`.

    Raises:
        UnsupportedError: a type or option PEFT cannot rebuild without the base (named), e.g. VeRA saved with
            ``save_projection=False``.
        InputError: the adapter's tensors do not fit the layers PEFT builds (wrong base).
    """
    from peft import PeftConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import load_file

    peft_type = str(adapter_config.get("peft_type"))
    if peft_type == "VERA" and not adapter_config.get("save_projection", True):
        raise UnsupportedError(
            "the VeRA adapter was saved with save_projection=False: its shared projections are "
            "not in the folder; merge it in process with peft_shardmerge.merge_and_save"
        )
    config = PeftConfig.from_pretrained(adapter_folder)
    from ..support.model import adapter_keys
    from ..support.model_info import build_on_meta

    model = build_on_meta(base_config, model_class)
    if model is None:
        raise UnsupportedError(
            f"the base model class for {type(base_config).__name__} cannot be built, so the "
            f"{peft_type} layers cannot be rebuilt; merge in process with merge_and_save"
        )
    try:
        peft_model = get_peft_model(model, config, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    except (ValueError, RuntimeError, TypeError, KeyError) as e:
        raise InputError(
            f"PEFT cannot build the {peft_type} layers of {adapter_folder} on this base "
            f"({str(e).splitlines()[0]}); the adapter was trained on a different model"
        ) from e
    names = {_without_adapter(k): k for k in peft_model.state_dict()}
    state = {
        k: v for k, v in load_file(os.path.join(adapter_folder, "adapter_model.safetensors")).items() if k not in skip
    }
    unknown = [k for k in state if k not in names]
    if unknown:
        raise InputError(
            f"adapter tensors {unknown[:3]} have no place in the {peft_type} layers PEFT builds on this "
            "base; the adapter was trained on a different model"
        )
    peft_model.load_state_dict({names[k]: v for k, v in state.items()}, strict=False, assign=True)  # stay on CPU
    missing = sorted(
        k
        for k, v in peft_model.state_dict().items()
        if ADAPTER in k.split(".")
        and v.is_meta
        and "modules_to_save" not in k
        and "token_adapter" not in k
        and "trainable_tokens" not in k
    )
    if missing:
        raise InputError(f"the adapter lacks {missing[:3]}; is adapter_model.safetensors complete?")
    out = PeftLayers(peft_type, model=peft_model)
    inner = peft_model.base_model.model
    for path, module in inner.named_modules():
        if not isinstance(module, BaseTunerLayer) or ADAPTER not in adapter_keys(module):
            continue
        if type(module).__name__ == "ParamWrapper":  # LoRA on a parameter; nested wrappers share the module
            real = path
            while real.endswith(".base_layer"):
                real = real.removesuffix(".base_layer")
            name = f"{real}.{module.parameter_name}"
            out.ops[name] = PeftOp(f"{real}::{module.parameter_name}", real, module.parameter_name, "delta", module)
        elif hasattr(module, "ia3_l"):
            out.ops[f"{path}.weight"] = PeftOp(f"{path}::weight", path, "weight", "scale", module)
            if not module.is_feedforward and getattr(module.get_base_layer(), "bias", None) is not None:
                out.ops[f"{path}.bias"] = PeftOp(f"{path}::bias", path, "bias", "scale", module)
        elif hasattr(module, "get_delta_weight"):
            out.ops[f"{path}.weight"] = PeftOp(f"{path}::weight", path, "weight", "delta", module)
        elif type(module).__name__ != "TrainableTokensLayer":  # token rows are merged from the adapter's tensors
            raise UnsupportedError(
                f"{type(module).__name__} at {path!r} has no weight delta PEFT can compute; "
                "this adapter cannot be merged"
            )
    if not out.ops:
        raise InputError(f"the {peft_type} adapter in {adapter_folder} changes no layer of this base")
    log.debug("rebuilt %d %s layer(s) on the meta device", len(out.ops), peft_type)
    return out


def _without_adapter(key: str) -> str:
    parts = key.split(".")
    return ".".join(p for p in parts if p != ADAPTER)
