"""Where base weights come from: a checkpoint folder (or cached Hub snapshot) described from its headers alone."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field

from ..errors import CorruptFileError, InputError, NotFoundError
from ..io.safetensors_io import TensorInfo, check_with_safetensors, read_header
from ..output.side_files import list_side_files
from ..quant.formats import QuantView, dequantized_view

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: files copied unchanged from the base (and, for tokenizer files, from the adapter when it has them)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
EXTRA_FILES = ("generation_config.json", "preprocessor_config.json", "processor_config.json")


def resolve_folder(location: str, *, what: str, must_have: tuple[str, ...]) -> str:
    """Turn a local folder or a Hub id already in the local Hugging Face cache into a folder path.

    Never downloads: a Hub id is looked up with ``local_files_only=True``.

    Args:
        location: a folder path, or a Hub id such as ``"org/name"``.
        what: how to call it in messages (``"base"``, ``"adapter"``).
        must_have: file names of which at least one must be in the folder.

    Returns:
        The absolute folder path.

    Raises:
        NotFoundError: neither a folder nor a cached Hub id, or none of ``must_have`` is there.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> resolve_folder(folder, what="base", must_have=("config.json",))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        peft_shardmerge.errors.NotFoundError: base folder /... has none of config.json
        >>> _ = open(os.path.join(folder, "config.json"), "w").write("{}")
        >>> resolve_folder(folder, what="base", must_have=("config.json",)) == folder
        True
    """
    path = os.path.abspath(os.path.expanduser(location))
    if not os.path.isdir(path):
        if os.path.exists(path):
            raise NotFoundError(f"{what} {location!r} is a file; pass the folder that holds it")
        cached = _from_hf_cache(location)
        if cached is None:
            raise NotFoundError(
                f"{what} {location!r} is not a folder, nor a Hub id in the local Hugging Face cache; "
                f"pass a local folder, or download it first (hf download {location})"
            )
        path = cached
    if not any(os.path.exists(os.path.join(path, name)) for name in must_have):
        raise NotFoundError(
            _swapped_hint(path, what)
            + f"{what} folder {path} has none of {', '.join(must_have)}"
            + _checkpoints_hint(path, must_have)
        )
    return path


def _checkpoints_hint(path: str, must_have: tuple[str, ...]) -> str:
    """Where a training run's output folder holds what was asked for in its ``checkpoint-N`` folders (the Trainer's
    saves): "; it holds ... (pass one, e.g. the last: ...)", newest step last; else ""."""
    found = []
    try:
        entries = os.listdir(path)
    except OSError:
        return ""
    for name in entries:
        step = name.removeprefix("checkpoint-")
        if step.isdigit() and any(os.path.isfile(os.path.join(path, name, m)) for m in must_have):
            found.append((int(step), name))
    if not found:
        return ""
    names = [n for _, n in sorted(found)]
    shown = ", ".join(names[:3] + (["..."] if len(names) > 4 else []) + names[3:][-1:])
    return (
        f"; it holds {len(names)} training checkpoint(s) that do ({shown}): pass one, e.g. the last, "
        f"{os.path.join(path, names[-1])}"
    )


def _swapped_hint(path: str, what: str) -> str:
    """ "BASE and ADAPTER look swapped: " and why, when the base folder holds an adapter or the adapter folder a model;
    else ""."""

    def has(name: str) -> bool:
        return os.path.exists(os.path.join(path, name))

    if what == "base" and has("adapter_config.json"):
        holds = "adapter_config.json, an adapter"
    elif (
        what == "adapter"
        and has("config.json")
        and any(n.endswith((".safetensors", ".safetensors.index.json")) for n in os.listdir(path))
    ):
        holds = "config.json and model weights, a base checkpoint"
    else:
        return ""
    return (
        f"BASE and ADAPTER look swapped: the {what} folder {path} holds {holds}; pass the base checkpoint first, "
        "then the adapter (peft-shardmerge merge BASE ADAPTER OUT, merge_checkpoint(base, adapter, out)). "
    )


def _from_hf_cache(repo_id: str) -> str | None:
    if repo_id.count("/") > 1 or repo_id.startswith((".", "/")):
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return None
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        return None


def safe_shard_name(folder: str, name: object) -> str:
    """Validate a shard file name taken from an index and return its path.

    Args:
        folder: the folder holding the index.
        name: the shard name from the index's ``weight_map``.

    Returns:
        The shard's path inside ``folder``.

    Raises:
        CorruptFileError: the name is not a plain ``.safetensors`` file name in that folder.

    Example:
        >>> safe_shard_name("/ckpt", "model-00001-of-00002.safetensors")
        '/ckpt/model-00001-of-00002.safetensors'
    """
    if (
        not isinstance(name, str)
        or not name.endswith(".safetensors")
        or name != os.path.basename(name)
        or name in (".", "..")
        or "\\" in name
        or "\x00" in name
    ):
        raise CorruptFileError(
            f"{os.path.join(folder, INDEX_FILE)}: shard name {name!r} is not a plain .safetensors file name "
            "in the same folder; fix the index"
        )
    return os.path.join(folder, name)


@dataclass
class CheckpointSource:
    """A base checkpoint on disk, described from config.json and safetensors headers only.

    Attributes:
        folder: the checkpoint folder.
        config: the parsed ``config.json``.
        tensors: every tensor, in checkpoint order (index order of shards, then file order); for a quantized
            checkpoint, the dequantized tensors as transformers names them (:mod:`~peft_shardmerge.quant.formats`).
        by_name: the same, by name.
        extra_files: the folder's other files, carried into the output (paths relative to ``folder``,
            :func:`~peft_shardmerge.output.side_files.list_side_files`).
        stored: every tensor as stored in the files (the same as ``tensors`` for an unquantized checkpoint).
        quantized: for a quantized checkpoint, its :class:`~peft_shardmerge.quant.formats.QuantView`.
    """

    folder: str
    config: dict
    tensors: list[TensorInfo]
    by_name: dict[str, TensorInfo] = field(default_factory=dict)
    extra_files: list[str] = field(default_factory=list)
    stored: list[TensorInfo] = field(default_factory=list)
    quantized: QuantView | None = None

    def __post_init__(self) -> None:
        self.stored = self.stored or list(self.tensors)

    @property
    def extra_bytes(self) -> int:
        """The bytes of :attr:`extra_files`, which the merge carries into its output."""
        return sum(os.path.getsize(os.path.join(self.folder, f)) for f in self.extra_files)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def open_checkpoint(location: str, *, check_files: bool = True) -> CheckpointSource:
    """Describe a base checkpoint: its config and every tensor, reading headers only.

    Args:
        location: a folder with ``config.json`` and ``model.safetensors`` or a sharded index, or a Hub
            id in the local cache. The weights are those transformers reads (:func:`weights_entry`), and every
            file is validated as safetensors validates it.
        check_files: open every weights file with safetensors now (it maps each file whole); False leaves that to
            :func:`check_base_files`, once the output's free space has been checked.

    Returns:
        The :class:`CheckpointSource`.

    Raises:
        NotFoundError: folder, config or weights are missing.
        CorruptFileError: an index or shard is malformed, or a tensor name appears twice.
        InputError: the checkpoint has only pickle (``.bin``) weights, or is quantized in a format this version
            does not read (:func:`~peft_shardmerge.quant.formats.dequantized_view`).
    """
    folder = resolve_folder(location, what="base", must_have=("config.json",))
    config = read_json(os.path.join(folder, "config.json"), "base config.json")
    files, wmap, index_path = _weight_files(folder, config)
    tensors: list[TensorInfo] = []
    by_name: dict[str, TensorInfo] = {}
    for path in files:
        infos, _meta = read_header(path, check=check_files)
        for t in infos:
            if t.name in by_name:
                raise CorruptFileError(
                    f"tensor {t.name!r} appears in both {os.path.basename(by_name[t.name].path)} and "
                    f"{os.path.basename(path)}; the checkpoint is inconsistent"
                )
            if wmap is not None and os.path.join(folder, str(wmap.get(t.name, ""))) != path:
                raise CorruptFileError(
                    f"{index_path}: tensor {t.name!r} is in {os.path.basename(path)} but the index says "
                    f"{wmap.get(t.name)!r}; regenerate the index"
                )
            by_name[t.name] = t
            tensors.append(t)
    if wmap is not None:
        absent = sorted(set(wmap) - set(by_name))
        if absent:
            raise CorruptFileError(f"{index_path}: names tensors no shard holds: {', '.join(absent[:5])}")
    view = dequantized_view(folder, config, tensors)
    if view is None:
        return CheckpointSource(folder, config, tensors, by_name, list_side_files(folder))
    logical = {t.name: t for t in view.tensors}
    if len(logical) != len(view.tensors):  # a dequantized name that is also stored as a tensor of its own
        twice = sorted(n for n, count in Counter(t.name for t in view.tensors).items() if count > 1)
        raise CorruptFileError(
            f"base {folder}: {', '.join(twice[:5])} stored both quantized and unquantized; the "
            "checkpoint is inconsistent: re-download or re-convert it"
        )
    return CheckpointSource(folder, config, view.tensors, logical, list_side_files(folder), tensors, view)


def check_base_files(src: CheckpointSource) -> None:
    """Open every weights file of a base with safetensors, as :func:`open_checkpoint` does unless told not to.

    Args:
        src: a base described with ``open_checkpoint(..., check_files=False)``.

    Returns:
        None.

    Raises:
        CorruptFileError: safetensors refuses a file.
        InputError: a file cannot be mapped into memory (an address-space or memory limit); the message names it.

    Example:
        >>> import tempfile
        >>> from peft_shardmerge.testing import build_base
        >>> src = open_checkpoint(build_base(tempfile.mkdtemp() + "/base"), check_files=False)
        >>> check_base_files(src)
    """
    for path in _weight_files(src.folder, src.config)[0]:
        check_with_safetensors(path)


def _weight_files(folder: str, config: dict) -> tuple[list[str], dict | None, str]:
    """The weights files of a base folder, its index's weight map (None for one file) and the index path."""
    entry, problem = weights_entry(folder, config)
    index_path = os.path.join(folder, INDEX_FILE)
    if problem:
        raise CorruptFileError(problem)
    if entry is not None and entry.endswith(".index.json"):
        index_path = os.path.join(folder, entry)
        index = read_json(index_path, "base index")
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise CorruptFileError(f"{index_path}: has no 'weight_map' object; fix or regenerate the index")
        files: list[str] = []
        for shard in wmap.values():
            path = safe_shard_name(folder, shard)
            if path not in files:
                files.append(path)
        missing = [os.path.basename(p) for p in files if not os.path.isfile(p)]
        if missing:
            raise NotFoundError(f"{index_path} names shard(s) that do not exist: {', '.join(missing)}")
        return files, wmap, index_path
    if entry is not None:
        return [os.path.join(folder, entry)], None, index_path
    bins = [n for n in os.listdir(folder) if n.endswith(".bin") and n.startswith("pytorch_model")]
    if bins:
        raise InputError(
            f"base {folder} has only pickle weights ({bins[0]}); convert it to safetensors first, e.g. "
            "AutoModelForCausalLM.from_pretrained(path).save_pretrained(path_out)"
        )
    raise NotFoundError(f"base {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def weights_entry(folder: str, config: dict) -> tuple[str | None, str]:
    """The weights file transformers' ``from_pretrained`` reads in a local folder: ``config.transformers_weights``
    when set, else ``model.safetensors`` when it is a file, else ``model.safetensors.index.json`` (so a folder
    holding both reads the single file and ignores the index, as transformers does).

    Args:
        folder: the checkpoint folder.
        config: its parsed ``config.json``.

    Returns:
        ``(name, "")`` with the file name relative to ``folder``, ``(None, "")`` when there is none, or
        ``(None, problem)`` when ``transformers_weights`` names a file transformers refuses.

    Example:
        >>> weights_entry("/nonexistent", {})
        (None, '')
    """
    explicit = config.get("transformers_weights")
    if explicit is not None:
        where = f"{os.path.join(folder, 'config.json')}: transformers_weights={explicit!r}"
        if not isinstance(explicit, str) or not explicit.endswith((".safetensors", ".safetensors.index.json")):
            return None, f"{where} is neither a .safetensors file nor a .safetensors.index.json; fix config.json"
        root = os.path.abspath(folder)
        target = os.path.abspath(os.path.join(folder, explicit))
        if os.path.commonpath([root, target]) != root:
            return None, f"{where} leads out of the folder; transformers refuses it too"
        if not os.path.isfile(target):
            return None, f"{where} names a file that does not exist"
        return os.path.relpath(target, root), ""
    for name in (SINGLE_FILE, INDEX_FILE):
        if os.path.isfile(os.path.join(folder, name)):
            return name, ""
    return None, ""


def read_json(path: str, what: str) -> dict:
    """Read a JSON file that must hold an object.

    Args:
        path: the file.
        what: what the file is, for messages (``"base config.json"``).

    Returns:
        The parsed object.

    Raises:
        NotFoundError: the file does not exist.
        CorruptFileError: the file is not JSON, or not an object.

    Example:
        >>> read_json("/nonexistent/config.json", "base config.json")
        Traceback (most recent call last):
        ...
        peft_shardmerge.errors.NotFoundError: base config.json not found: /nonexistent/config.json
    """
    if not os.path.isfile(path):
        raise NotFoundError(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptFileError(f"{path}: {what} is not valid JSON ({type(e).__name__})") from e
    if not isinstance(data, dict):
        raise CorruptFileError(f"{path}: {what} is not a JSON object")
    return data
