"""What a PEFT LoRA adapter folder says: its config and, per target module, where A, B and scaling come from."""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.task_vectors import TaskVectorMethod
from ..errors import CorruptFileError, InputError
from ..support.claims import DISK, check_layers, raise_if_any, residual_init
from ..support.combinations import (
    COMBINATIONS,
    check_weights,
)
from ..support.peft_reading import stored_key_problems
from .adapter_files import (
    ADAPTER_BIN,
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    TOKENS_SUFFIXES,
    AdapterTensor,
    TokenRows,
    add_token_rows,
    check_adapter_config,
    pattern_key,
    read_adapter_tensors,
)
from .base_folder import read_json, resolve_folder
from .peft_deltas import DELTA_TYPES

__all__ = [
    "ADAPTER_BIN",
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "COMBINATIONS",
    "PREFIX",
    "AdapterSpec",
    "AdapterTensor",
    "LoraModule",
    "TokenRows",
    "check_weights",
    "load_adapter",
    "modifies_base",
]

PREFIX = "base_model.model."

_LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"(?:\.(?!weight$|bias$)[^.]+)?(?:\.(?P<leaf>weight|bias))?$"
)


@dataclass
class LoraModule:
    """One LoRA-wrapped module of the base model.

    Attributes:
        path: the module's name in the base model, e.g. ``model.layers.0.self_attn.q_proj``.
        kind: ``"linear"`` (``lora_A``/``lora_B``), ``"conv"`` (``nn.Conv2d``/``Conv3d``: ``B @ A`` gives the weight
            flattened to ``[out, in * kernel]``) or ``"embedding"`` (``lora_embedding_A``/``_B``).
        a: the A factor, ``[r, in_features]`` (embedding: ``[r, num_embeddings]``).
        b: the B factor, ``[out_features, r]`` (embedding: ``[embedding_dim, r]``).
        bias: ``lora_B.bias`` when the adapter was trained with ``lora_bias=True``.
        rank: r of this module (from ``rank_pattern`` or ``r``).
        alpha: lora_alpha of this module (from ``alpha_pattern`` or ``lora_alpha``).
        scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA.
        magnitude: DoRA's ``lora_magnitude_vector`` (one value per output row), None for plain LoRA.
        key: a name unique within the spec (the path, or ``"<adapter>:<path>"`` in a combination).
        index: the adapter it comes from, in a combination's order (0 otherwise).
    """

    path: str
    kind: str
    a: AdapterTensor
    b: AdapterTensor
    bias: AdapterTensor | None
    rank: int
    alpha: float
    scaling: float
    magnitude: AdapterTensor | None = None
    key: str = ""
    index: int = 0

    def __post_init__(self) -> None:
        self.key = self.key or self.path


@dataclass
class AdapterSpec:
    """A LoRA adapter, read once: config, LoRA modules and whole-tensor replacements.

    Attributes:
        folder: the adapter folder.
        config: the parsed ``adapter_config.json``.
        modules: LoRA modules by module path.
        replacements: adapter tensors that replace a base tensor outright, by base tensor name
            (``modules_to_save`` weights, trained biases, saved embedding layers).
        fan_in_fan_out: the config's flag (Conv1D layers store weights transposed).
        tokenizer_files: tokenizer files saved beside the adapter.
        scratch: the folder of a legacy ``.bin`` converted to safetensors (removed with the spec).
        folders: every adapter folder this spec was read from (several for a combination).
        combination: how several adapters were combined (``"cat"``/``"linear"`` with their weights), or "".
        parts: the adapters of a combination.
        vectors: the task-vector method of a combination that has one (TIES, DARE, magnitude pruning), else None;
            its modules then keep their own scaling and ``index``.
        tokens: trainable-token rows by module path (``trainable_token_indices``).
        peft_type: the config's ``peft_type`` (``"LORA"``, ``"TRAINABLE_TOKENS"``, ``"LOHA"``, ...).
        layers: for LoHa/LoKr/VeRA/IA3, the layers PEFT rebuilt
        (:func:`~peft_shardmerge.checkpoint.peft_deltas.rebuild`).
        layer_skip: adapter tensor names the rebuilt layers do not take (saved modules, token rows).
        saved_copies: replacements that are ``modules_to_save`` copies (the adapter model's tied partner keeps
            the base's weights), as opposed to embedding layers saved after a resize (which stay tied).
    """

    folder: str
    config: dict
    modules: dict[str, LoraModule] = field(default_factory=dict)
    replacements: dict[str, AdapterTensor] = field(default_factory=dict)
    fan_in_fan_out: bool = False
    tokenizer_files: list[str] = field(default_factory=list)
    scratch: tempfile.TemporaryDirectory | None = None
    folders: list[str] = field(default_factory=list)
    combination: str = ""
    parts: list["AdapterSpec"] = field(default_factory=list)
    tokens: dict[str, TokenRows] = field(default_factory=dict)
    peft_type: str = "LORA"
    layers: Any = None
    layer_skip: set = field(default_factory=set)
    saved_copies: set = field(default_factory=set)
    vectors: TaskVectorMethod | None = None

    def __post_init__(self) -> None:
        self.folders = self.folders or [self.folder]

    @property
    def needs_layers(self) -> bool:
        """Whether the merge goes through PEFT's rebuilt layers (LoHa/LoKr/VeRA/IA3, LoRA on parameters)."""
        return self.peft_type in DELTA_TYPES or bool(self.config.get("target_parameters"))

    @property
    def base_model_name(self) -> str | None:
        return self.config.get("base_model_name_or_path")


def load_adapter(location: str) -> AdapterSpec:
    """Read a PEFT LoRA adapter folder into an :class:`AdapterSpec` (tensor data stays on disk).

    Args:
        location: a folder with ``adapter_config.json`` and ``adapter_model.safetensors`` (or a legacy
            ``adapter_model.bin``, read with ``torch.load(weights_only=True)``), or a cached Hub id.

    Returns:
        The adapter spec.

    Raises:
        NotFoundError: the folder, config or weights file is missing.
        UnsupportedError: the adapter is not LoRA, or uses an option that cannot be merged (all named).
        InputError: config fields are missing or of the wrong type, or A/B shapes disagree.
        CorruptFileError: the weights file is malformed.
    """
    from .base_folder import TOKENIZER_FILES

    folder = resolve_folder(location, what="adapter", must_have=(ADAPTER_CONFIG,))
    config = read_json(os.path.join(folder, ADAPTER_CONFIG), "adapter_config.json")
    check_adapter_config(config, folder)
    tensors, scratch = _adapter_tensors(folder)
    key_problems = stored_key_problems(list(tensors))  # keys PeftModel.from_pretrained would not load
    if key_problems:
        raise InputError(key_problems)
    spec = AdapterSpec(
        folder,
        config,
        fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
        scratch=scratch,
        peft_type=str(config.get("peft_type")),
    )
    spec.tokenizer_files = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    problems: list[str] = []
    parts = _sort_tensors(spec, tensors, problems)
    if spec.needs_layers:
        if scratch is not None:
            problems.append(
                f"adapter {folder}: a {spec.peft_type} adapter on PEFT's own layers must be saved as safetensors"
            )
        if problems:
            raise InputError(problems)
        return spec
    unsupported: list[str] = []  # the allowlist's refusals (support.py)
    for path, p in sorted(parts.items()):
        module = _lora_module(config, path, p, problems, unsupported)
        if module is not None:
            spec.modules[path] = module
    if (config.get("trainable_token_indices") or config.get("peft_type") == "TRAINABLE_TOKENS") and not spec.tokens:
        problems.append(
            "adapter_config.json asks for trainable tokens but the weights hold no "
            "trainable_tokens_delta; the config does not belong to these weights"
        )
    raise_if_any(unsupported, problems)
    if not spec.modules and not spec.replacements and not spec.tokens:
        raise InputError(f"adapter {folder} holds no LoRA weights; is it the right folder?")
    return spec


def _sort_tensors(
    spec: AdapterSpec, tensors: dict[str, AdapterTensor], problems: list[str]
) -> dict[str, dict[str, AdapterTensor]]:
    """File every adapter tensor: token rows and replacements into ``spec``; LoRA factors returned by module."""
    parts: dict[str, dict[str, AdapterTensor]] = {}
    saved_modules = spec.config.get("modules_to_save") or []
    for name, t in tensors.items():
        key = name[len(PREFIX) :] if name.startswith(PREFIX) else name
        if key.endswith(".trainable_tokens_original"):
            continue  # the rows before training, kept by PEFT for unmerging
        if key.endswith(TOKENS_SUFFIXES):
            add_token_rows(spec, name, key, t, problems)
            spec.layer_skip.add(name)
            continue
        if ".original_module." in key:
            continue  # the layer as it was before training, kept by PEFT beside its modules_to_save copy
        base_name = key.replace(".token_adapter.", ".").replace(".base_layer.", ".").replace(".modules_to_save.", ".")
        module = base_name.rsplit(".", 1)[0]
        if ".modules_to_save." in key or any(module == m or module.endswith("." + m) for m in saved_modules):
            spec.saved_copies.add(base_name)  # a trained copy: in the adapter model it is tied to nothing
        if spec.needs_layers:  # the rest is loaded into PEFT's own layers by the planner, except saved modules
            if base_name in spec.saved_copies:
                spec.replacements[base_name] = t
                spec.layer_skip.add(name)
            continue
        m = _LORA_KEY.match(key)
        if m is None:
            if "lora_" in key:
                problems.append(f"adapter tensor {name!r} is not a LoRA tensor this version knows")
                continue
            # PEFT 0.21 saves a layer of modules_to_save as X.weight and X.modules_to_save.weight, loads X.weight
            if ".modules_to_save." not in key or base_name not in spec.replacements:
                spec.replacements[base_name] = t
            continue
        part = m.group("part") + ("." + m.group("leaf") if m.group("leaf") == "bias" else "")
        parts.setdefault(m.group("module"), {})[part] = t
    return parts


def _lora_module(
    config: dict, path: str, p: dict[str, AdapterTensor], problems: list[str], unsupported: list[str]
) -> LoraModule | None:
    """The LoRA module of ``path`` from its factors, or None with the problem recorded."""
    if "lora_A" in p or "lora_B" in p:
        kind, a, b = "linear", p.get("lora_A"), p.get("lora_B")
    else:
        kind, a, b = "embedding", p.get("lora_embedding_A"), p.get("lora_embedding_B")
    if a is None or b is None:
        problems.append(f"LoRA module {path!r} has only one of its A/B factors in the adapter weights")
        return None
    if kind == "linear" and len(a.shape) in (4, 5) and len(b.shape) == len(a.shape):
        kind = "conv"  # nn.Conv2d/Conv3d: A is [r, in, *kernel], B is [out, r, 1, ...]
    ok = len(a.shape) == 2 and len(b.shape) == 2 if kind != "conv" else all(k == 1 for k in b.shape[2:])
    if kind == "conv" and ok and b.shape[1] < a.shape[0] and a.shape[0] % b.shape[1] == 0:  # B [out, r/groups]
        unsupported += check_layers(
            [(path, "LORA", f"Conv{len(a.shape) - 2}d (groups={a.shape[0] // b.shape[1]})", [])], path=DISK
        )
        return None
    if not ok or a.shape[0] != b.shape[1]:
        problems.append(
            f"LoRA module {path!r}: A {list(a.shape)} and B {list(b.shape)} do not form a rank-r pair "
            "(A is [r, in], B is [out, r]; for a convolution A is [r, in, *kernel], B is [out, r, 1, ...])"
        )
        return None
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rank_key, alpha_key = pattern_key(rank_pattern, path), pattern_key(alpha_pattern, path)
    rank = int(rank_pattern[rank_key]) if rank_key else config.get("r")
    alpha = alpha_pattern[alpha_key] if alpha_key else config.get("lora_alpha")
    if a.shape[0] != rank:
        problems.append(
            f"LoRA module {path!r} has rank {a.shape[0]} in its weights but adapter_config.json says "
            f"r={rank}; the config does not belong to these weights"
        )
        return None
    scaling = alpha / math.sqrt(rank) if bool(config.get("use_rslora", False)) else alpha / rank
    magnitude = p.get("lora_magnitude_vector")
    if bool(config.get("use_dora")) != (magnitude is not None):
        problems.append(
            f"LoRA module {path!r}: use_dora={config.get('use_dora')!r} in adapter_config.json but "
            f"the weights {'have' if magnitude is not None else 'lack'} a lora_magnitude_vector"
        )
        return None
    return LoraModule(path, kind, a, b, p.get("lora_B.bias"), rank, float(alpha), scaling, magnitude)


def _adapter_tensors(folder: str) -> tuple[dict[str, AdapterTensor], tempfile.TemporaryDirectory | None]:
    """The adapter's tensors, and the scratch folder holding a legacy ``.bin`` converted to safetensors."""
    st_path, bin_path, scratch = os.path.join(folder, ADAPTER_WEIGHTS), os.path.join(folder, ADAPTER_BIN), None
    if not os.path.isfile(st_path) and os.path.isfile(bin_path):
        scratch = tempfile.TemporaryDirectory(prefix="peft-shardmerge-adapter-")
        st_path = _bin_to_safetensors(bin_path, os.path.join(scratch.name, ADAPTER_WEIGHTS))
    return read_adapter_tensors(folder, st_path), scratch


def _bin_to_safetensors(bin_path: str, st_path: str) -> str:
    """Read a legacy adapter_model.bin without unpickling code and write it as safetensors (adapters are small)."""
    from safetensors.torch import save_file

    try:
        state: Any = torch.load(bin_path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CorruptFileError(
            f"{bin_path} cannot be read safely with torch.load(weights_only=True) ({e}); re-save the adapter "
            "as safetensors"
        ) from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CorruptFileError(f"{bin_path} is not a flat dict of tensors")
    save_file({k: v.contiguous() for k, v in state.items()}, st_path, metadata={"format": "pt"})
    return st_path


def modifies_base(init_lora_weights: object) -> bool:
    """Whether a LoRA initialisation rewrites the base weights (PiSSA, OLoRA, CorDA, LoftQ).

    Args:
        init_lora_weights: the ``init_lora_weights`` value of a LoRA config.

    Returns:
        True for the methods that subtract the initial LoRA from the base.

    Example:
        >>> modifies_base("pissa_niter_4"), modifies_base(True)
        (True, False)
    """
    return residual_init(init_lora_weights)  # one definition, the allowlist's
