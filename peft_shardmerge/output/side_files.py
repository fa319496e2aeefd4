"""The base folder's files other than its weights (tokenizer, pipeline, README, ...): which are carried into the
output, and the copy that never follows a link out of the base folder."""

from __future__ import annotations

import logging
import os
import re
import shutil

log = logging.getLogger(__name__)

#: weight files and exports of the base model: the merge writes its own weights, so these are never copied
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".gguf",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".ot",
    ".onnx_data",
    ".pdparams",
    ".npz",
)
#: index files of sharded weights (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``, ...)
_INDEX = re.compile(r".*\.(safetensors|bin|pt|pth|h5|msgpack)\.index\.json$")
#: files that describe a quantization of the base, not the merged model
QUANTIZATION_FILES = ("quantize_config.json", "quant_config.json", "quantization_config.json")
#: folders holding exports of the base's weights in other runtimes (stale once the adapter is merged)
EXPORT_FOLDERS = ("onnx", "openvino")
#: files the merge writes itself: a base file of the same name at the top of the folder is not copied
WRITTEN = ("config.json", "merge_manifest.json", "manifest.json", "manifest.json.tmp")
#: the Hub cache keeps a snapshot's files as links into the repository's ``blobs`` folder
_HUB_SNAPSHOT = re.compile(r"^(?P<repo>.*)/snapshots/[^/]+$")
#: what belongs to a model folder besides its weights and ``config.json``, at its top (an allowlist: anything else,
#: an adapter's files, other weight formats, training state, notes, is never carried into the output)
MODEL_FILES = re.compile(
    r"""(
    generation_config\.json
  | (preprocessor|processor|image_processor|video_preprocessor|feature_extractor)_config\.json
  | tokenizer(_config)?\.json | special_tokens_map\.json | added_tokens\.json | tokenizer\.model(\.[\w-]+)?
  | [\w.-]+\.model | (source|target)\.spm | [\w.-]+\.tiktoken | tekken\.json | bpe\.codes
  | vocab\.(json|txt) | merges\.txt | chat_template\.(jinja|json)
  | modules\.json | sentence_bert_config\.json | config_sentence_transformers\.json
  | [\w.-]+\.py
  | readme(\.md)? | (licen[cs]e|notice|copying)([.-][\w.-]*)? | use_policy\.md
)""",
    re.VERBOSE | re.IGNORECASE,
)
#: folders that belong to a model folder: transformers' extra chat templates
MODEL_FOLDERS = ("additional_chat_templates",)
#: sentence-transformers' module folders (``1_Pooling``, ``2_Dense``), carried whole when ``modules.json`` is there
_MODULE_FOLDER = re.compile(r"\d+_\w+")


def is_weight_file(name: str) -> bool:
    """Whether a file name is a weight file or a weight index (never carried into the output).

    Args:
        name: a file name (or a path; only its last part is looked at).

    Returns:
        True for ``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf`` (and other weight formats) and
        their ``*.index.json`` files.

    Example:
        >>> is_weight_file("model-00001-of-00002.safetensors"), is_weight_file("tokenizer.json")
        (True, False)
        >>> is_weight_file("pytorch_model.bin.index.json")
        True
    """
    base = os.path.basename(name)
    return base.lower().endswith(WEIGHT_SUFFIXES) or bool(_INDEX.match(base))


def _pipeline_folders(folder: str) -> set[str]:
    """Sub-folders a sentence-transformers ``modules.json`` names as modules, and the numbered ones beside it
    (``1_Pooling``): their own weights belong to the pipeline (a ``2_Dense`` layer), which the adapter does not
    change, so they are carried over whole."""
    import json

    if not os.path.isfile(os.path.join(folder, "modules.json")):
        return set()
    out = {d for d in _listdir(folder) if _MODULE_FOLDER.fullmatch(d)}
    try:
        with open(os.path.join(folder, "modules.json"), encoding="utf-8") as f:
            modules = json.load(f)
    except (OSError, ValueError):
        return out
    for m in modules if isinstance(modules, list) else []:
        path = m.get("path") if isinstance(m, dict) else None
        if isinstance(path, str) and path and not os.path.isabs(path) and ".." not in path.split("/"):
            out.add(os.path.normpath(path))
    return out


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def is_adapter_card(path: str) -> bool:
    """Whether a README is a PEFT adapter's model card (its front matter says ``library_name: peft``), which
    describes the adapter, not the merged model: it is never carried as the model's README.

    Args:
        path: a README file.

    Returns:
        True for a card PEFT's ``save_pretrained`` wrote (or any card whose metadata names the peft library).

    Example:
        >>> import tempfile
        >>> card = os.path.join(tempfile.mkdtemp(), "README.md")
        >>> _ = open(card, "w").write("---\\nbase_model: org/base\\nlibrary_name: peft\\n---\\n# Model Card\\n")
        >>> is_adapter_card(card), is_adapter_card("/nonexistent/README.md")
        (True, False)
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(16384)
    except OSError:
        return False
    lines = head.lstrip("\ufeff").splitlines()
    if not lines or lines[0].strip() != "---":
        return False
    for line in lines[1:]:
        if line.strip() == "---":
            break
        if re.fullmatch(r"\s*library_name\s*:\s*['\"]?peft['\"]?\s*", line, re.IGNORECASE):
            return True
    return False


def _allowed_roots(folder: str) -> list[str]:
    """Where a link inside ``folder`` may point: the folder itself, and for a Hub cache snapshot its repository's
    ``blobs`` folder (the cache stores every file of a snapshot as such a link)."""
    real = os.path.realpath(folder)
    roots = [real]
    m = _HUB_SNAPSHOT.match(real)
    if m:
        roots.append(os.path.join(m.group("repo"), "blobs"))
    return roots


def _inside(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r + os.sep) for r in roots)


def list_side_files(folder: str) -> list[str]:
    """The files of a base folder that belong to a model folder and are carried into the merged output, as paths
    relative to ``folder``.

    An allowlist (:data:`MODEL_FILES`): at the top, the generation, processor and tokenizer files, chat templates
    (and ``additional_chat_templates/``), sentence-transformers' ``modules.json``, ``sentence_bert_config.json`` and
    ``config_sentence_transformers.json``, sentencepiece models (``*.model``), a model's own code (every top-level
    ``*.py``: remote code imports its helpers), README and license files;
    sentence-transformers module folders (named by ``modules.json``, or numbered like ``1_Pooling`` beside it) whole,
    their own weights included. Never: ``config.json`` (the merge writes its own), an adapter's files
    (``adapter_config.json``, ``adapter_model.*``), other weights and their indexes, training state
    (``optimizer.pt``, ``trainer_state.json``, ...), anything else, hidden files, a README that is a PEFT adapter
    card (:func:`is_adapter_card`), anything that is not a regular file, and every link that leads out of the folder
    (for a Hub cache snapshot: out of its repository's ``blobs``).

    Args:
        folder: the base folder.

    Returns:
        Relative paths (``/``-separated), sorted; an unreadable folder is skipped, never raised on.

    Example:
        >>> import tempfile
        >>> base = tempfile.mkdtemp()
        >>> for name in ("tokenizer.json", "adapter_config.json", "optimizer.pt", "config.json", "notes.txt"):
        ...     _ = open(os.path.join(base, name), "w").write("{}")
        >>> list_side_files(base)
        ['tokenizer.json']
    """
    roots = _allowed_roots(folder)
    pipeline = _pipeline_folders(folder)
    out: list[str] = []
    skipped: list[str] = []

    def whole(rel: str) -> bool:  # a folder all of whose files are carried
        return rel in MODEL_FOLDERS or any(rel == p or rel.startswith(p + os.sep) for p in pipeline)

    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        rel_dir = os.path.relpath(dirpath, folder)
        rel_dir = "" if rel_dir == "." else rel_dir
        keep_dirs = []
        for d in sorted(dirnames):
            p = os.path.join(dirpath, d)
            rel = os.path.join(rel_dir, d)
            if d.startswith(".") or not (whole(rel) or any(q.startswith(rel + os.sep) for q in pipeline)):
                continue
            if os.path.islink(p):  # os.walk does not descend into links: a link to a folder inside is listed here
                if _inside(p, roots) and os.path.isdir(p) and whole(rel):
                    out += [os.path.join(rel, r) for r in _all_files(p) if _inside(os.path.join(p, r), roots)]
                else:
                    skipped.append(rel)
                continue
            keep_dirs.append(d)
        dirnames[:] = keep_dirs
        in_pipeline = any(rel_dir == p or rel_dir.startswith(p + os.sep) for p in pipeline)
        for name in sorted(filenames):
            p = os.path.join(dirpath, name)
            rel = os.path.join(rel_dir, name)
            if name.startswith("."):
                continue
            if not rel_dir:
                if name in WRITTEN or not MODEL_FILES.fullmatch(name):
                    continue
                if name.lower().startswith("readme") and is_adapter_card(p):
                    log.info("not copied from %s: %s is a PEFT adapter's model card, not the model's", folder, name)
                    continue
            elif not whole(rel_dir) or (is_weight_file(name) and not in_pipeline):
                continue
            if not _inside(p, roots) or not os.path.isfile(p):
                skipped.append(rel)
                continue
            out.append(rel)
    if skipped:
        log.warning(
            "not copied from %s (links leading out of the folder, or not regular files): %s",
            folder,
            ", ".join(sorted(skipped)[:10]),
        )
    return sorted(p.replace(os.sep, "/") for p in out)


def _all_files(folder: str) -> list[str]:
    """Every regular, non-hidden file under ``folder`` (links to files included), relative to it."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [
            os.path.relpath(os.path.join(dirpath, n), folder)
            for n in filenames
            if not n.startswith(".") and os.path.isfile(os.path.join(dirpath, n))
        ]
    return sorted(found)


def copy_side_files(
    folder: str, dest: str, names: list[str] | None = None, *, skip: tuple[str, ...] = ()
) -> list[str]:
    """Copy a base folder's side files (:func:`list_side_files`) into ``dest``, sub-folders included.

    Contents are copied (never links); a file whose path leaves ``folder`` when resolved is not read.

    Args:
        folder: the base folder.
        dest: the output (staging) folder.
        names: the relative paths to copy (default: :func:`list_side_files` of ``folder``).
        skip: top-level names not to copy (e.g. the base's tokenizer files when another tokenizer replaces them).

    Returns:
        The relative paths copied.

    Raises:
        OSError: a file could not be read or written.

    Example:
        >>> import tempfile
        >>> base, staging = tempfile.mkdtemp(), tempfile.mkdtemp()
        >>> for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        ...     _ = open(os.path.join(base, name), "w").write("{}")
        >>> copy_side_files(base, staging)
        ['README.md', 'tokenizer.json']
        >>> sorted(os.listdir(staging))
        ['README.md', 'tokenizer.json']
    """
    roots = _allowed_roots(folder)
    copied = []
    for rel in list_side_files(folder) if names is None else names:
        if rel in skip:
            continue
        src = os.path.join(folder, rel)
        if not _inside(src, roots):  # checked again at copy time: the folder may have changed since the listing
            log.warning("not copied: %s leads out of %s", rel, folder)
            continue
        dst = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(os.path.realpath(src), dst)
        copied.append(rel)
    return copied


def candidate_folders(name: str) -> list[str]:
    """The folders that may hold the checkpoint named ``name``: the folder itself, or for a Hub id every
    snapshot in the local cache, the one ``refs/main`` points at first.

    transformers does not record the revision a model was loaded from, so every cached revision is a
    candidate and the tensors decide (:func:`find_original`).

    Args:
        name: ``config._name_or_path``: a folder or a Hub id.

    Returns:
        Folder paths (possibly none).

    Example:
        >>> candidate_folders("/no/such/folder")
        []
    """
    if os.path.isdir(name):
        return [os.path.abspath(name)]
    if not name or name.count("/") != 1 or name.startswith((".", "/", "~")):
        return []
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:  # pragma: no cover - a dependency of transformers
        return []
    folders = []
    try:
        folders.append(snapshot_download(name, local_files_only=True))
    except Exception:  # not cached at refs/main; other revisions may be
        pass
    snapshots = os.path.join(HF_HUB_CACHE, "models--" + name.replace("/", "--"), "snapshots")
    if os.path.isdir(snapshots):
        others = sorted(
            (os.path.join(snapshots, s) for s in os.listdir(snapshots)), key=os.path.getmtime, reverse=True
        )
        folders += [f for f in others if os.path.realpath(f) not in {os.path.realpath(x) for x in folders}]
    return folders


def copy_base_side_files(name_or_path: str, dest: str, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Carry the side files of the folder a model was loaded from (``config._name_or_path``: a local folder, or a
    Hub id whose ``refs/main`` snapshot is in the local cache) into ``dest``, as the disk path does
    (:func:`~peft_shardmerge.output.side_files.list_side_files`).

    Args:
        name_or_path: the model's ``config._name_or_path``.
        dest: the output (staging) folder.
        skip: top-level names not to copy.

    Returns:
        The relative paths copied; empty when the folder cannot be found (nothing is downloaded).

    Raises:
        OSError: a file could not be read or written.

    Example:
        >>> copy_base_side_files("", "/tmp/out")
        []
    """
    folders = candidate_folders(name_or_path) if name_or_path else []
    first = folders[0] if folders and (os.path.isdir(name_or_path) or _at_main(name_or_path, folders[0])) else None
    if first is None or not os.path.isfile(os.path.join(first, "config.json")):
        return []
    return copy_side_files(first, dest, skip=skip)


def _at_main(repo_id: str, folder: str) -> bool:
    """Whether ``folder`` is the cached snapshot ``refs/main`` of ``repo_id`` points at (the one loading takes)."""
    try:
        from huggingface_hub import snapshot_download

        return os.path.realpath(snapshot_download(repo_id, local_files_only=True)) == os.path.realpath(folder)
    except Exception:  # not cached at refs/main
        return False
