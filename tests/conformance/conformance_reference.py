"""PEFT's reference for a conformance case: the adapter built on a saved fp32 base and saved with
``save_pretrained``, the unmerged PeftModel's outputs, and PEFT's own ``merge_and_unload``."""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from conformance_cases import Case
from conformance_models import CustomModel, arch_config, build_arch, custom_input
from support_view import base_layer_kind

from peft_shardmerge.testing import model_class, model_inputs, perturb_trainable

#: largest relative error of a merged tensor against PEFT's merge (fp32)
WEIGHT_TOL = 1e-5
#: largest difference of the merged model's outputs from the unmerged model's, relative to max(1, |outputs|)
OUTPUT_TOL = 1e-4


class NotBuildable(Exception):
    """PEFT itself cannot build, save or run this case on this model (no check of ours is possible)."""


@dataclass
class Reference:
    """What PEFT computes for one case."""

    case: Case
    base: str | None  # saved base folder (None for PEFT's nn.Module models)
    adapters: list[tuple[str, str]]  # (adapter name, folder)
    inputs: dict
    outputs: torch.Tensor  # the unmerged PeftModel's outputs
    merged: dict | None  # PEFT's merge_and_unload state dict, fp32; None when PEFT refuses
    peft_refusal: str = ""  # why PEFT's own merge failed
    peft_inconsistent: str = ""  # how PEFT's own merge differs from its unmerged model
    module_model: object = None  # the PeftModel over PEFT's nn.Module (source "module")
    layer_kinds: set = field(default_factory=set)


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out


class Env:
    """The matrix's working folder: tiny bases built once per architecture, references built once per case."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._bases: dict[str, str] = {}
        self._refs: dict[str, Reference] = {}

    def base(self, arch: str) -> str:
        """The saved tiny base of ``arch`` (built on first use)."""
        if arch not in self._bases:
            self._bases[arch] = build_arch(str(self.root / f"base-{arch}"), arch)
        return self._bases[arch]

    def reference(self, case: Case) -> Reference:
        """PEFT's reference for ``case`` (built on first use; the last few are kept). Raises NotBuildable."""
        if case.id not in self._refs:
            if len(self._refs) > 4:  # checks come case by case; keep memory flat
                self._refs.pop(next(iter(self._refs)))
            self._refs[case.id] = build_reference(self, case)
        return self._refs[case.id]


def _seed(case: Case) -> int:
    return int(hashlib.sha1(case.id.encode()).hexdigest()[:8], 16)


def _make_peft(base_model, case: Case):
    """get_peft_model with every adapter of the case, each moved off its initial value (as after training)."""
    from peft import get_peft_model

    names = [f"adapter{i}" if len(case.configs) > 1 else "default" for i in range(len(case.configs))]
    configs = [cls(**copy.deepcopy(kw)) for cls, kw in case.configs]
    pm = get_peft_model(base_model, configs[0], adapter_name=names[0])
    perturb_trainable(pm, 0.05)
    for name, cfg in zip(names[1:], configs[1:]):
        pm.add_adapter(name, cfg)
        pm.set_adapter(name)
        perturb_trainable(pm, 0.05)
    if case.nan:
        with torch.no_grad():
            next(p for n, p in pm.named_parameters() if "lora_B" in n).view(-1)[0] = float("nan")
    return pm, names


def load_peft(ref: Reference):
    """A fresh ``PeftModel`` of the case: the saved base in fp32 plus the saved adapters, all of them active.

    Args:
        ref: the case's reference.

    Returns:
        The PeftModel, in eval mode (for PEFT's nn.Module models: a deep copy of the reference's).

    Raises:
        Exception: whatever PEFT raises.

    Example:
        >>> load_peft(ref)   # doctest: +SKIP
    """
    from peft import PeftModel

    if ref.base is None:
        return copy.deepcopy(ref.module_model)
    cls = model_class(arch_config(ref.case.arch))
    model = cls.from_pretrained(ref.base, dtype=torch.float32)
    (name0, dir0), *rest = ref.adapters
    pm = PeftModel.from_pretrained(model, dir0, adapter_name=name0)
    for name, folder in rest:
        pm.load_adapter(folder, adapter_name=name)
    if rest and ref.case.weighted is None:
        pm.base_model.set_adapter([n for n, _ in ref.adapters])
    return pm.eval()


def _weighted(pm, case: Case):
    """PEFT's add_weighted_adapter of a weighted case, made the active adapter."""
    picked, weights, combination, density = case.weighted
    names = list(pm.peft_config)
    extra = {"density": density} if density is not None else {}
    pm.add_weighted_adapter(
        [names[i] for i in picked], list(weights), "combined", combination_type=combination, **extra
    )
    pm.set_adapter("combined")
    return pm.eval()  # the new adapter's dropout layers start in training mode


def forward(model, inputs) -> torch.Tensor:
    """The model's logits (or first output) on ``inputs``, fp32, detached.

    Args:
        model: a transformers model, a PeftModel or one of PEFT's test modules.
        inputs: keyword inputs.

    Returns:
        The outputs.

    Raises:
        Exception: whatever the forward raises.

    Example:
        >>> forward(torch.nn.Identity(), {"input": torch.ones(1)})
        tensor([1.])
    """
    with torch.no_grad():
        return _logits(model(**inputs)).detach().float().clone()


def build_reference(env: Env, case: Case) -> Reference:
    """PEFT's reference for a case: the adapter built on the fp32 base (weights perturbed so every delta is
    nonzero), saved with ``save_pretrained``, reloaded, its unmerged outputs and PEFT's ``merge_and_unload``.

    Args:
        env: the working folder.
        case: the case.

    Returns:
        The reference.

    Raises:
        NotBuildable: PEFT cannot build, save, reload or run the case on this model.

    Example:
        >>> build_reference(env, case)   # doctest: +SKIP
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    torch.manual_seed(_seed(case))
    try:
        if case.arch is None:
            model = CustomModel(case.model_id).eval()
            pm, names = _make_peft(model, case)
            pm.eval()
            ref = Reference(case, None, [], {"X": custom_input(case.model_id)}, torch.empty(0), None, module_model=pm)
        else:
            base = env.base(case.arch)
            config = arch_config(case.arch)
            model = model_class(config).from_pretrained(base, dtype=torch.float32)
            pm, names = _make_peft(model, case)
            folder = env.root / f"adapter-{case.id}"
            pm.save_pretrained(str(folder))
            adapters = [(n, str(folder if n == "default" else folder / n)) for n in names]
            ref = Reference(case, base, adapters, model_inputs(config), torch.empty(0), None)
        fresh = load_peft(ref)
        if case.weighted is not None:
            torch.manual_seed(_seed(case))  # dare_* prune at random
            fresh = _weighted(fresh, case)
        ref.outputs = forward(fresh, ref.inputs)
        ref.layer_kinds = {
            base_layer_kind(m)
            for m in fresh.modules()
            if isinstance(m, BaseTunerLayer)
            and (type(m).__name__ != "TrainableTokensLayer" or case.peft_type == "TRAINABLETOKENS")
        }
    except Exception as exc:  # PEFT's own failure: the case cannot be checked here
        raise NotBuildable(f"PEFT cannot build this case: {type(exc).__name__}: {str(exc)[:300]}") from exc
    try:
        merged = (fresh if case.weighted is not None else load_peft(ref)).merge_and_unload(safe_merge=True)
        if any(isinstance(m, BaseTunerLayer) for m in merged.modules()) or hasattr(merged, "peft_config"):
            raise RuntimeError("PEFT's merge_and_unload left adapter layers in the model")
        ref.merged = {k: v.detach().float().clone() for k, v in merged.state_dict().items()}
        err = output_err(forward(merged, ref.inputs), ref.outputs)
        if not err <= OUTPUT_TOL:
            ref.peft_inconsistent = f"PEFT's merge_and_unload changes the outputs (rel err {err:.3g})"
    except Exception as exc:  # PEFT refuses: only a refusal of ours is right
        ref.peft_refusal = f"{type(exc).__name__}: {str(exc)[:200]}"
    return ref


def output_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference of two outputs relative to max(1, |want|); inf when the shapes differ.

    Args:
        got: outputs to check.
        want: reference outputs.

    Returns:
        The error (NaN when ``got`` holds NaN).

    Raises:
        Nothing.

    Example:
        >>> output_err(torch.ones(2), torch.ones(2))
        0.0
    """
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))
