"""The second process of a merge whose model-class checks run beside it: the whole plan's outline, as JSON."""

from __future__ import annotations

import contextlib
import json
import sys

from .disk import whole_plan
from .model_checks import options_from, outline
from .quiet import quiet_libraries


def main(request: dict) -> int:
    """Plan the merge a request names and write ``{"outline": ...}`` or ``{"error": ...}`` on stdout; what the
    libraries print meanwhile goes to stderr, so that the answer is all stdout holds.

    Args:
        request: ``{"given": [base, adapters], "options": {...}}``, as :class:`~peft_shardmerge.api.model_checks.
            ChecksBeside` sends it.

    Returns:
        0: the answer, an error included, is written.
    """
    answer_to = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr), quiet_libraries():
            plan = whole_plan(*request["given"], options_from(request["options"]), [], keep_bitsandbytes_out)
        answer = {"outline": outline(plan)}
    except Exception as e:  # said again, with its own type, by the merge's process planning itself
        answer = {"error": f"{type(e).__name__}: {e}"}
    json.dump(answer, answer_to)
    return 0


def keep_bitsandbytes_out(precision: str, storage: str | None) -> None:
    """Where a plan needs nothing of bitsandbytes (a 16- or 32-bit base merged as stored), keep this process from
    importing it: importing PEFT would, and about a second of this process goes to it (its kernels are compiled at
    import; docs/benchmarks.md, "The checks process without bitsandbytes"), while the merge waits for this process.
    ``None`` in ``sys.modules`` makes ``importlib.util.find_spec`` answer None, so PEFT and transformers take it for
    not installed, as where it is not. Only this process, which exists for the one plan, is ever changed so.

    Args:
        precision: the resolved base precision (``"original"`` or ``"nf4"``: the latter quantizes with it).
        storage: the base's storage (``Quantized.method``), None for a 16- or 32-bit base.

    Example:
        >>> import sys
        >>> keep_bitsandbytes_out("nf4", None); sys.modules.get("bitsandbytes", "left") is not None
        True
    """
    if precision == "original" and storage is None and "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None
