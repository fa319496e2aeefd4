"""What an adapter's own files say about the base it was trained on: a 4-bit (QLoRA) base, and the model it names."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

#: the line PEFT's model card (the adapter's README.md) puts before the bitsandbytes settings of a quantized base
CARD_PREFIX = "The following `bitsandbytes` quantization config was used during training:"
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass(frozen=True)
class TrainedBase:
    """The quantized base an adapter's files show it was trained on.

    Attributes:
        bits: 4 or 8.
        quant_type: the 4-bit type (``"nf4"`` or ``"fp4"``); "" for 8-bit.
        double_quant: whether the 4-bit base used double quantization.
        evidence: which file says so, as a phrase for the report.
        skip_modules: modules training kept unquantized (``llm_int8_skip_modules``).
    """

    bits: int
    quant_type: str
    double_quant: bool
    evidence: str
    skip_modules: tuple[str, ...] = ()


def _from_settings(settings: dict, evidence: str) -> TrainedBase | None:
    """The quantized base a bitsandbytes ``quantization_config`` describes, or None for any other."""
    if str(settings.get("quant_method", "bitsandbytes")).lower() != "bitsandbytes":
        return None
    if _truthy(settings.get("load_in_4bit", settings.get("_load_in_4bit"))):
        return TrainedBase(
            4,
            str(settings.get("bnb_4bit_quant_type") or "nf4"),
            _truthy(settings.get("bnb_4bit_use_double_quant")),
            evidence,
            _names(settings.get("llm_int8_skip_modules")),
        )
    if _truthy(settings.get("load_in_8bit", settings.get("_load_in_8bit"))):
        return TrainedBase(8, "", False, evidence)
    return None


def _names(value) -> tuple[str, ...]:
    """A list of module names as a config (a JSON list) or PEFT's model card (its Python repr) writes it."""
    if isinstance(value, str):
        import ast

        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return ()
    return tuple(str(v) for v in value) if isinstance(value, (list, tuple)) else ()


def _truthy(value) -> bool:
    """A flag as JSON or a model card writes it (``true``, ``"True"``)."""
    return value is True or str(value).strip().lower() == "true"


def named_config(name: str) -> dict | None:
    """The ``config.json`` of the model an adapter names: a local folder, or a Hub id in the local cache (offline).

    Args:
        name: ``base_model_name_or_path`` of an ``adapter_config.json``.

    Returns:
        The parsed config, or None when it is not available locally.

    Example:
        >>> named_config("/no/such/folder") is None
        True
    """
    path = None
    if name and os.path.isdir(name):
        path = os.path.join(name, "config.json")
    elif name and _HUB_ID.match(name):
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(name, "config.json")
            path = found if isinstance(found, str) else None
        except Exception:  # an unusable cache is the same as no cached copy
            path = None
    try:
        with open(path or "", encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def base_named_by(adapter: str) -> str:
    """The base an adapter names (``base_model_name_or_path`` in its ``adapter_config.json``), for a merge given the
    adapter alone (``peft-shardmerge merge ADAPTER OUT``, as Axolotl and LLaMA-Factory take it): a local folder, or a
    Hub id in the local Hugging Face cache (never downloaded).

    Args:
        adapter: the adapter folder, or a Hub id in the local cache.

    Returns:
        The base, as the adapter names it.

    Raises:
        NotFoundError: the adapter is not found, or the base it names is neither a folder here nor in the cache.
        InputError: the adapter names no base.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = open(os.path.join(folder, "adapter_config.json"), "w").write('{"base_model_name_or_path": null}')
        >>> base_named_by(folder)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        peft_shardmerge.errors.InputError: 1 problem found before writing anything:
          - adapter /... names no base (base_model_name_or_path is empty in its adapter_config.json): ...
    """
    from ..errors import InputError, NotFoundError
    from .base_folder import resolve_folder

    folder = resolve_folder(adapter, what="adapter", must_have=("adapter_config.json",))
    try:
        with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"adapter {folder}: adapter_config.json cannot be read ({e})") from e
    name = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(name, str) or not name:
        raise InputError(
            f"adapter {folder} names no base (base_model_name_or_path is empty in its adapter_config.json): "
            "pass the base too, peft-shardmerge merge BASE ADAPTER OUT"
        )
    if os.path.isdir(name) or named_config(name) is not None:
        return name
    raise NotFoundError(
        f"adapter {folder} was trained on {name} (base_model_name_or_path in its adapter_config.json), which is "
        f"neither a folder here nor a Hub id in the local Hugging Face cache: download it (hf download {name}) or "
        "pass the base folder too, peft-shardmerge merge BASE ADAPTER OUT"
    )


def _card_settings(adapter_folder: str) -> dict:
    """The bitsandbytes settings PEFT's model card lists after :data:`CARD_PREFIX` (``- key: value`` lines)."""
    try:
        with open(os.path.join(adapter_folder, "README.md"), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    if CARD_PREFIX not in lines:
        return {}
    settings = {}
    for line in lines[lines.index(CARD_PREFIX) + 1 :]:
        if not line.strip():
            if settings:
                break
            continue
        if not line.startswith("- ") or ":" not in line:
            break
        key, value = line[2:].split(":", 1)
        settings[key.strip()] = value.strip()
    return settings


def trained_base(adapter_folder: str, adapter_config: dict) -> TrainedBase | None:
    """The quantized base an adapter was trained on, as its own files show it, or None when they show none.

    Two records are read: the ``quantization_config`` in the ``config.json`` of the model the adapter names
    (``base_model_name_or_path``: a pre-quantized checkpoint such as a ``-bnb-4bit`` one, when it is available
    locally), and the bitsandbytes settings PEFT's model card (the adapter's ``README.md``) lists. PEFT 0.21
    writes neither for a 16-bit base loaded with ``load_in_4bit``: such an adapter's files do not say so.

    Args:
        adapter_folder: the adapter folder.
        adapter_config: its parsed ``adapter_config.json``.

    Returns:
        A :class:`TrainedBase`, or None.

    Example:
        >>> trained_base("/no/such/folder", {"base_model_name_or_path": "/no/such/base"}) is None
        True
    """
    name = str(adapter_config.get("base_model_name_or_path") or "")
    config = named_config(name) or {}
    for settings in (config.get("quantization_config"), (config.get("text_config") or {}).get("quantization_config")):
        if isinstance(settings, dict):
            found = _from_settings(
                settings,
                f"the model it names, {name}, is stored quantized by bitsandbytes "
                "(quantization_config in its config.json)",
            )
            if found is not None:
                return found
    card = _card_settings(adapter_folder)
    return (
        _from_settings(card, "its README.md (PEFT's model card) lists the bitsandbytes settings of training")
        if card
        else None
    )


def same_model(named: str, base_argument: str, base_folder: str) -> bool:
    """Whether the base an adapter names (``base_model_name_or_path``) is the base given, as far as names tell:
    the same folder, the same Hub id (or a cached snapshot of it), or folders named alike (a local copy of a Hub
    model, ``/models/Llama-3.2-1B`` for ``meta-llama/Llama-3.2-1B``).

    Args:
        named: the adapter config's ``base_model_name_or_path`` ("" when it names none).
        base_argument: the base as given (a folder or a Hub id).
        base_folder: the folder it resolved to.

    Returns:
        True when they agree, or when the adapter names no base.

    Example:
        >>> same_model("meta-llama/Llama-3.2-1B", "/models/llama-3.2-1b", "/models/llama-3.2-1b")
        True
        >>> same_model("Qwen/Qwen2.5-0.5B", "/models/llama-3.2-1b", "/models/llama-3.2-1b")
        False
    """
    if not named:
        return True
    if os.path.isdir(named) and os.path.realpath(named) == os.path.realpath(base_folder):
        return True
    last = named.rstrip("/").rsplit("/", 1)[-1].lower()
    cached = "models--" + named.replace("/", "--")
    candidates = {
        str(base_argument).rstrip("/").lower(),
        os.path.basename(str(base_argument).rstrip("/")).lower(),
        os.path.basename(base_folder.rstrip("/")).lower(),
    }
    return named.lower() in candidates or last in candidates or cached in base_folder.split(os.sep)


def disk_base_choice(
    requested: str, adapters: list[tuple[str, dict]], stored: str | None = None
) -> tuple[str, dict, str]:
    """What a merge from disk merges into, and what its output reproduces.

    The rule both paths follow: reproduce the trained model. ``"auto"`` (the default) merges into dequant(4-bit(W))
    when an adapter's files show it was trained on a 4-bit base (:func:`trained_base`), with the 4-bit settings
    they record, and into the checkpoint's weights otherwise (a base stored quantized is dequantized either way).

    Args:
        requested: ``"auto"``, ``"original"`` or ``"nf4"``.
        adapters: ``(folder, adapter_config)`` of each adapter merged.
        stored: the quantization the base checkpoint is stored in (``"bitsandbytes 4-bit"``, ...), or None.

    Returns:
        ``(base precision, 4-bit settings for MergeOptions (nf4_quant_type, nf4_double_quant, nf4_skip_modules) or
        {}, reproduces)``.

    Example:
        >>> disk_base_choice("auto", [("/no/adapter", {})])[0]
        'original'
    """
    if stored is not None:
        return (
            ("original" if requested == "auto" else requested),
            {},
            (
                f"the stored {stored} base, dequantized, + adapter (for an adapter trained on this base, the trained "
                f"model)"
            ),
        )
    trained = next((t for t in (trained_base(f, c) for f, c in adapters) if t is not None), None)
    if requested == "nf4":
        return "nf4", {}, "the QLoRA-trained model (dequant(nf4(W)) + adapter)"
    if trained is not None and trained.bits == 4 and requested == "auto":
        return (
            "nf4",
            {
                "nf4_quant_type": trained.quant_type,
                "nf4_double_quant": trained.double_quant,
                "nf4_skip_modules": trained.skip_modules,
            },
            (
                f"the trained model: the base quantized to 4-bit {trained.quant_type} and dequantized, + adapter "
                f"(base precision auto: the adapter was trained on a 4-bit base, {trained.evidence})"
            ),
        )
    if trained is not None and trained.bits == 4:
        return (
            "original",
            {},
            (
                f"the original base + adapter, NOT the trained 4-bit model ({trained.evidence}); base "
                "precision nf4 (or auto) reproduces the trained model"
            ),
        )
    if trained is not None:
        return (
            "original",
            {},
            (
                f"the original base + adapter, not the trained model: the adapter was trained on an "
                f"8-bit base ({trained.evidence}), which a merge from disk does not reproduce "
                "(merge_and_save of the trained model in memory does)"
            ),
        )
    return (
        "original",
        {},
        (
            "the original base + adapter: the trained model for an adapter trained on this base "
            "unquantized (nothing in the adapter's files shows a 4-bit base; for one trained on a "
            "4-bit base (QLoRA), base precision nf4 reproduces the trained model)"
        ),
    )


def base_name_notes(adapters: list[tuple[str, dict]], base_argument: str, base_folder: str) -> list[str]:
    """A note for each adapter whose config names another base model than the one given (the shapes matched).

    Args:
        adapters: ``(folder, adapter_config)`` of each adapter merged.
        base_argument: the base as given.
        base_folder: the folder it resolved to.

    Returns:
        Notes for the report (empty when every adapter names this base, or none).

    Example:
        >>> base_name_notes([("ad", {"base_model_name_or_path": "Qwen/Qwen2.5-0.5B"})], "/m/llama", "/m/llama")[0][:40]
        'the adapter ad was trained on Qwen/Qwen2'
    """
    notes = []
    for folder, config in adapters:
        named = str(config.get("base_model_name_or_path") or "")
        if not same_model(named, base_argument, base_folder):
            notes.append(
                f"the adapter {folder} was trained on {named} (base_model_name_or_path in its "
                f"adapter_config.json), but the base given is {base_folder}: their shapes match, so it was "
                "merged; check that this is the model the adapter was trained on"
            )
    return notes
