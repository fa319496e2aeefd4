"""The changes an adapter makes to one base tensor, as typed data the per-tensor merge applies on both paths."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .maths import Factors
from .task_vectors import TaskVectors


@dataclass
class WholeDelta:
    """A change computed for the whole tensor at once (LoHa, LoKr, VeRA, LoRA on a parameter), added row by row.

    Attributes:
        delta: float32, ``[rows, -1]`` like the rows the merge works on.

    Example:
        >>> rows = torch.zeros(2, 2)
        >>> WholeDelta(torch.ones(4, 2)).apply_(rows, 1, 3).tolist()
        [[1.0, 1.0], [1.0, 1.0]]
    """

    delta: torch.Tensor

    def apply_(self, rows: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Add rows ``[start, stop)`` of the delta to ``rows`` in place and return ``rows``."""
        rows += self.delta[start:stop].to(rows.device)
        return rows


@dataclass
class Scale:
    """IA3's change: a multiplier of the rows (sliced with each block) or of the columns (whole).

    Attributes:
        multiplier: from :func:`~peft_shardmerge.engine.maths.ia3_multiplier`.
        per_row: the multiplier has one entry per row.

    Example:
        >>> Scale(torch.tensor([[2.0], [3.0]]), True).apply_(torch.ones(1, 2), 1, 2).tolist()
        [[3.0, 3.0]]
    """

    multiplier: torch.Tensor
    per_row: bool

    def apply_(self, rows: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Scale rows ``[start, stop)`` in place and return them."""
        rows *= (self.multiplier[start:stop] if self.per_row else self.multiplier).to(rows.device)
        return rows


@dataclass
class TokenRows:
    """Trainable tokens: whole rows that replace the base's before LoRA deltas are added.

    Attributes:
        index: the token ids (int64), one per row of ``rows``.
        rows: the trained rows, float32.
    """

    index: torch.Tensor
    rows: torch.Tensor


@dataclass
class Changes:
    """Everything an adapter changes in one stored tensor, in the order the merge applies it: token rows replace
    base rows; LoRA factors and ``lora_bias`` deltas are added; PEFT's whole deltas and IA3 scales follow; DoRA
    rescales last.

    Attributes:
        factors: ``(A, B, scaling)`` of each LoRA module, A flattened to ``[r, columns]`` (convolutions).
        transposed: the stored weight is the transpose of ``B @ A`` (Conv1D, embeddings); DoRA's norms then run
            over the stored columns, so a first pass over the blocks gathers them.
        bias_deltas: whole float32 deltas of a 1-D tensor (``lora_B.bias * scaling``).
        magnitudes: DoRA's ``lora_magnitude_vector`` of each module (one value per row, or per column).
        tokens: trainable-token rows.
        peft: whole deltas and IA3 scales, in order.
        vectors: several adapters' LoRA factors combined by a task-vector method (TIES, DARE, magnitude pruning),
            added like the factors; then ``factors`` is empty.
        keys: the count-check key of each change, counted once when the whole tensor is merged.

    Example:
        >>> Changes().empty
        True
    """

    factors: list[Factors] = field(default_factory=list)
    transposed: bool = False
    bias_deltas: list[torch.Tensor] = field(default_factory=list)
    magnitudes: list[torch.Tensor] = field(default_factory=list)
    tokens: list[TokenRows] = field(default_factory=list)
    peft: list[WholeDelta | Scale] = field(default_factory=list)
    vectors: TaskVectors | None = None
    keys: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing to apply (the tensor is the base, cast)."""
        return not (self.factors or self.bias_deltas or self.magnitudes or self.tokens or self.peft or self.vectors)


@dataclass(frozen=True)
class ChangeKey:
    """The count-check key of one adapter change, on both paths: each must be applied exactly once (``lora_bias``
    keys are counted on disk only; in process a bias change is part of its layer's key).

    Attributes:
        kind: ``"lora"``, ``"lora_bias"``, ``"tokens"`` or ``"peft"``.
        name: the change's own key (a LoRA module's key, ``"tokens:<module>"``, ``"<module>::<parameter>"``).
        tensor: the stored tensor, for changes that reach several (tied token rows); "" otherwise.

    Example:
        >>> str(ChangeKey("lora_bias", "model.q_proj"))
        'model.q_proj.bias'
        >>> str(ChangeKey("tokens", "tokens:model.embed_tokens", "lm_head.weight"))
        'tokens:model.embed_tokens@lm_head.weight'
    """

    kind: str
    name: str
    tensor: str = ""

    def __str__(self) -> str:
        suffix = ".bias" if self.kind == "lora_bias" else ""
        return f"{self.name}{suffix}@{self.tensor}" if self.tensor else f"{self.name}{suffix}"


def peft_delta(layer: torch.nn.Module, adapter: str) -> torch.Tensor:
    """The float32 weight delta of a PEFT layer (LoHa, LoKr, VeRA: ``get_delta_weight``; LoRA on a parameter:
    :func:`param_delta`), unweighted, in the layout of the tensor it changes; the one used from disk and in process.

    Args:
        layer: the PEFT layer.
        adapter: the adapter name.

    Returns:
        The float32 delta.
    """
    if type(layer).__name__ == "ParamWrapper":  # its get_delta_weight rounds to the parameter's dtype (or meta)
        return param_delta(layer, adapter)
    return layer.get_delta_weight(adapter).detach().float()


def param_delta(layer: torch.nn.Module, adapter: str) -> torch.Tensor:
    """The float32 delta of PEFT's LoRA on a parameter (``ParamWrapper``, ``target_parameters``), in the parameter's
    layout.

    PEFT's ``get_delta_weight`` and ``get_delta_factors`` cast to the parameter's dtype (bf16 for a bf16 model)
    before the merge adds them; here the factors are laid out as ``get_delta_factors`` lays them out, and multiplied
    in float32, so that the delta is rounded once, with the sum.

    Args:
        layer: the ``ParamWrapper``.
        adapter: the adapter name.

    Returns:
        ``[experts, ...]`` for fused experts, ``[out, in]`` for a 2-D parameter, float32, unweighted.
    """
    if layer.num_experts == 1:  # a 2-D parameter: PEFT's delta is B @ A, in the weight's [out, in]
        a, b = layer.lora_A[adapter].weight.detach().float(), layer.lora_B[adapter].weight.detach().float()
        return (b @ a) * layer.scaling[adapter]
    lhs, rhs, scaling = expert_factors(layer, adapter)
    return (lhs @ rhs) * scaling


def expert_factors(layer: torch.nn.Module, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """PEFT's ``get_delta_factors`` of LoRA on fused experts, in float32: ``(lhs, rhs, scaling)`` with the delta
    ``scaling * lhs @ rhs`` per expert, laid out as PEFT lays them out, but taken from the ``lora_A``/``lora_B``
    weights as stored (PEFT casts them to the parameter's dtype first, bf16 for a bf16 model).

    Args:
        layer: the ``ParamWrapper`` over a 3-D expert parameter.
        adapter: the adapter name.

    Returns:
        ``lhs`` ``[experts, rows, rank]``, ``rhs`` ``[experts, rank, cols]`` (float32) and the scaling.

    Example:
        >>> from peft import LoraConfig, get_peft_model
        >>> from transformers import AutoModelForCausalLM, Qwen3MoeConfig
        >>> cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...                      num_key_value_heads=1, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8)
        >>> moe = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        >>> peft = get_peft_model(moe, LoraConfig(r=2, target_parameters=["mlp.experts.down_proj"]))
        >>> lhs, rhs, scaling = expert_factors(peft.base_model.model.model.layers[0].mlp.experts, "default")
        >>> lhs.dtype, tuple(lhs.shape), tuple(rhs.shape), scaling
        (torch.float32, (2, 16, 2), (2, 2, 8), 4.0)
    """
    a, b = layer.lora_A[adapter].weight.detach().float(), layer.lora_B[adapter].weight.detach().float()
    experts = layer.num_experts
    a = a.reshape(experts, -1, a.shape[-1])  # (experts, rank, in)
    b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # (experts, out, rank)
    lhs, rhs = (b, a) if layer._did_swap_in_out_features else (a.transpose(-2, -1), b.transpose(-2, -1))
    return lhs, rhs, layer.scaling[adapter]
