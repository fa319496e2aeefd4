"""The conformance matrix's session: one working folder, tiny bases built once, references built once per case;
and an optional JSON-lines record of every outcome (``CONFORMANCE_LOG=path``) for the failure list."""

from __future__ import annotations

import json
import os

import pytest

from conformance_reference import Env


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


def pytest_collection_modifyitems(config, items):
    """``CONFORMANCE_SHARD=i/n`` keeps the checks of every n-th conformance case from the i-th (to spread the
    matrix over processes); other tests are kept by shard 0 only."""
    shard = os.environ.get("CONFORMANCE_SHARD")
    if not shard:
        return
    i, n = (int(x) for x in shard.split("/"))
    keep, drop, cases = [], [], {}
    for item in items:
        if "conformance" in item.nodeid and "[" in item.nodeid:
            case = item.nodeid.split("[", 1)[1].split("|", 1)[0]  # a case's paths stay together
            (keep if cases.setdefault(case, len(cases)) % n == i else drop).append(item)
        else:
            (keep if i == 0 else drop).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)
