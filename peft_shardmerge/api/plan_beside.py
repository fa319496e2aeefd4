"""The second process of a merge whose model-class checks run beside it: the whole plan's outline, as JSON."""

from __future__ import annotations

import json
import sys

from .disk import whole_plan
from .model_checks import options_from, outline
from .quiet import quiet_libraries


def main() -> int:
    """Plan from the JSON request on stdin, write ``{"outline": ...}`` or ``{"error": ...}`` on stdout.

    Returns:
        0: the answer, an error included, is written.
    """
    request = json.load(sys.stdin)
    try:
        with quiet_libraries():
            plan = whole_plan(*request["given"], options_from(request["options"]), [])
        answer = {"outline": outline(plan)}
    except Exception as e:  # said again, with its own type, by the merge's process planning itself
        answer = {"error": f"{type(e).__name__}: {e}"}
    json.dump(answer, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
