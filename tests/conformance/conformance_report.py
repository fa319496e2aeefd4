"""Summarises a conformance run's outcome record (``CONFORMANCE_LOG``) as Markdown: counts per path, PEFT type and
outcome, and every failing check with a one-line repro.

Usage: ``python tests/conformance/conformance_report.py LOG [OUT.md]``.
"""

from __future__ import annotations

import collections
import json
import sys

from conformance_harness import GOOD

_TEST = "tests/conformance/test_conformance.py::test_merge_matches_peft_or_refuses"


def load(log: str) -> list[dict]:
    """The records of a run (the last record of each check wins).

    Args:
        log: the JSON-lines file.

    Returns:
        One dict per check: ``check``, ``kind``, ``detail``.

    Raises:
        OSError: the file cannot be read.

    Example:
        >>> load("/tmp/conformance.jsonl")   # doctest: +SKIP
    """
    rows: dict[str, dict] = {}
    with open(log, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            rows[row["check"]] = row
    return list(rows.values())


def markdown(rows: list[dict]) -> str:
    """The summary and failure list.

    Args:
        rows: from :func:`load`.

    Returns:
        Markdown text.

    Raises:
        Nothing.

    Example:
        >>> print(markdown([{"check": "c@llama|merge_checkpoint", "kind": "match", "detail": ""}]).splitlines()[0])
        # Conformance matrix: 1 checks
    """
    by_path = collections.defaultdict(collections.Counter)
    for r in rows:
        by_path[r["check"].split("|")[1]][r["kind"]] += 1
    kinds = sorted({r["kind"] for r in rows})
    lines = [
        f"# Conformance matrix: {len(rows)} checks",
        "",
        "| path | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for path, counts in sorted(by_path.items()):
        lines.append(f"| {path} | " + " | ".join(str(counts[k]) for k in kinds) + " |")
    total = collections.Counter(r["kind"] for r in rows)
    lines.append("| all | " + " | ".join(str(total[k]) for k in kinds) + " |")
    bad = [r for r in rows if r["kind"] not in GOOD and r["kind"] != "peft-cannot-build"]
    lines += ["", f"## Failures ({len(bad)})", ""]
    for kind in sorted({r["kind"] for r in bad}):
        group = [r for r in bad if r["kind"] == kind]
        lines += [f"### {kind} ({len(group)})", ""]
        for r in sorted(group, key=lambda r: r["check"]):
            detail = " ".join(r["detail"].split())[:300]
            lines.append(f"- `{r['check']}`: {detail}")
            lines.append(
                f"  repro: `HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider "
                f"'{_TEST}[{r['check']}]'`"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = markdown(load(sys.argv[1]))
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        print(text)
