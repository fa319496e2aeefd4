"""Runs one conformance check: builds PEFT's reference for a case (PEFT's own merge of an fp32 base and the
unmerged model's outputs), runs one of our merge paths, and classifies what it did against the invariant:
equal to PEFT's merge and to the unmerged outputs, or refused by name before writing anything."""

from __future__ import annotations

import copy
import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conformance_cases import Case
from conformance_models import CustomModel, build_arch, arch_config, custom_input
from peft_shardmerge.tiny import model_class, model_inputs, perturb_trainable
from support_view import base_layer_kind

#: largest relative error of a merged tensor against PEFT's merge (fp32)
WEIGHT_TOL = 1e-5
#: largest difference of the merged model's outputs from the unmerged model's, relative to max(1, |outputs|)
OUTPUT_TOL = 1e-4
#: outcomes that satisfy the invariant ("match-unmerged": PEFT's own merge changes the model's outputs, so the
#: merge is held to the unmerged model's outputs alone)
GOOD = ("match", "match-unmerged", "refused")
#: config fields that describe the case but never name a refusal reason
_PLAIN_FIELDS = {"target_modules", "task_type", "r", "lora_alpha", "lora_dropout", "init_lora_weights", "init_weights",
                 "bias", "feedforward_modules"}


class NotBuildable(Exception):
    """PEFT itself cannot build, save or run this case on this model (no check of ours is possible)."""


@dataclass
class Reference:
    """What PEFT computes for one case."""

    case: Case
    base: str | None                      # saved base folder (None for PEFT's nn.Module models)
    adapters: list[tuple[str, str]]       # (adapter name, folder)
    inputs: dict
    outputs: torch.Tensor                 # the unmerged PeftModel's outputs
    merged: dict | None                   # PEFT's merge_and_unload state dict, fp32; None when PEFT refuses
    peft_refusal: str = ""                # why PEFT's own merge failed
    peft_inconsistent: str = ""           # how PEFT's own merge differs from its unmerged model
    module_model: object = None           # the PeftModel over PEFT's nn.Module (source "module")
    layer_kinds: set = field(default_factory=set)


@dataclass
class Outcome:
    """The classified result of one check: ``kind`` in match, refused, wrong, raw, partial, unnamed, changed,
    claimed-refused; ``detail`` says what was seen."""

    kind: str
    detail: str = ""


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out


class Env:
    """The matrix's working folder: tiny bases built once per architecture, references built once per case."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._bases: dict[str, str] = {}
        self._refs: dict[str, Reference] = {}

    def base(self, arch: str) -> str:
        if arch not in self._bases:
            self._bases[arch] = build_arch(str(self.root / f"base-{arch}"), arch)
        return self._bases[arch]

    def reference(self, case: Case) -> Reference:
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
    if rest:
        pm.base_model.set_adapter([n for n, _ in ref.adapters])
    return pm.eval()


def _forward(model, inputs) -> torch.Tensor:
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
            ref = Reference(case, None, [], {"X": custom_input(case.model_id)}, torch.empty(0), None,
                            module_model=pm)
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
        ref.outputs = _forward(fresh, ref.inputs)
        ref.layer_kinds = {base_layer_kind(m) for m in fresh.modules() if isinstance(m, BaseTunerLayer)
                           and (type(m).__name__ != "TrainableTokensLayer" or case.peft_type == "TRAINABLETOKENS")}
    except Exception as exc:  # noqa: BLE001 - PEFT's own failure: the case cannot be checked here
        raise NotBuildable(f"PEFT cannot build this case: {type(exc).__name__}: {str(exc)[:300]}") from exc
    try:
        merged = load_peft(ref).merge_and_unload(safe_merge=True)
        if any(isinstance(m, BaseTunerLayer) for m in merged.modules()) or hasattr(merged, "peft_config"):
            raise RuntimeError("PEFT's merge_and_unload left adapter layers in the model")
        ref.merged = {k: v.detach().float().clone() for k, v in merged.state_dict().items()}
        err = _output_err(_forward(merged, ref.inputs), ref.outputs)
        if not err <= OUTPUT_TOL:
            ref.peft_inconsistent = f"PEFT's merge_and_unload changes the outputs (rel err {err:.3g})"
    except Exception as exc:  # noqa: BLE001 - PEFT refuses: only a refusal of ours is right
        ref.peft_refusal = f"{type(exc).__name__}: {str(exc)[:200]}"
    return ref


def compare(state: dict, outputs: torch.Tensor | None, ref: Reference) -> str:
    """What differs between a merge and PEFT's (weights to :data:`WEIGHT_TOL`, outputs to :data:`OUTPUT_TOL`);
    "" when equal. NaN anywhere counts as different.

    Args:
        state: the merge's state dict.
        outputs: its outputs on the reference inputs (None: not run).
        ref: the reference.

    Returns:
        A description of the first differences, or "".

    Raises:
        Nothing.

    Example:
        >>> compare(state, outputs, ref)   # doctest: +SKIP
        ''
    """
    if ref.merged is None:
        return f"merged although PEFT refuses to merge this case ({ref.peft_refusal})"
    problems = []
    missing, extra = sorted(set(ref.merged) - set(state)), sorted(set(state) - set(ref.merged))
    if missing or extra:
        problems.append(f"keys differ: missing {missing[:4]}, extra {extra[:4]}")
    worst, where = 0.0, ""
    for key in sorted(set(ref.merged) & set(state)):
        a, b = state[key].detach().float(), ref.merged[key]
        if a.shape != b.shape:
            problems.append(f"{key}: shape {tuple(a.shape)} != PEFT's {tuple(b.shape)}")
            continue
        if b.numel() == 0:
            continue
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
        if not err <= worst:  # NaN wins
            worst, where = err, key
    if not worst <= WEIGHT_TOL:
        problems.append(f"weights differ from PEFT's merge: max rel err {worst:.3g} at {where}")
    if ref.peft_inconsistent:  # PEFT's merge is not the unmerged model: the outputs alone decide
        problems = [p for p in problems if p.startswith("keys differ")]
    if outputs is not None:
        err = _output_err(outputs, ref.outputs)
        if not err <= OUTPUT_TOL:
            problems.append(f"outputs differ from the unmerged model: rel err {err:.3g}")
    return "; ".join(problems)


def _output_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))


def _snapshot(model) -> tuple[dict, list]:
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            [(n, type(m).__name__) for n, m in model.named_modules()])


def _unchanged(model, snap) -> str:
    state, modules = snap
    now_state, now_modules = _snapshot(model)
    if now_modules != modules:
        return "the input model's modules changed"
    if set(now_state) != set(state):
        return "the input model's state dict keys changed"
    bad = [k for k in state if not torch.equal(state[k], now_state[k]) and not
           (state[k].isnan().any() and torch.equal(state[k].nan_to_num(), now_state[k].nan_to_num()))]
    return f"the input model's tensors changed: {bad[:3]}" if bad else ""


def _digest(folder: str | None) -> str:
    if folder is None:
        return ""
    h = hashlib.sha1()
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            h.update(str(p).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _names_thing(message: str, ref: Reference, path: str) -> bool:
    """Whether a refusal names what it refuses: the PEFT type, a config field the case sets, a layer kind."""
    text = message.lower()
    words = set()
    for cls, kwargs in ref.case.configs:
        peft_type = str(getattr(cls(**copy.deepcopy(kwargs)).peft_type, "value", ""))
        words |= {cls.__name__.removesuffix("Config").lower(), peft_type.lower(), peft_type.lower().replace("_", "")}
        words |= {k.lower() for k, v in kwargs.items() if k not in _PLAIN_FIELDS and v not in (None, False, [], {})}
    words |= {k.lower().split(" (")[0] for k in ref.layer_kinds}
    if ref.case.nan:
        words |= {"nan", "finite", "inf"}
    if path == "merge_and_save:original":  # the original checkpoint can be refused on its own account
        words |= {"base_precision"}
    if ref.base is None:  # PEFT's own nn.Module: the model itself is what is refused
        words |= {type(ref.module_model.get_base_model()).__name__.lower(), "not a transformers model"}
    words |= {"prompt", "virtual token"} if ref.case.peft_type in ("PREFIXTUNING", "PROMPTENCODER",
                                                                    "PROMPTTUNING", "CPT") else set()
    return any(w and w in text for w in words)


def run_check(env: Env, case: Case, path: str, claimed: bool = False) -> Outcome:
    """Run one merge path on one case and classify the result.

    Args:
        env: the working folder.
        case: the case.
        path: one of :data:`conformance_cases.PATHS`.
        claimed: the allowlist claims the case on this path (a refusal is then a failure too).

    Returns:
        The outcome.

    Raises:
        NotBuildable: PEFT cannot build the case.

    Example:
        >>> run_check(env, case, "merge_checkpoint").kind   # doctest: +SKIP
        'match'
    """
    from peft_shardmerge import merge_and_save, merge_and_unload, merge_checkpoint
    from peft_shardmerge.errors import InputError, UnsupportedError

    ref = env.reference(case)
    work = env.root / f"run-{case.id}-{path.replace(':', '-')}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = work / "out"
    digests = (_digest(ref.base), [_digest(d) for _, d in ref.adapters])
    model = None if path == "merge_checkpoint" else load_peft(ref)
    snap = _snapshot(model) if model is not None else None
    result = refusal = None
    try:
        if path == "merge_and_unload":
            result = merge_and_unload(model, dtype=torch.float32)
        elif path == "merge_checkpoint":
            adapters = [d for _, d in ref.adapters]
            merge_checkpoint(ref.base, adapters if len(adapters) > 1 else adapters[0], str(out), progress=False)
        else:
            merge_and_save(model, str(out), dtype=torch.float32, base_precision=path.split(":")[1], progress=False)
    except (UnsupportedError, InputError) as exc:
        refusal = exc
    except Exception as exc:  # noqa: BLE001 - the invariant allows no other exception
        return Outcome("raw", f"{type(exc).__name__}: {str(exc)[:400]}")
    if (_digest(ref.base), [_digest(d) for _, d in ref.adapters]) != digests:
        return Outcome("changed", "the base or adapter folder was modified")
    if refusal is not None:
        return _classify_refusal(refusal, ref, path, work, model, snap, claimed)
    try:
        if path == "merge_and_unload":
            got = {k: v.detach().float() for k, v in result.state_dict().items()}
            outputs = _forward(result, ref.inputs)
        else:
            got, outputs = _reload(ref, out)
    except Exception as exc:  # noqa: BLE001 - a result that does not load or run is a wrong result
        return Outcome("wrong", f"the result does not load or run: {type(exc).__name__}: {str(exc)[:300]}")
    problem = compare(got, outputs, ref)
    if not problem and model is not None and path != "merge_and_unload":
        problem = _unchanged(model, snap)
    shutil.rmtree(work, ignore_errors=True)
    if problem:
        return Outcome("wrong", problem)
    return Outcome("match-unmerged", ref.peft_inconsistent) if ref.peft_inconsistent else Outcome("match")


def _classify_refusal(exc: Exception, ref: Reference, path: str, work: Path, model, snap, claimed: bool) -> Outcome:
    message = f"{type(exc).__name__}: {str(exc)[:400]}"
    left = sorted(p.name for p in work.iterdir())
    if left:
        return Outcome("partial", f"refused but left {left}: {message}")
    changed = _unchanged(model, snap) if model is not None else ""
    if changed:
        return Outcome("changed", f"{changed} ({message})")
    if not _names_thing(str(exc), ref, path):
        return Outcome("unnamed", message)
    return Outcome("claimed-refused" if claimed else "refused", message)


def _reload(ref: Reference, out: Path) -> tuple[dict, torch.Tensor | None]:
    """The written checkpoint as a state dict and its outputs: ``from_pretrained`` for transformers models (every
    weight must come from the files), the safetensors files into PEFT's nn.Module otherwise."""
    if ref.base is None:
        from safetensors.torch import load_file

        state = {}
        for f in sorted(out.glob("*.safetensors")):
            state.update(load_file(str(f)))
        model = CustomModel(ref.case.model_id)
        model.load_state_dict(state, strict=True)
        return state, _forward(model.eval(), ref.inputs)
    cls = model_class(arch_config(ref.case.arch))
    model, info = cls.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    if info.get("missing_keys") or info.get("mismatched_keys"):
        raise ValueError(f"the written checkpoint lacks weights: {info}")
    return ({k: v.detach().float() for k, v in model.state_dict().items()}, _forward(model.eval(), ref.inputs))


__all__ = ["Env", "Reference", "Outcome", "NotBuildable", "GOOD", "build_reference", "load_peft", "compare",
           "run_check", "WEIGHT_TOL", "OUTPUT_TOL"]
