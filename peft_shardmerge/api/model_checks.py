"""The model-class checks of a merge from disk, run in a second process beside it: when they run so, the process,
and the outline its plan and the merged one must share."""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

log = logging.getLogger(__name__)

#: the module the second process runs
CHILD = "peft_shardmerge.api.plan_beside"


def checks_beside(choice: str, *, distributed: bool, dry_run: bool) -> bool:
    """Whether a merge from disk runs its model-class checks in a second process beside it.

    Args:
        choice: ``MergeOptions.model_checks``: ``"first"``, ``"beside"`` or ``"auto"``.
        distributed: the merge is split over the ranks of a job (they agree on one plan, made first).
        dry_run: only the plan is wanted (made whole, first).

    Returns:
        True for ``"beside"``; for ``"auto"``, where this process has not imported PEFT yet (a fresh command line,
        whose start-up those imports would be) and two CPUs or more can run the two processes at once.

    Example:
        >>> checks_beside("first", distributed=False, dry_run=False), checks_beside("beside", distributed=False,
        ...     dry_run=True)
        (False, False)
    """
    if distributed or dry_run or choice == "first":
        return False
    if choice == "beside":
        return True
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cpus = os.cpu_count() or 1
    return "peft" not in sys.modules and cpus >= 2


def outline(plan) -> str:
    """A digest of everything a plan from disk writes and says: its fingerprint (inputs, options, tensors, their
    operations and changes), every planned tensor's source and LoRA details, the config, the untied weights, the
    notes and the printed plan.

    Args:
        plan: a :class:`~peft_shardmerge.engine.plan.Plan` from
            :func:`~peft_shardmerge.checkpoint.planner.plan_from_folders`.

    Returns:
        A hex SHA-256 digest; two plans with the same one make the same files.
    """
    tensors = [
        [
            t.name,
            t.out_dtype,
            t.shard,
            str(t.op),
            t.part,
            t.from_adapter,
            t.transposed,
            t.quantize,
            [t.source.name, t.source.dtype, list(t.source.shape), t.source.path, t.source.offset],
            t.source.decoder is not None,
            [
                [m.key, m.kind, m.rank, m.alpha, m.scaling, m.magnitude is not None, m.bias is not None, m.index]
                for m in t.loras
            ],
            [m.key for m in t.bias_loras],
            [r.key for r in t.token_rows],
            [[o.key, getattr(o, "kind", "")] for o in t.peft_ops],
        ]
        for t in plan.tensors
    ]
    data = [plan.fingerprint(), plan.config, plan.untied, plan.notes, plan.describe(), tensors]
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


class ChecksBeside:
    """The second process: it plans the same merge with every check and sends back the plan's :func:`outline`.

    Args:
        given: the merge's ``(base, adapter)`` arguments, as it was given them.
        options: the :class:`~peft_shardmerge.options.MergeOptions` fields it was given (keywords).
    """

    def __init__(self, given: tuple, options: dict) -> None:
        self.given, self.options = given, options
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, OMP_NUM_THREADS="1")  # it plans; torch's thread pool would only take cores
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])  # this very package
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # never a full pipe: it never waits
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", CHILD], stdin=subprocess.PIPE, stdout=self.out, stderr=self.err, env=env
        )
        request = json.dumps({"given": given, "options": options}, default=_plain)
        self.proc.stdin.write(request.encode())  # a few kB: the pipe takes it whole
        self.proc.stdin.close()

    @classmethod
    def start_early(cls, given: tuple, options: dict) -> None:
        """Start the checks of a merge about to be called (the command line, before it imports torch); the merge
        takes them over when it is called with the same arguments (else they are stopped).

        Args:
            given: the merge's ``(base, adapter)`` arguments.
            options: its option keywords.

        Returns:
            None.
        """
        for early in _EARLY:
            early.stop()
        _EARLY[:] = [cls(given, options)]

    @classmethod
    def take(cls, given: tuple, opts) -> "ChecksBeside":
        """The checks of this merge: those started early for it, else new ones.

        Args:
            given: the merge's ``(base, adapter)`` arguments.
            opts: its options.

        Returns:
            The running :class:`ChecksBeside`.
        """
        from dataclasses import fields

        early = _EARLY.pop() if _EARLY else None
        if early is not None:
            if early.given == given and early.opts == opts:
                log.debug("model-class checks beside the merge: the ones started early")
                return early
            early.stop()
        log.debug("model-class checks beside the merge: started")
        return cls(given, {f.name: getattr(opts, f.name) for f in fields(opts) if f.init})

    @property
    def opts(self):
        """The options the second process plans with."""
        return options_from(self.options)

    def done(self) -> bool:
        """Whether the second process has finished."""
        return self.proc.poll() is not None

    def join(self) -> str | None:
        """Wait for the second process.

        Returns:
            The outline of its plan, or None when it did not plan (its error is then raised again by planning here).
        """
        code = self.proc.wait()
        waited = time.perf_counter() - self.started
        self.out.seek(0)
        self.err.seek(0)
        try:
            result = json.loads(self.out.read()) if code == 0 else {}
        except ValueError:
            result = {}
        if "outline" in result:
            log.debug("model-class checks beside the merge: done %.2f s after they started", waited)
            return result["outline"]
        why = result.get("error") or f"exit status {code}: {self.err.read()[-2000:].decode(errors='replace')}"
        log.debug("the model-class checks beside the merge did not plan (%s); planning here", why)
        return None

    def stop(self) -> None:
        """End the second process if it still runs and drop its files."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()


#: the checks started early for a merge about to be called (at most one)
_EARLY: list[ChecksBeside] = []


@atexit.register
def _stop_early() -> None:
    """Checks started early for a merge never called end with this process."""
    for early in _EARLY:
        early.stop()


#: the checks started early for a merge about to be called (at most one)
_EARLY: list[ChecksBeside] = []


@atexit.register
def _stop_early() -> None:
    """Checks started early for a merge never called end with this process."""
    for early in _EARLY:
        early.stop()


def options_from(options: dict):
    """The :class:`~peft_shardmerge.options.MergeOptions` of option keywords sent as JSON (lists back to tuples).

    Args:
        options: the keywords.

    Returns:
        The options, for the disk path.
    """
    from ..options import MergeOptions

    return MergeOptions.merged(None, **{k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})[0]


def _plain(value):
    """A value JSON cannot write, as text: a torch dtype by its name (``bfloat16``), a path as a string."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value).removeprefix("torch.")
