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
            plan = whole_plan(*request["given"], options_from(request["options"]), [])
        answer = {"outline": outline(plan)}
    except Exception as e:  # said again, with its own type, by the merge's process planning itself
        answer = {"error": f"{type(e).__name__}: {e}"}
    json.dump(answer, answer_to)
    return 0
