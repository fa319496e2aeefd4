"""Runs one conformance check: one of our merge paths on a case, classified against the invariant: equal to
PEFT's merge and to the unmerged outputs, or refused by name before writing anything, with the model and the
input folders unchanged."""

from __future__ import annotations

import copy
import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from conformance_cases import Case
from conformance_models import CustomModel, arch_config
from conformance_reference import OUTPUT_TOL, WEIGHT_TOL, Env, Reference, forward, load_peft, output_err

from peft_shardmerge.testing import model_class

#: outcomes that satisfy the invariant ("match-unmerged": PEFT's own merge changes the model's outputs, so no
#: result can equal both; the merge is held to the unmerged model's outputs alone)
GOOD = ("match", "match-unmerged", "refused")
#: config fields that describe the case but never name a refusal reason
_PLAIN_FIELDS = {
    "target_modules",
    "task_type",
    "r",
    "lora_alpha",
    "lora_dropout",
    "init_lora_weights",
    "init_weights",
    "bias",
    "feedforward_modules",
}


@dataclass
class Outcome:
    """The classified result of one check: ``kind`` in match, match-unmerged, refused (the invariant holds), or
    wrong, raw, partial (a refusal that wrote files), leftover (files beside a finished output), unnamed, changed
    (the input model or folders modified), claimed-refused; ``detail`` says what was seen."""

    kind: str
    detail: str = ""


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
    if ref.merged is None:  # where PEFT itself refuses, only a refusal is right
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
        if err != err or (worst == worst and err > worst):  # a NaN, once seen, stays the worst
            worst, where = err, key
    if not worst <= WEIGHT_TOL:
        problems.append(f"weights differ from PEFT's merge: max rel err {worst:.3g} at {where}")
    if ref.peft_inconsistent:  # PEFT's merge is not the unmerged model: the outputs alone decide
        problems = [p for p in problems if p.startswith("keys differ")]
    if outputs is not None:
        err = output_err(outputs, ref.outputs)
        if not err <= OUTPUT_TOL:
            problems.append(f"outputs differ from the unmerged model: rel err {err:.3g}")
    return "; ".join(problems)


def _snapshot(model) -> tuple[dict, list]:
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        [(n, type(m).__name__) for n, m in model.named_modules()],
    )


def _unchanged(model, snap) -> str:
    state, modules = snap
    now_state, now_modules = _snapshot(model)
    if now_modules != modules:
        return "the input model's modules changed"
    if set(now_state) != set(state):
        return "the input model's state dict keys changed"
    bad = [
        k
        for k in state
        if not torch.equal(state[k], now_state[k])
        and not (state[k].isnan().any() and torch.equal(state[k].nan_to_num(), now_state[k].nan_to_num()))
    ]
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
    if ref.case.weighted is not None:
        words |= {ref.case.weighted[2], "combination"}
    if path == "merge_and_save:original":  # the original checkpoint can be refused on its own account
        words |= {"base_precision"}
    if ref.base is None:  # PEFT's own nn.Module: the model itself is what is refused
        words |= {type(ref.module_model.get_base_model()).__name__.lower(), "not a transformers model"}
    words |= (
        {"prompt", "virtual token"}
        if ref.case.peft_type in ("PREFIXTUNING", "PROMPTENCODER", "PROMPTTUNING", "CPT")
        else set()
    )
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
    selection, adapters = {}, [d for _, d in ref.adapters]
    if case.weighted is not None:
        picked, weights, combination, _ = case.weighted
        selection = dict(
            adapter_names=[ref.adapters[i][0] for i in picked], weights=list(weights), combination_type=combination
        )
        adapters = [ref.adapters[i][1] for i in picked]
    try:
        if path == "merge_and_unload":
            result = merge_and_unload(model, dtype=torch.float32, **selection)
        elif path == "merge_checkpoint":
            extra = dict(weights=selection["weights"], combination=selection["combination_type"]) if selection else {}
            merge_checkpoint(
                ref.base,
                adapters if len(adapters) > 1 or selection else adapters[0],
                str(out),
                progress=False,
                **extra,
            )
        else:
            merge_and_save(
                model, str(out), dtype=torch.float32, base_precision=path.split(":")[1], progress=False, **selection
            )
    except (UnsupportedError, InputError) as exc:
        refusal = exc
    except Exception as exc:  # the invariant allows no other exception
        return Outcome("raw", f"{type(exc).__name__}: {str(exc)[:400]}")
    if (_digest(ref.base), [_digest(d) for _, d in ref.adapters]) != digests:
        return Outcome("changed", "the base or adapter folder was modified")
    if refusal is not None:
        return _classify_refusal(refusal, ref, path, work, model, snap, claimed)
    try:
        if path == "merge_and_unload":
            got = {k: v.detach().float() for k, v in result.state_dict().items()}
            outputs = forward(result, ref.inputs)
        else:
            got, outputs = _reload(ref, out)
    except Exception as exc:  # a result that does not load or run is a wrong result
        return Outcome("wrong", f"the result does not load or run: {type(exc).__name__}: {str(exc)[:300]}")
    left = sorted(p.name for p in work.iterdir() if p.name != "out")
    if left:
        return Outcome("leftover", f"files left beside the output: {left}")
    problem = compare(got, outputs, ref)
    if not problem and model is not None and path != "merge_and_unload":
        problem = _unchanged(model, snap)
    if not problem and path == "merge_and_unload" and ref.base is not None:
        problem = _roundtrip(result, ref, out)
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


def _roundtrip(model, ref: Reference, out: Path) -> str:
    """As PEFT's merge test does: the model merge_and_unload returned must survive ``save_pretrained`` and
    ``from_pretrained`` with the same outputs."""
    try:
        model.save_pretrained(str(out))
        _, outputs = _reload(ref, out)
    except Exception as exc:  # a returned model that cannot be saved and reloaded is wrong
        return f"the returned model does not survive save_pretrained/from_pretrained: {type(exc).__name__}: {exc}"
    err = output_err(outputs, ref.outputs)
    return "" if err <= OUTPUT_TOL else f"after save_pretrained/from_pretrained the outputs differ: rel err {err:.3g}"


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
        return state, forward(model.eval(), ref.inputs)
    cls = model_class(arch_config(ref.case.arch))
    model, info = cls.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    if info.get("missing_keys") or info.get("mismatched_keys"):
        raise ValueError(f"the written checkpoint lacks weights: {info}")
    return ({k: v.detach().float() for k, v in model.state_dict().items()}, forward(model.eval(), ref.inputs))


__all__ = ["GOOD", "Outcome", "compare", "run_check"]
