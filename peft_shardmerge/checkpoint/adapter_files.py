"""An adapter folder's files: the config checks and the tensors of ``adapter_model.safetensors`` (or ``.bin``)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from ..engine.maths import one_cpu_thread
from ..errors import InputError, NotFoundError
from ..io.safetensors_io import FLOAT_DTYPES, RowReader, TensorInfo, read_header, row_blocks
from ..options import DEFAULT_CHUNK_ELEMS
from ..support.claims import DISK, check_config, raise_if_any
from ..support.peft_reading import positive_number
from .peft_deltas import DELTA_TYPES

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"


@dataclass
class AdapterTensor:
    """One tensor of the adapter, in a safetensors file."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    info: TensorInfo | None
    data: torch.Tensor | None = None

    def load(self, reader: RowReader) -> torch.Tensor:
        """Return the tensor's data as a fresh copy (from the file, or from ``data`` for a computed tensor)."""
        if self.data is not None:
            return self.data.clone()
        return reader.read(self.info)


@dataclass
class TokenRows:
    """Trainable tokens of one embedding-like module: whole new rows (not deltas) for some token ids.

    Attributes:
        path: the module's name in the base model, e.g. ``model.embed_tokens``.
        indices: the token ids, in the order of the rows of ``rows``.
        rows: ``trainable_tokens_delta``, ``[len(indices), dim]``: the trained rows that replace the base's.
        key: a name unique within the spec.
    """

    path: str
    indices: list[int]
    rows: AdapterTensor
    key: str = ""

    def __post_init__(self) -> None:
        self.key = self.key or f"tokens:{self.path}"


def token_indices(config: dict, path: str) -> list[int] | None:
    """The token ids of the trainable-token rows saved for module ``path``, from the adapter config.

    ``trainable_token_indices`` is a list (for the input embedding) or ``{module name: ids}``; a standalone
    trainable-tokens adapter has ``token_indices``.

    Args:
        config: the adapter config.
        path: the module's name.

    Returns:
        The ids, or None when the config gives none (or not a list of ints) for ``path``.

    Example:
        >>> token_indices({"trainable_token_indices": {"embed_tokens": [1, 2]}}, "model.embed_tokens")
        [1, 2]
    """
    given = config.get("trainable_token_indices")
    if config.get("peft_type") == "TRAINABLE_TOKENS":
        given = config.get("token_indices")
    if isinstance(given, dict):
        for name, ids in given.items():
            if path == name or path.endswith("." + name):
                given = ids
                break
        else:
            return None
    if not isinstance(given, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in given):
        return None
    return list(given)


def pattern_key(pattern: dict, path: str) -> str | None:
    """The key of ``rank_pattern``/``alpha_pattern`` that applies to ``path``, as PEFT matches it.

    Args:
        pattern: the pattern dict.
        path: the module's name.

    Returns:
        The key, or None.

    Example:
        >>> pattern_key({"q_proj": 4}, "model.layers.0.self_attn.q_proj")
        'q_proj'
    """
    if not pattern:
        return None
    from peft.utils.other import get_pattern_key

    key = get_pattern_key(list(pattern.keys()), path)
    return key if key in pattern else None


TOKENS_SUFFIXES = (".token_adapter.trainable_tokens_delta", ".trainable_tokens_delta")


def add_token_rows(spec, name: str, key: str, t: AdapterTensor, problems: list[str]) -> None:
    """Record an adapter's trainable-token rows for their module (``spec.tokens``), or the problem with them in
    ``problems``; ``key`` is the stored ``name`` without PEFT's prefix."""
    path = key.removesuffix(".trainable_tokens_delta").removesuffix(".token_adapter")
    indices = token_indices(spec.config, path)
    if indices is None:
        problems.append(
            f"adapter tensor {name!r} holds trainable tokens but adapter_config.json gives no "
            f"token indices for {path!r}"
        )
    elif len(t.shape) != 2 or t.shape[0] != len(indices):
        problems.append(f"adapter tensor {name!r} has shape {list(t.shape)} but {len(indices)} token indices")
    else:
        spec.tokens[path] = TokenRows(path, indices, t)


def check_adapter_config(config: dict, folder: str) -> None:
    """Check ``adapter_config.json``: the allowlist, then ``r``, ``lora_alpha`` and the rank/alpha patterns.

    Args:
        config: the parsed config.
        folder: the adapter folder, for messages.

    Returns:
        None.

    Raises:
        UnsupportedError: the allowlist refuses the adapter type or an option.
        InputError: fields missing or of the wrong type, all named.

    Example:
        >>> try:
        ...     check_adapter_config({"peft_type": "LORA", "r": 0, "lora_alpha": 16}, "a")
        ... except InputError as e:
        ...     print(e.problems)
        ["adapter_config.json 'r' must be a positive finite number, got 0"]
    """
    raise_if_any(check_config(config, where=f"adapter {folder}", path=DISK))  # the allowlist (support.py)
    if config.get("peft_type") in ("TRAINABLE_TOKENS", *DELTA_TYPES):
        return
    problems = []
    for key in ("r", "lora_alpha"):
        if key not in config:
            problems.append(f"adapter_config.json lacks {key!r}")
        elif not positive_number(config[key], integer=key == "r"):
            problems.append(f"adapter_config.json {key!r} must be a positive finite number, got {config[key]!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            problems.append(f"adapter_config.json {key!r} must be an object, got {type(pattern).__name__}")
            continue
        for k, v in pattern.items():
            if key == "rank_pattern" and not positive_number(v, integer=True):
                problems.append(f"adapter_config.json rank_pattern[{k!r}] must be a positive int, got {v!r}")
            if key == "alpha_pattern" and not positive_number(v):
                problems.append(
                    f"adapter_config.json alpha_pattern[{k!r}] must be a positive finite number, got {v!r}"
                )
            try:
                re.compile(rf"(.*\.)?({k})$")
            except re.error as e:
                problems.append(f"adapter_config.json {key} key {k!r} is not a valid pattern ({e})")
    if problems:
        raise InputError(problems)


def read_adapter_tensors(folder: str, path: str) -> dict[str, AdapterTensor]:
    """Describe the tensors of an adapter's safetensors file and check that every weight is finite.

    Args:
        folder: the adapter folder, for messages.
        path: its ``adapter_model.safetensors`` (or the conversion of a legacy ``adapter_model.bin``).

    Returns:
        The tensors by stored name.

    Raises:
        NotFoundError: the file does not exist.
        CorruptFileError: the file is malformed.
        InputError: a weight is NaN or Inf.
    """
    if not os.path.isfile(path):
        raise NotFoundError(f"adapter {folder} has neither {ADAPTER_WEIGHTS} nor {ADAPTER_BIN}")
    infos, _ = read_header(path)
    out = {i.name: AdapterTensor(i.name, i.shape, i.dtype, info=i) for i in infos}
    _check_finite_files(out)
    return out


def _check_finite_files(tensors: dict[str, AdapterTensor]) -> None:
    """Every float weight finite, read block by block and checked on one torch thread: the tensors are small, and
    a pool of threads would be woken for each of hundreds of tiny ops."""
    bad = []
    with RowReader() as reader, one_cpu_thread(torch.device("cpu")):
        for name, t in tensors.items():
            if t.dtype not in FLOAT_DTYPES:
                continue
            for start, stop in row_blocks(t.shape, DEFAULT_CHUNK_ELEMS):
                if not torch.isfinite(reader.read_rows(t.info, start, stop)).all():
                    bad.append(name)
                    break
    if bad:
        raise InputError(f"adapter weights contain NaN or Inf: {', '.join(bad[:5])}; the training diverged")
