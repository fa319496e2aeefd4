"""How PEFT reads an adapter folder, asked of PEFT itself: which stored keys it loads for adapter "default", which
numbers in a config are usable, and which stored tensors can take a delta."""

from __future__ import annotations

import logging
import math
import re

log = logging.getLogger(__name__)

PREFIX = "base_model.model."
#: the adapter name PEFT loads a folder under (``PeftModel.from_pretrained``'s default)
ADAPTER = "default"
#: stored dtypes a delta can be added to and written back without truncation
MERGEABLE_DTYPES = ("F64", "F32", "F16", "BF16")
#: a LoRA tensor key with an adapter name inside (``...lora_A.<name>.weight``), as some tools save several adapters
_NAMED = re.compile(
    r"\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"\.(?P<name>(?!weight$|bias$)[^.]+)(?:\.(?:weight|bias))?$"
)


def positive_number(value: object, *, integer: bool = False) -> bool:
    """Whether ``value`` is a positive, finite number (a JSON ``NaN`` or ``Infinity`` is not; neither is a bool).

    Args:
        value: the value read from a config.
        integer: require an int.

    Returns:
        True when usable.

    Example:
        >>> positive_number(16), positive_number(float("nan")), positive_number(float("inf")), positive_number(0)
        (True, False, False, False)
        >>> positive_number(2.5, integer=True), positive_number(True)
        (False, False)
    """
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    return math.isfinite(value) and value > 0


def stored_key_problems(names: list[str]) -> list[str]:
    """The keys of an adapter file that ``PeftModel.from_pretrained`` would not load as adapter ``"default"``,
    decided from the names alone (:func:`peft_load_problems` asks PEFT on the model itself).

    PEFT maps a stored key to a model key only when it starts with ``base_model.model.``: it loads none of the
    others. A LoRA key naming another adapter (``lora_A.other.weight``, as tools that save several adapters in one
    file write it) is ignored without a warning; ``lora_A.default.weight`` is loaded, unless the plain
    ``lora_A.weight`` is stored too (then PEFT takes the plain one).

    Args:
        names: the tensor names in ``adapter_model.safetensors``.

    Returns:
        One problem per kind of key PEFT would not load, naming a few of them and the fix.

    Example:
        >>> stored_key_problems(["base_model.model.q.lora_A.weight", "base_model.model.q.lora_A.other.weight"])[0][:62]
        "1 adapter tensor(s) belong to another adapter than 'default' ("
    """
    problems = []
    bare = [n for n in names if not n.startswith("base_model.")]  # model-level tensors (VeRA's) are base_model.*
    if bare:
        problems.append(
            f"{len(bare)} of {len(names)} adapter tensor(s) lack the '{PREFIX}' prefix ({', '.join(bare[:3])}); PEFT "
            "loads none of them, so in PEFT the adapter would not change these modules. Save the adapter with "
            "PeftModel.save_pretrained (or add the prefix) and merge again"
        )
    present = set(names)
    others, shadowed = [], []
    for n in names:
        m = _NAMED.search(n)
        if m is None or not n.startswith(PREFIX):
            continue
        if m.group("name") != ADAPTER:
            others.append(n)
        else:
            plain = n[: m.start("name") - 1] + n[m.end("name") :]  # the same key without the adapter name
            if plain in present or (m.group("part") == "lora_magnitude_vector" and plain + ".weight" in present):
                shadowed.append(n)
    if others:
        names_found = sorted({_NAMED.search(n).group("name") for n in others})
        problems.append(
            f"{len(others)} adapter tensor(s) belong to another adapter than '{ADAPTER}' "
            f"({', '.join(names_found[:5])}: {', '.join(others[:3])}); PEFT loads a folder as '{ADAPTER}' and ignores "
            "them. Save each adapter in its own folder (PeftModel.save_pretrained does) and merge the one you want"
        )
    if shadowed:
        problems.append(
            f"{len(shadowed)} adapter tensor(s) are stored twice, with and without the adapter name ({shadowed[0]}); "
            "PEFT loads the one without it and ignores the other. Keep one copy of each tensor"
        )
    return problems


def peft_load_problems(
    folder: str, names: dict[str, tuple[int, ...]], base_config: object, model_class: type | None = None
) -> list[str]:
    """Ask PEFT which stored tensors ``PeftModel.from_pretrained(base, folder)`` would load, on a meta-device copy
    of the base (no weights read), and name those it would ignore.

    The adapter is built with PEFT's own ``PeftModel`` and its tensors are given, as meta-device stand-ins of the
    stored shapes, to PEFT's ``set_peft_model_state_dict`` (the function ``from_pretrained`` calls): the keys PEFT
    reports as unexpected are those it ignores, and more stored keys than filled parameters means two stored keys
    landed in one parameter.

    Args:
        folder: the adapter folder (its ``adapter_config.json`` is read with ``PeftConfig.from_pretrained``).
        names: every stored tensor's name and shape.
        base_config: the base model's transformers config.
        model_class: the class to build (default: from the config).

    Returns:
        Problems, each naming stored tensors PEFT would not load (or why PEFT cannot load the adapter at all);
        empty when PEFT loads every stored tensor, or when the model cannot be built here (the name rules of
        :func:`stored_key_problems` still apply then).
    """
    import warnings

    import torch

    try:
        from peft import PeftConfig, PeftModel
        from peft.utils.save_and_load import set_peft_model_state_dict

        from .model_info import build_on_meta

        config = PeftConfig.from_pretrained(folder)
        model = build_on_meta(base_config, model_class)
        if model is None:
            return []
        _resize_like_adapter(model, names)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = PeftModel(model, config, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    except Exception as e:  # the build is PEFT's and transformers'; the plan names real mismatches
        log.info("could not rebuild the adapter with PEFT on the meta device (%s); key rules from names only", e)
        return []
    state = {k: torch.empty(shape, device="meta") for k, shape in names.items()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = set_peft_model_state_dict(peft_model, state, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    except Exception as e:  # PeftModel.from_pretrained fails the same way
        return [
            f"PEFT cannot load the adapter in {folder} onto this base ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:300]}); the adapter does not belong to this base or its file is incomplete"
        ]
    problems = []
    ignored = sorted(
        k
        for k in result.unexpected_keys
        if not _copy_of_loaded(k, names, result.unexpected_keys)
        and not _tied_token_rows(peft_model, k, names)
        and not k.endswith(".trainable_tokens_original")
    )  # rows before training: unused by both
    if ignored:
        problems.append(
            f"{len(ignored)} adapter tensor(s) would not be loaded by PEFT onto this base "
            f"({', '.join(ignored[:3])}{', ...' if len(ignored) > 3 else ''}): PeftModel.from_pretrained ignores "
            "them, so merging them would give another model than PEFT's. Remove them from adapter_model.safetensors, "
            "or check that this is the base the adapter was trained on"
        )
    filled = len(set(peft_model.state_dict()) - set(result.missing_keys))
    loaded = len(names) - len(result.unexpected_keys)
    if loaded > filled:  # several stored keys landed in one parameter: PEFT keeps one of them
        problems.append(
            f"{loaded - filled} adapter tensor(s) in {folder} are loaded by PEFT into a parameter "
            "another stored tensor also fills (the same factor stored twice under different names); keep one copy"
        )
    return problems


def _copy_of_loaded(key: str, names: dict[str, tuple[int, ...]], ignored: list[str]) -> bool:
    """Whether an ignored key is one of the copies PEFT (0.21) saves beside the plain ``X.weight`` it loads for a
    ``modules_to_save`` layer: ``X.modules_to_save.weight`` (the trained copy again) or ``X.original_module.weight``
    (the layer before training)."""
    for infix in (".modules_to_save.", ".original_module."):
        if infix in key:
            plain = key.replace(infix, ".")
            return plain in names and plain not in ignored and names[plain] == names[key]
    return False


def _tied_token_rows(peft_model, key: str, names: dict[str, tuple[int, ...]]) -> bool:
    """Whether an unexpected key holds the trainable-token rows PEFT saves for the tied side of a tie (``lm_head``
    tied to the input embedding): PEFT computes that side with its partner's rows, so the stored copy is not used
    (the planner refuses the merge when the two copies differ)."""
    if not key.endswith(".trainable_tokens_delta"):
        return False
    module = dict(peft_model.named_modules()).get(key.removesuffix(".trainable_tokens_delta"))
    tied = getattr(module, "tied_adapter", None)
    rows = getattr(tied, "trainable_tokens_delta", None)
    return rows is not None and ADAPTER in rows and tuple(rows[ADAPTER].shape) == tuple(names[key])


def _resize_like_adapter(model, names: dict[str, tuple[int, ...]]) -> None:
    """Resize a meta-device model's vocabulary to the rows of the embedding the adapter saved (a vocabulary resized
    before training: ``resize_token_embeddings`` then ``modules_to_save``/``save_embedding_layers``), as the user
    resizes the base before ``PeftModel.from_pretrained``."""
    embeddings = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    path = next((n for n, m in model.named_modules() if m is embeddings), None) if embeddings is not None else None
    if not path:
        return
    rows = [
        shape[0]
        for key, shape in names.items()
        if shape
        and key.endswith(".weight")
        and re.sub(
            r"\.(modules_to_save|original_module|base_layer|token_adapter|default)(?=\.)",
            "",
            key.removeprefix("base_model.model."),
        )
        == f"{path}.weight"
    ]
    if rows and max(rows) != embeddings.weight.shape[0]:
        model.resize_token_embeddings(max(rows), mean_resizing=False)


def unmergeable_targets(tensors: list) -> list[str]:
    """Planned tensors that would receive a change (LoRA delta, bias, token rows, PEFT layer delta, or a replacement
    written in the base's dtype) while stored in a dtype that cannot hold it (integers, float8, bool).

    Args:
        tensors: planned tensors of a merge from disk: ``name``, ``source`` (its ``dtype``), ``out_dtype``, and the
            recipe's lists ``loras``, ``bias_loras``, ``token_rows``, ``peft_ops`` and its ``from_adapter``.

    Returns:
        One problem naming every such tensor, or none.

    Example:
        >>> unmergeable_targets([])
        []
    """
    bad = []
    for t in tensors:
        changed = t.recipe.loras or t.recipe.bias_loras or t.recipe.token_rows or t.recipe.peft_ops
        if changed and t.source.dtype not in MERGEABLE_DTYPES:
            bad.append(f"{t.name} ({t.source.dtype})")
        elif t.recipe.from_adapter and t.out_dtype not in MERGEABLE_DTYPES and t.out_dtype != t.source.dtype:
            bad.append(f"{t.name} ({t.out_dtype}, replaced by a {t.source.dtype} adapter tensor)")
    if not bad:
        return []
    return [
        f"the adapter changes {len(bad)} tensor(s) the base stores as integers or float8: {', '.join(bad[:5])}; "
        "a delta added there would be truncated to that dtype. Merge into the 16-bit (or 32-bit) checkpoint "
        f"of this model; only {', '.join(MERGEABLE_DTYPES)} tensors take a delta"
    ]


def adapter_load_problems(spec, base_folder: str) -> list[str]:
    """:func:`peft_load_problems` for every LoRA adapter of a spec (one, or the parts of a combination) on a base.

    Adapters merged through PEFT's rebuilt layers (LoHa, LoKr, VeRA, IA3, LoRA on parameters) are skipped: their
    rebuild already loads the stored tensors with PEFT and names those without a place.

    Args:
        spec: an :class:`~peft_shardmerge.checkpoint.adapter.AdapterSpec`.
        base_folder: the base checkpoint folder (its ``config.json``).

    Returns:
        The problems, empty when PEFT loads every stored tensor.
    """
    import os

    from ..io.safetensors_io import read_header

    try:
        from transformers import AutoConfig

        base_config = AutoConfig.from_pretrained(base_folder, trust_remote_code=False)
    except Exception as e:  # a custom architecture: the name rules alone apply
        log.info("no transformers config for %s (%s); adapter keys checked by name only", base_folder, e)
        return []
    problems = []
    for part in spec.parts or [spec]:
        path = os.path.join(
            part.scratch.name if part.scratch is not None else part.folder, "adapter_model.safetensors"
        )
        if part.needs_layers or not os.path.isfile(path):
            continue
        infos, _ = read_header(path)
        problems += peft_load_problems(part.folder, {i.name: i.shape for i in infos}, base_config)
    return problems
