"""PEFT's merge test matrix run through every merge API: each check must equal PEFT's merge (and the unmerged
model's outputs) or be refused by name before anything is written. A seeded sample runs by default; the rest is
marked ``matrix`` (``make test-all`` runs it all)."""

from __future__ import annotations

import copy
import json
import os

import pytest
from conformance_cases import all_cases as _all_cases
from conformance_cases import all_checks, sample_ids
from conformance_harness import GOOD, compare, run_check
from conformance_reference import Env, NotBuildable
from support_view import is_claimed


@pytest.fixture(scope="session")
def conformance_env(tmp_path_factory):
    """The matrix's working folder (:class:`conformance_harness.Env`)."""
    return Env(tmp_path_factory.mktemp("conformance"))


@pytest.fixture(scope="session")
def record_outcome():
    """Return a function (check id, outcome) that appends the outcome to ``$CONFORMANCE_LOG`` when set."""
    log = os.environ.get("CONFORMANCE_LOG")

    def record(check_id: str, kind: str, detail: str) -> None:
        if log:
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps({"check": check_id, "kind": kind, "detail": detail}) + "\n")

    return record


_CHECKS = all_checks()
_SAMPLE = sample_ids(_CHECKS)


def _params():
    for case, path in _CHECKS:
        check_id = f"{case.id}|{path}"
        marks = () if check_id in _SAMPLE else (pytest.mark.matrix,)
        yield pytest.param(case, path, id=check_id, marks=marks)


@pytest.mark.parametrize("case,path", list(_params()))
def test_merge_matches_peft_or_refuses(conformance_env, record_outcome, case, path):
    check_id = f"{case.id}|{path}"
    try:
        ref = conformance_env.reference(case)
    except NotBuildable as exc:
        record_outcome(check_id, "peft-cannot-build", str(exc))
        pytest.skip(str(exc))  # PEFT's own limitation on this model: nothing of ours to check
    configs = [cls(**copy.deepcopy(kw)) for cls, kw in case.configs]
    claimed = (
        case.arch is not None
        and (case.weighted is None or case.weighted[2] in ("cat", "linear"))
        and is_claimed(configs, ref.layer_kinds, path, len(configs) > 1, ref.merged is not None)
    )
    outcome = run_check(conformance_env, case, path, claimed=claimed)
    record_outcome(check_id, outcome.kind, outcome.detail)
    assert outcome.kind in GOOD, f"{outcome.kind}: {outcome.detail}"


def test_the_comparison_catches_wrong_merges(conformance_env):
    """The harness itself: PEFT's own merge passes; a 1e-4 relative change of one tensor, a NaN, a missing tensor
    or outputs off by 1e-3 each fail."""
    case = next(c for c in _all_cases() if c.name == "Vanilla MLP 4 LoRA" and c.arch == "llama")
    ref = conformance_env.reference(case)
    assert ref.merged is not None and not ref.peft_inconsistent
    assert compare(ref.merged, ref.outputs, ref) == ""
    key = next(k for k in ref.merged if k.endswith("mlp.down_proj.weight"))
    off = dict(ref.merged, **{key: ref.merged[key] * (1 + 1e-4)})
    assert "max rel err" in compare(off, ref.outputs, ref)
    nan = dict(ref.merged, **{key: ref.merged[key].clone().fill_(float("nan"))})
    assert "max rel err nan" in compare(nan, ref.outputs, ref)
    missing = {k: v for k, v in ref.merged.items() if k != key}
    assert "keys differ" in compare(missing, ref.outputs, ref)
    assert "outputs differ" in compare(ref.merged, ref.outputs + 1e-3 * ref.outputs.abs().max().clamp_min(1), ref)
