"""What peft-shardmerge merges: the one check of the allowlist (PEFT type x layer x variant x path, the data in
:mod:`peft_shardmerge.support.allowlist`) that every API runs before anything is committed or any module replaced."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from torch import nn

from ..errors import InputError, UnsupportedError
from .allowlist import (  # noqa: F401 - ADAPTER, CLAIMS, DISK, PATHS, PEFT_TYPES: public here too
    ADAPTER,
    CLAIMS,
    DISK,
    HANDLED,
    IN_PROCESS,
    INERT,
    INSTEAD,
    PATHS,
    PEFT_TYPES,
    PLAIN_INITS,
    PROMPT_TYPES,
    REFUSED,
    RESIDUAL_INITS,
    SPEC,
)


def is_claimed(peft_type: str, layer: str, variant: str = "plain", path: str = IN_PROCESS) -> bool:
    """Whether one combination is in the allowlist.

    Args:
        peft_type: PEFT's type name, e.g. ``"LORA"``.
        layer: a layer kind from :func:`layer_kind` (``"Linear"``, ``"Conv1D"``, ``"parameter 3-D"``, ...) or
            ``"(adapter)"`` for adapter-wide options.
        variant: ``"plain"``, ``"DoRA"``, ``"rsLoRA"``, ``"lora_bias"``, ...
        path: ``"disk"`` (merge_checkpoint) or ``"in_process"`` (merge_and_save, merge_and_unload, ...).

    Returns:
        True when claimed (and tested).

    Example:
        >>> is_claimed("LORA", "Linear", "DoRA", "disk"), is_claimed("OFT", "Linear")
        (True, False)
    """
    return (peft_type, layer, variant, path) in CLAIMS


def support_table(doc: str | None = None) -> str:
    """The "What is supported" table, generated from the allowlist: the README's (every row, with links), or the
    rows one ``docs/`` page details (without links).

    Args:
        doc: a page of ``docs/`` (``"variants-layers.md"``); None for the README's table.

    Returns:
        Markdown: one row per PEFT type and group of layers, with the variants and the paths that merge them.

    Example:
        >>> support_table().splitlines()[0]
        '| PEFT type | layers | variants | paths | details |'
        >>> support_table("variants-dora.md").splitlines()[0]
        '| PEFT type | layers | variants | paths |'
    """
    names = {DISK: "disk", IN_PROCESS: "in process"}
    head = (
        ["| PEFT type | layers | variants | paths | details |", "|---|---|---|---|---|"]
        if doc is None
        else ["| PEFT type | layers | variants | paths |", "|---|---|---|---|"]
    )
    rows = []
    for peft_type, layers, variants, paths, page in SPEC:
        if doc is not None and page != doc:
            continue
        shown = [v for v in variants if v != "plain"]
        layer_text = "adapter options" if layers == (ADAPTER,) else ", ".join(f"`{x}`" for x in layers)
        row = f"| {peft_type} | {layer_text} | {', '.join(shown) or '—'} | {' and '.join(names[p] for p in paths)} |"
        rows.append(row + (f" [docs/{page}](docs/{page}) |" if doc is None else ""))
    return "\n".join(head + rows)


def layer_kind(module: nn.Module) -> str:
    """The allowlist's name for the kind of a base layer.

    Args:
        module: a base layer (what a PEFT layer wraps), or PEFT's ``ParamWrapper``.

    Returns:
        ``"Linear"``, ``"Conv1D"`` (transformers), ``"Embedding"``, ``"Conv2d"``, ``"Conv2d (groups=4)"``,
        ``"MultiheadAttention"``, ``"Linear4bit"``, ``"parameter 3-D"`` (``target_parameters``), or the class name.

    Example:
        >>> layer_kind(nn.Conv2d(4, 4, 3, groups=2)), layer_kind(nn.Linear(2, 2))
        ('Conv2d (groups=2)', 'Linear')
    """
    name = type(module).__name__
    if name == "ParamWrapper":
        return f"parameter {module.get_param().dim()}-D"
    if name in ("Linear4bit", "Linear8bitLt"):
        return name
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        Conv1D = ()
    if Conv1D and isinstance(module, Conv1D):
        return "Conv1D"
    if isinstance(module, nn.MultiheadAttention):
        return "MultiheadAttention"
    for cls in (nn.Linear, nn.Embedding):
        if isinstance(module, cls):
            return cls.__name__
    for cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        if isinstance(module, cls):
            return cls.__name__ if module.groups == 1 else f"{cls.__name__} (groups={module.groups})"
    return name


def _as_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return dict(vars(config))


def peft_type_of(config: Any) -> str:
    """A PEFT config's type as a string (``"LORA"``), from a ``PeftConfig`` or an ``adapter_config.json`` dict.

    Args:
        config: the config.

    Returns:
        The type name, "" when the config has none.

    Example:
        >>> peft_type_of({"peft_type": "LORA"})
        'LORA'
    """
    value = _as_dict(config).get("peft_type")
    return str(getattr(value, "value", value) or "")


def residual_init(init: object) -> bool:
    """Whether ``init_lora_weights`` rewrote the base in memory (PiSSA, OLoRA, CorDA, LoftQ).

    Args:
        init: the ``init_lora_weights`` value.

    Returns:
        True for those methods.

    Example:
        >>> residual_init("pissa_niter_4"), residual_init(True)
        (True, False)
    """
    return isinstance(init, str) and init.lower().startswith(RESIDUAL_INITS)


def config_variants(config: Any) -> tuple[list[str], list[str]]:
    """The variants a config asks for: ``(per-layer variants, adapter-wide variants)``.

    Args:
        config: a ``PeftConfig`` or an ``adapter_config.json`` dict.

    Returns:
        Two lists of allowlist variant names.

    Example:
        >>> config_variants({"peft_type": "LORA", "use_rslora": True, "modules_to_save": ["lm_head"]})
        (['rsLoRA'], ['modules_to_save'])
    """
    c = _as_dict(config)
    layer, adapter = [], []
    if c.get("use_rslora"):
        layer.append("rsLoRA")
    if c.get("rank_pattern") or c.get("alpha_pattern"):
        layer.append("rank/alpha pattern")
    if c.get("modules_to_save"):
        adapter.append("modules_to_save")
    if c.get("bias") not in (None, "none"):
        adapter.append("bias='all'/'lora_only'")
    if c.get("trainable_token_indices"):
        adapter.append("trainable_token_indices")
    if residual_init(c.get("init_lora_weights")):
        adapter.append("residual init (PiSSA, OLoRA, CorDA, LoftQ)")
    if peft_type_of(c) == "VERA" and not c.get("save_projection", True):
        adapter.append("projections not saved")
    return layer, adapter


def check_config(config: Any, *, where: str, path: str) -> list[str]:
    """Every reason the allowlist refuses one adapter's config on one path: an unclaimed PEFT type, a field that
    changes the forward and that no path merges, a field of PEFT's config class that this version has not
    classified set to a non-default value (keys PEFT's class does not have are ignored, as PEFT ignores them), an
    unclaimed ``init_lora_weights`` or adapter-wide variant.

    Args:
        config: a ``PeftConfig`` or an ``adapter_config.json`` dict.
        where: how to name the adapter in messages (its folder or ``adapter 'default'``).
        path: ``"disk"`` or ``"in_process"``.

    Returns:
        The problems (empty when supported).

    Example:
        >>> check_config({"peft_type": "OFT"}, where="adapter x", path="disk")[0][:60]
        "adapter x has peft_type='OFT'; the disk engine merges LORA, "
    """
    c = _as_dict(config)
    peft_type = peft_type_of(c)
    if peft_type not in PEFT_TYPES:
        why = (
            "it has no weight delta (it adds virtual tokens or prefixes), so there is nothing to merge into a "
            "checkpoint; serve it with PEFT"
            if peft_type in PROMPT_TYPES
            else INSTEAD
        )
        engine = "disk engine" if path == DISK else "in-process merge"
        return [
            f"{where} has peft_type={peft_type or None!r}; the {engine} merges {', '.join(PEFT_TYPES)} "
            f"adapters only. {why[0].upper() + why[1:]}"
        ]
    problems = [f"{where}: {msg} ({key}={c[key]!r})" for key, msg in REFUSED.items() if c.get(key)]
    handled = HANDLED[peft_type] | INERT
    unknown = sorted(
        k for k, v in c.items() if k not in handled and k not in REFUSED and v not in (None, False, "", [], {}, 0)
    )
    if unknown:  # PEFT ignores (with a warning) the keys its config class does not have: ask it only then
        own = _peft_fields(peft_type)
        unknown = [k for k in unknown if own is None or k in own]
    if unknown:
        problems.append(
            f"{where}: {peft_type} config option(s) {', '.join(f'{k}={c[k]!r}' for k in unknown)} are not "
            f"supported (this version does not know how they change the model); {INSTEAD}"
        )
    init = c.get("init_lora_weights", True)
    if peft_type == "LORA" and not residual_init(init) and not any(init is x or init == x for x in PLAIN_INITS):
        problems.append(f"{where}: init_lora_weights={init!r} is not supported; {INSTEAD}")
    if peft_type in ("LORA", "VERA") and c.get("bias") not in (None, "none", "all", "lora_only"):
        problems.append(f"{where}: bias={c.get('bias')!r} is not one of 'none', 'all', 'lora_only'")
    if peft_type == "VERA" and c.get("bias") not in (None, "none"):
        problems.append(f"{where}: VeRA with bias={c.get('bias')!r} is not supported; {INSTEAD}")
    _, adapter_wide = config_variants(c)
    if path == DISK and residual_init(init):
        adapter_wide.remove("residual init (PiSSA, OLoRA, CorDA, LoftQ)")
        problems.append(
            f"{where}: init_lora_weights={init!r} trains against a residual base (W minus the initial "
            "LoRA), not the checkpoint's W; save the adapter with save_pretrained(..., "
            "path_initial_model_for_weight_conversion=...) to convert it to a plain LoRA first, or merge "
            "the model in process with merge_and_save"
        )
    # "several adapters" is checked per layer (a layer holding several of the merged adapters) and where adapters
    # are combined (their own messages: DoRA and IA3 cannot be weighted, the disk engine combines LoRA only)
    for variant in adapter_wide:
        if not is_claimed(peft_type, ADAPTER, variant, path):
            problems.append(_variant_problem(where, peft_type, ADAPTER, variant, path))
    return problems


def _peft_fields(peft_type: str) -> set[str] | None:
    """The fields of PEFT's config class for a type (None when PEFT does not know the type)."""
    try:
        from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
    except ImportError:  # pragma: no cover - peft is a dependency
        return None
    cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(peft_type)
    return {f.name for f in dataclasses.fields(cls)} if cls is not None and dataclasses.is_dataclass(cls) else None


def _variant_problem(where: str, peft_type: str, layer: str, variant: str, path: str) -> str:
    other = IN_PROCESS if path == DISK else DISK
    on = "" if layer == ADAPTER else f" on {layer}"
    if is_claimed(peft_type, layer, variant, other):
        fix = (
            "merge it in process with peft_shardmerge.merge_and_save / merge_and_unload"
            if path == DISK
            else "save the adapter and merge it from disk with peft_shardmerge.merge_checkpoint"
        )
        return f"{where}: {peft_type} {variant}{on} is supported only {other.replace('_', ' ')}; {fix}"
    if variant == "plain":
        layers = sorted({x for t, x, v, p in CLAIMS if t == peft_type and p == path and x != ADAPTER})
        return f"{where}: {peft_type} on a {layer} layer is not supported (supported: {', '.join(layers)}); {INSTEAD}"
    return f"{where}: {peft_type} {variant}{on} is not supported; {INSTEAD}"


def check_layers(uses: Iterable[tuple[str, str, str, Iterable[str]]], *, path: str) -> list[str]:
    """Every reason the allowlist refuses some adapted layers, one line per kind of refusal with the layers named.

    Args:
        uses: ``(layer name, PEFT type, layer kind, variants)`` for each adapted layer.
        path: ``"disk"`` or ``"in_process"``.

    Returns:
        The problems (empty when every layer is supported).

    Example:
        >>> check_layers([("attn", "LORA", "MultiheadAttention", [])], path="in_process")[0][:45]
        'attn: LORA on a MultiheadAttention layer is n'
    """
    grouped: dict[str, list[str]] = {}
    for name, peft_type, kind, variants in uses:
        for variant in ("plain", *variants):
            if not is_claimed(peft_type, kind, variant, path):
                grouped.setdefault(_variant_problem("{names}", peft_type, kind, variant, path), []).append(name)
                break
    out = []
    for message, names in grouped.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        out.append(message.replace("{names}", shown, 1))
    return out


def check_supported(
    configs: Mapping[str, Any], layers: Iterable[tuple[str, str, str, Iterable[str]]] = (), *, path: str
) -> list[str]:
    """The allowlist's one check: every refusal for some adapters' configs and the layers they change.

    Args:
        configs: adapter name (or folder) -> ``PeftConfig`` or ``adapter_config.json`` dict.
        layers: ``(layer name, PEFT type, layer kind, variants)`` for each adapted layer (see :func:`check_layers`).
        path: ``"disk"`` or ``"in_process"``.

    Returns:
        The problems, each naming what is refused, where, and what to do instead (empty when all is claimed).

    Example:
        >>> check_supported({"a": {"peft_type": "LORA", "r": 8, "lora_alpha": 16}},
        ...                 [("q_proj", "LORA", "Linear", ["DoRA"])], path="disk")
        []
    """
    problems = [p for name, c in configs.items() for p in check_config(c, where=f"adapter {name!r}", path=path)]
    return problems + check_layers(layers, path=path)


def raise_if_any(unsupported: list[str], bad: list[str] | None = None) -> None:
    """Raise the refusals: :class:`UnsupportedError` when anything is unsupported, else :class:`InputError` for
    bad input, else nothing.

    Args:
        unsupported: allowlist refusals.
        bad: other problems with the inputs (non-finite adapter weights, ...).

    Returns:
        None.

    Raises:
        UnsupportedError: ``unsupported`` is not empty (every problem in the message).
        InputError: only ``bad`` problems.

    Example:
        >>> raise_if_any([], [])
    """
    if unsupported:
        lines = unsupported + list(bad or [])
        raise UnsupportedError(
            f"{len(lines)} problem{'s' if len(lines) != 1 else ''} found before writing "
            "anything (see README 'What is supported'):\n" + "\n".join(f"  - {p}" for p in lines)
        )
    if bad:
        raise InputError(bad)


__all__ = [
    "CLAIMS",
    "PEFT_TYPES",
    "DISK",
    "IN_PROCESS",
    "ADAPTER",
    "is_claimed",
    "support_table",
    "layer_kind",
    "peft_type_of",
    "residual_init",
    "config_variants",
    "check_config",
    "check_layers",
    "check_supported",
    "raise_if_any",
]
