"""What a walk of a loaded model finds: each output tensor and how to produce it, and the walked model."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..support.model_info import ModelInfo


@dataclass
class LiveEntry:
    """One output tensor of a loaded model and how to produce it.

    Attributes:
        name: its name in the output checkpoint (plain transformers names).
        shape: its shape in the output layout.
        floating: whether it is cast to the output dtype.
        kind: ``"lora"`` (base + LoRA deltas), ``"quantized"`` (a bitsandbytes weight, dequantized),
            ``"saved"`` (a ``modules_to_save`` copy), ``"lora_bias"`` (a bias with ``lora_B.bias``), ``"tokens"``
            (trainable-token rows), ``"delta"`` (base + PEFT's ``get_delta_weight``: LoHa, LoKr, VeRA, LoRA on
            parameters), ``"ia3"`` (base scaled by IA3's vector) or ``"plain"``.
        module: the module holding the tensor (the LoRA layer for ``"lora"``/``"lora_bias"``).
        attr: the tensor's attribute name on the module it lives on.
        holder: the module the attribute belongs to (base layer, ModulesToSaveWrapper copy, ...).
        adapters: active adapter names whose deltas are added.
        transpose_out: the output layout is the transpose of the holder's (Conv1D replaced by bnb Linear).
        numel: elements.
        owner: the path of the PEFT (or bitsandbytes) module this tensor belongs to, the module
            ``merge_and_unload`` replaces; "" for tensors of plain modules.
    """

    name: str
    shape: tuple[int, ...]
    floating: bool
    kind: str
    module: nn.Module
    attr: str
    holder: nn.Module
    adapters: list[str] = field(default_factory=list)
    transpose_out: bool = False
    numel: int = 0
    owner: str = ""


@dataclass
class LiveModel:
    """A walked model: its transformers model, structure facts, and every output tensor in order.

    Attributes:
        model: the transformers model under the PEFT wrapper.
        info: structure of the plain model class (layouts, ties).
        entries: output tensors, in ``state_dict`` order.
        untied: tied weights written separately because the adapter changed one side.
        lora_layers: names of LoRA layers with an active adapter (each must be applied once).
        notes: things to tell the user.
    """

    model: nn.Module
    info: ModelInfo
    entries: list[LiveEntry]
    untied: list[str]
    lora_layers: list[str]
    notes: list[str] = field(default_factory=list)
