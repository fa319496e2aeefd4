"""The model-class checks of a merge from disk, run in a second process beside it: when they run so, the process,
and the outline its plan and the merged one must share."""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import numbers
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import fields, is_dataclass
from enum import Enum

from ..output.files import sidecar

log = logging.getLogger(__name__)

#: what the second process runs: the parent's import path (so that it plans with the very same code), then the
#: planner; ``-I`` keeps the environment's PYTHONPATH and the current folder out of that path. It makes one plan and
#: exits, with its cyclic garbage collector off, as the merge's own on the command line: importing torch,
#: transformers and PEFT and building the model class is most of its time, and the collector would walk the objects
#: they make again and again (docs/benchmarks.md, "Without the cyclic garbage collector").
CHILD = (
    "import gc; gc.disable(); import json, sys; "
    "request = json.loads(sys.stdin.readline()); sys.path[:] = request['path']; "
    "from peft_shardmerge.api.plan_beside import main; sys.exit(main(request))"
)


def checks_beside(choice: str, *, distributed: bool, dry_run: bool, out_dir: str | None = None) -> bool:
    """Whether a merge from disk runs its model-class checks in a second process beside it.

    Args:
        choice: ``MergeOptions.model_checks``: ``"first"``, ``"beside"`` or ``"auto"``.
        distributed: the merge is split over the ranks of a job (they agree on one plan, made first).
        dry_run: only the plan is wanted (made whole, first).
        out_dir: the output folder: where an interrupted run left shards to resume, the checks come first (the
            shards are kept only for the plan they were made with, which may be the whole one).

    Returns:
        True for ``"beside"``; for ``"auto"``, where this process has not imported PEFT yet (a fresh command line,
        whose start-up those imports would be) and two CPUs or more can run the two processes at once.

    Example:
        >>> checks_beside("first", distributed=False, dry_run=False), checks_beside("beside", distributed=False,
        ...     dry_run=True)
        (False, False)
    """
    if distributed or dry_run or choice == "first" or (out_dir is not None and _resumable(out_dir)):
        return False
    if choice == "beside":
        return True
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cpus = os.cpu_count() or 1
    return "peft" not in sys.modules and cpus >= 2


def _resumable(out_dir) -> bool:
    """Whether an interrupted merge into ``out_dir`` left a staging folder (``.<OUT>.partial``) to resume."""
    try:
        return os.path.isdir(sidecar(out_dir, "partial"))
    except TypeError:
        return False


def outline(plan) -> str:
    """A digest of everything a plan from disk holds: every field of the plan, its inputs, tensors and their changes
    (walked field by field, so that a field added later is covered too; temporary folders named by their order rather
    than their random names), and its fingerprint, which adds the input files' sizes and times.

    Args:
        plan: a :class:`~peft_shardmerge.engine.plan.Plan` from
            :func:`~peft_shardmerge.checkpoint.planner.plan_from_folders`.

    Returns:
        A hex SHA-256 digest; plans with the same one make the same files.

    Example:
        >>> import os, tempfile
        >>> from peft_shardmerge import plan_checkpoint_merge
        >>> from peft_shardmerge.testing import build_adapter, build_base
        >>> tmp = tempfile.mkdtemp()
        >>> base = build_base(os.path.join(tmp, "base"))
        >>> adapter = build_adapter(base, os.path.join(tmp, "adapter"))
        >>> out = os.path.join(tmp, "out")
        >>> outline(plan_checkpoint_merge(base, adapter, out)) == outline(plan_checkpoint_merge(base, adapter, out))
        True
        >>> outline(plan_checkpoint_merge(base, adapter, out)) == outline(
        ...     plan_checkpoint_merge(base, adapter, out, dtype="bfloat16"))
        False
    """
    temporary: dict[str, str] = {}
    text = json.dumps([plan.fingerprint(), _canonical(plan, temporary, set())], sort_keys=True)
    for path, mark in temporary.items():
        text = text.replace(json.dumps(path)[1:-1], mark)
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical(value, temporary: dict[str, str], seen: set[int]):
    """``value`` as JSON data: dataclasses field by field (those compared), tensors and modules by their bytes."""
    torch = sys.modules.get("torch")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tempfile.TemporaryDirectory):
        temporary.setdefault(value.name, f"<temporary folder {len(temporary)}>")
        return "TemporaryDirectory"
    if torch is not None and isinstance(value, torch.Tensor):
        if value.is_meta:  # a shape only (PEFT's layers rebuilt on the meta device): their values come from files
            return ["tensor", str(value.dtype), list(value.shape), "meta"]
        data = value.detach().to("cpu").contiguous()
        digest = hashlib.sha256(data.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() if data.numel() else ""
        return ["tensor", str(data.dtype), list(data.shape), digest]
    if torch is not None and isinstance(value, torch.nn.Module):
        return [type(value).__name__, _canonical(dict(value.state_dict()), temporary, seen)]
    if id(value) in seen:
        return "<seen>"
    if is_dataclass(value) and not isinstance(value, type):
        seen = seen | {id(value)}
        return [type(value).__name__] + [
            [f.name, _canonical(getattr(value, f.name), temporary, seen)] for f in fields(value) if f.compare
        ]
    if isinstance(value, dict):
        seen = seen | {id(value)}
        return sorted([str(k), _canonical(v, temporary, seen)] for k, v in value.items())
    if isinstance(value, (list, tuple)):
        seen = seen | {id(value)}
        return [_canonical(v, temporary, seen) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(json.dumps(_canonical(v, temporary, seen), sort_keys=True) for v in value)
    return str(value) if torch is not None and isinstance(value, torch.dtype) else type(value).__name__


class ChecksBeside:
    """The second process: it plans the same merge with every check and sends back the plan's :func:`outline`.
    Made by :meth:`start` (None where the process cannot be started: the checks then come first).

    Args:
        given: the merge's ``(base, adapters)`` arguments, as it resolved them.
        options: the :class:`~peft_shardmerge.options.MergeOptions` fields it was given (keywords).
        known: where their verdict is kept for these inputs (:func:`_known_path`; None: nowhere).
    """

    def __init__(self, given: tuple, options: dict, known: str | None = None) -> None:
        self.given, self.options, self.known = given, options, known
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # never a full pipe: it never waits
        self.started = time.perf_counter()
        try:
            env = dict(os.environ, OMP_NUM_THREADS="1")  # it plans; torch's thread pool would only take cores
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", CHILD], stdin=subprocess.PIPE, stdout=self.out, stderr=self.err, env=env
            )
            request = {"path": sys.path, "given": given, "options": options}
            self.proc.stdin.write((json.dumps(request, default=_plain) + "\n").encode())  # a few kB: taken whole
            self.proc.stdin.close()
        except BaseException:
            self.stop()
            raise

    @classmethod
    def start(cls, given: tuple, options: dict, known: str | None = None) -> "ChecksBeside | None":
        """Start the second process.

        Args:
            given: the merge's ``(base, adapters)`` arguments.
            options: its option keywords.
            known: where its verdict is to be kept (None: nowhere).

        Returns:
            The running checks, or None where no process could be started (the merge then makes them first).

        Example:
            >>> ChecksBeside.start(("base", ["adapter"]), {"weights": object()}) is None  # nothing JSON can send
            True
        """
        try:
            return cls(given, options, known)
        except (OSError, ValueError, TypeError) as e:
            log.debug("the model-class checks could not be started beside the merge (%s); they come first", e)
            return None

    @classmethod
    def start_early(cls, given: tuple, options: dict) -> None:
        """Start the checks of a merge about to be called (the command line, before it imports torch); the merge
        takes them over when it is called with the same arguments (else they are stopped).

        Args:
            given: the merge's ``(base, adapters)`` arguments.
            options: its option keywords.

        Returns:
            None.
        """
        cls.drop_early()
        early = cls.begin(given, options)
        _EARLY[:] = [early] if early is not None else []

    @classmethod
    def drop_early(cls) -> None:
        """Stop the checks started early, if any (their merge makes its checks first, or is not called).

        Returns:
            None.
        """
        for early in _EARLY:
            early.stop()
        _EARLY.clear()

    @classmethod
    def take(cls, given: tuple, opts) -> "ChecksBeside | None":
        """The checks of this merge: those started early for it, else the verdict kept for the same inputs
        (:class:`KnownChecks`), else new ones.

        Args:
            given: the merge's ``(base, adapters)`` arguments.
            opts: its options.

        Returns:
            The running :class:`ChecksBeside` (or a kept verdict), or None where none could be started.
        """
        early = _EARLY.pop() if _EARLY else None
        options = {f.name: getattr(opts, f.name) for f in fields(opts) if f.init}
        if early is not None:
            if early.given == given and early.opts == opts:
                log.debug("model-class checks beside the merge: the ones started early")
                return early
            early.stop()
        return cls.begin(given, options)

    @classmethod
    def begin(cls, given: tuple, options: dict) -> "ChecksBeside | None":
        """The verdict kept for these inputs (:class:`KnownChecks`), else the second process started.

        Args:
            given: the merge's ``(base, adapters)`` arguments.
            options: its option keywords.

        Returns:
            The checks, or None where no process could be started.
        """
        known = _known_path(given, options)  # the inputs' digest: taken once, for the lookup and the keeping
        kept = KnownChecks.at(known, given, options)
        if kept is not None:
            return kept
        log.debug("model-class checks beside the merge: started")
        return cls.start(given, options, known)

    def remember(self, made: str) -> None:
        """Keep the verdict (the outline of the plan these checks made) for a next merge of the same inputs
        (nothing where they have no key, or the cache cannot be written).

        Args:
            made: the outline, once the merge's own plan matched it.
        """
        if self.known is None:
            return
        try:
            os.makedirs(os.path.dirname(self.known), exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=os.path.dirname(self.known), suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"outline": made}, f)
            os.replace(temporary, self.known)
        except OSError as e:  # a cache that cannot be written only costs the next merge its checks
            log.debug("the model-class checks' verdict was not kept (%s)", e)

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
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self.out.close()
        self.err.close()


class KnownChecks(ChecksBeside):
    """The verdict of the model-class checks of an earlier merge of the same inputs, kept in a small cache (a JSON
    file a verdict, named by a digest of what the checks read: the content of the base's small files and of the
    adapters' files but their weights, every safetensors header (not its data), the options, the versions of Python,
    torch, transformers, PEFT, bitsandbytes, safetensors and huggingface_hub, and peft-shardmerge's own source). A
    merge that finds one needs no second process; its plan must still have the outline kept (else the checks run).
    Only verdicts that passed are kept; only local, unquantized bases have one (a quantized base's checks read more
    than headers). ``PEFT_SHARDMERGE_CACHE`` names the folder (default ``~/.cache/peft-shardmerge``);
    ``PEFT_SHARDMERGE_CHECKS_CACHE=0`` turns it off.

    Args:
        given: the merge's ``(base, adapters)`` arguments.
        options: its option keywords.
        known: where the verdict is kept.
        made: the outline kept.
    """

    def __init__(self, given: tuple, options: dict, known: str, made: str) -> None:
        self.given, self.options, self.known, self.made = given, options, known, made
        self.started = time.perf_counter()

    @classmethod
    def at(cls, known: str | None, given: tuple, options: dict) -> "KnownChecks | None":
        """The verdict kept at ``known``, or None.

        Args:
            known: where a verdict for these inputs would be (None: nowhere).
            given: the merge's ``(base, adapters)`` arguments.
            options: its option keywords.

        Returns:
            The kept verdict, or None.

        Example:
            >>> KnownChecks.at(None, ("base", ["adapter"]), {}) is None
            True
        """
        try:
            with open(known or "", encoding="utf-8") as f:
                made = json.load(f)["outline"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        log.debug("model-class checks beside the merge: the verdict kept for the same inputs (%s)", known)
        return cls(given, options, known, made) if isinstance(made, str) else None

    def done(self) -> bool:
        """Always: the verdict is known."""
        return True

    def join(self) -> str:
        """The kept outline."""
        return self.made

    def remember(self, made: str) -> None:
        """Nothing to keep: it is kept already."""

    def stop(self) -> None:
        """Nothing runs."""


def _known_path(given: tuple, options: dict) -> str | None:
    """Where the verdict for these inputs is kept, or None where they have no key (off, a Hub id, a quantized base)."""
    if os.environ.get("PEFT_SHARDMERGE_CHECKS_CACHE", "1") == "0":
        return None
    try:
        base, adapters = given
        adapters = [adapters] if isinstance(adapters, (str, os.PathLike)) else list(adapters)
        digest = hashlib.sha256(json.dumps([_code(), options], sort_keys=True, default=_plain).encode())
        for folder, is_base in [(os.fspath(base), True)] + [(os.fspath(a), False) for a in adapters]:
            if not os.path.isdir(folder) or not _digest_folder(digest, folder, is_base):
                return None
    except (OSError, TypeError, ValueError):
        return None
    root = os.environ.get("PEFT_SHARDMERGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "peft-shardmerge"
    )
    return os.path.join(root, "checks", digest.hexdigest() + ".json")


def _digest_folder(digest, folder: str, base: bool) -> bool:
    """Add a folder to ``digest``: every file's name and size, every safetensors header, the content of the other
    files (a base's only where small: its weights are read by headers alone). False for a quantized base (no key)."""
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            digest.update(f"{name}/".encode())
            continue
        size = os.path.getsize(path)
        digest.update(f"{name}:{size}".encode())
        with open(path, "rb") as f:
            if name.endswith(".safetensors"):
                length = f.read(8)
                digest.update(length + f.read(min(int.from_bytes(length, "little"), 100 << 20)))
            elif not base or size <= 1 << 20:
                data = f.read()
                if base and name == "config.json" and b"quantization_config" in data:
                    return False
                digest.update(hashlib.sha256(data).digest())
    return True


@functools.lru_cache(maxsize=1)
def _code() -> list:
    """What the checks' verdict depends on besides the inputs: the versions of Python and the libraries, and
    peft-shardmerge's own source (its version does not change between edits of a checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    versions = [sys.version]
    for name in ("torch", "transformers", "peft", "bitsandbytes", "safetensors", "huggingface_hub"):
        try:
            versions.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            versions.append(f"{name} -")
    source = hashlib.sha256()
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder, dirs, files in sorted(os.walk(package)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as f:
                source.update(name.encode() + f.read())
    return versions + [source.hexdigest()]


#: the checks started early for a merge about to be called (at most one)
_EARLY: list[ChecksBeside] = []
atexit.register(ChecksBeside.drop_early)  # checks started early for a merge never called end with this process


def options_from(options: dict):
    """The :class:`~peft_shardmerge.options.MergeOptions` of option keywords sent as JSON (lists back to tuples).

    Args:
        options: the keywords.

    Returns:
        The options, for the disk path.

    Example:
        >>> options_from({"dtype": "bfloat16", "weights": [0.7, 0.3]}).weights
        (0.7, 0.3)
    """
    from ..options import MergeOptions

    return MergeOptions.merged(None, **{k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})[0]


def _plain(value):
    """A value JSON cannot write, as JSON can: numbers (numpy's too) as numbers, a torch dtype by its name
    (``bfloat16``), a path as a string; anything else is refused."""
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    raise TypeError(f"{type(value).__name__} cannot be sent to the second process")
