"""The conformance matrix as a list of checks: PEFT's case tables (:mod:`peft_cases`) placed on tiny models, with
module names mapped, crossed with our four merge paths; and the seeded sample that ``make test`` runs.

A check is ``(case, path)``. Case sources:

- ``custom``: a row of PEFT's ``TEST_CASES`` on tiny transformers models with the same layer kinds
  (see :data:`BROAD_TYPES`);
- ``module``: the same row on PEFT's own small ``nn.Module`` (in-process paths only: there is no checkpoint);
- ``multi``: a row of ``MULTIPLE_ACTIVE_ADAPTERS_TEST_CASES``, both adapters active;
- ``decoder`` / ``encdec``: a row of ``ALL_CONFIGS`` of PEFT's decoder / encoder-decoder tests, on each of the
  architectures those tests use;
- ``weighted``: PEFT's ``add_weighted_adapter`` calls (``testing_common.py``) against our ``adapter_names`` /
  ``weights`` / ``combination_type`` (``merge_checkpoint``: a list of adapters, ``weights``, ``combination``);
- ``nan``: PEFT's NaN-merge test (``_test_merge_layers_nan``): a LoRA holding a NaN, which must be refused.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import re
from dataclasses import dataclass, field

import peft_cases as tables
from conformance_models import ARCH_NAMES, DECODER_ARCHS, ENCODER_DECODER_ARCHS, MODEL_ARCHS

#: the four APIs every case goes through
PATHS = ("merge_and_unload", "merge_and_save:original", "merge_and_save:dequantized", "merge_checkpoint")
#: the in-process paths (PEFT's own nn.Module models have no checkpoint on disk)
MODULE_PATHS = PATHS[:3]
#: seed of the ``make test`` sample and its size
SAMPLE_SEED = 20261123
SAMPLE_SIZE = 150
#: config classes of the PEFT types the README names as merged: their custom cases run on every architecture with
#: the layer kinds of PEFT's model; every other type's case runs on one of them, in turn
BROAD_TYPES = ("LoraConfig", "LoHaConfig", "LoKrConfig", "IA3Config", "VeraConfig", "TrainableTokensConfig")
#: PEFT's module names in its small test models
CUSTOM_NAMES = ("lin0", "lin1", "lin2", "emb", "conv1d", "conv2d", "conv3d", "mha", "layernorm0", "layernorm1")


@dataclass(frozen=True)
class Case:
    """One PEFT case placed on one model.

    ``configs`` is a tuple of ``(config class, kwargs)`` (one per adapter, module names already mapped);
    ``arch`` is the tiny transformers architecture, or None for PEFT's own ``nn.Module`` named ``model_id``.
    """

    id: str
    source: str
    name: str
    arch: str | None
    model_id: str | None
    configs: tuple = field(compare=False)
    nan: bool = False
    #: (indices of the adapters combined, weights, combination_type, density) of an add_weighted_adapter case
    weighted: tuple | None = None

    @property
    def paths(self) -> tuple[str, ...]:
        return MODULE_PATHS if self.arch is None else PATHS

    @property
    def peft_type(self) -> str:
        return self.configs[0][0].__name__.removesuffix("Config").upper()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def map_names(obj, names: dict[str, str], key: str | None = None):
    """A copy of case kwargs with PEFT's test-model module names replaced by ``names`` (dict keys and values,
    ``name.weight`` parameter names, nested config objects); a plain string ``target_modules`` is a regex that
    PEFT full-matches, so it becomes one matching the mapped name under any prefix.

    Args:
        obj: kwargs (or a part of them).
        names: PEFT's name -> ours.
        key: the kwargs key ``obj`` sits under.

    Returns:
        The mapped copy.

    Raises:
        KeyError: a module name with no counterpart in ``names``.

    Example:
        >>> map_names({"target_modules": ["lin0"], "r": 8}, {"lin0": "fc1"})
        {'target_modules': ['fc1'], 'r': 8}
        >>> map_names({"target_modules": "lin0"}, {"lin0": "mlp.fc1"})
        {'target_modules': '(.*\\\\.)?mlp\\\\.fc1'}
    """
    if isinstance(obj, str):
        head, _, tail = obj.partition(".")
        if head in CUSTOM_NAMES and tail in ("", "weight", "bias"):
            mapped = names[head] + (f".{tail}" if tail else "")
            if key in ("target_modules", "feedforward_modules"):  # PEFT full-matches a string as a regex
                return r"(.*\.)?" + re.escape(mapped)
            return mapped
        return obj
    if isinstance(obj, dict):
        return {map_names(k, names): map_names(v, names, k) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_names(v, names) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_names(getattr(obj, f.name), names, f.name) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(copy.copy(obj), **changes)
    return obj


def all_cases() -> list[Case]:
    """Every case of the matrix, in a fixed order.

    Returns:
        The cases.

    Raises:
        Nothing.

    Example:
        >>> cases = all_cases(); len({c.id for c in cases}) == len(cases)
        True
    """
    out = []
    for i, (name, model_id, cls, kwargs) in enumerate(tables.CUSTOM_CASES):
        archs = MODEL_ARCHS[model_id]
        if archs and cls.__name__ not in BROAD_TYPES:
            archs = archs[i % len(archs) :][:1]
        for arch in archs:
            mapped = map_names(kwargs, ARCH_NAMES[arch])
            out.append(Case(f"custom{i:03d}-{_slug(name)}@{arch}", "custom", name, arch, model_id, ((cls, mapped),)))
        out.append(
            Case(
                f"module{i:03d}-{_slug(name)}@{model_id}",
                "module",
                name,
                None,
                model_id,
                ((cls, copy.deepcopy(kwargs)),),
            )
        )
    for i, (name, tag, cls, kw0, kw1) in enumerate(tables.MULTI_ADAPTER_CASES):
        model_id = "EmbConv1D" if tag == "lora+trainable_tokens" else "MLP"  # as PEFT's test picks its model
        arch = MODEL_ARCHS[model_id][i % 2]
        names = ARCH_NAMES[arch]
        out.append(
            Case(
                f"multi{i:03d}-{_slug(name)}@{arch}",
                "multi",
                name,
                arch,
                model_id,
                ((cls, map_names(kw0, names)), (cls, map_names(kw1, names))),
            )
        )
    for source, rows, archs in (
        ("decoder", tables.DECODER_CONFIGS, DECODER_ARCHS),
        ("encdec", tables.ENCODER_DECODER_CONFIGS, ENCODER_DECODER_ARCHS),
    ):
        for i, (cls, kwargs) in enumerate(rows):
            for arch in archs:
                name = f"{cls.__name__} {i}"
                out.append(
                    Case(
                        f"{source}{i:03d}-{_slug(cls.__name__)}@{arch}",
                        source,
                        name,
                        arch,
                        None,
                        ((cls, copy.deepcopy(kwargs)),),
                    )
                )
    lora = (tables.LoraConfig, {"task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 32, "lora_dropout": 0.05})
    r20 = (tables.LoraConfig, {**lora[1], "r": 20})
    for i, (name, picked, combination, density) in enumerate(tables.WEIGHTED_CASES):
        for j, weights in enumerate(tables.WEIGHT_LISTS):
            arch = ("llama", "opt")[(i + j) % 2]
            sign = "negative" if j else "positive"
            out.append(
                Case(
                    f"weighted{i:02d}-{_slug(name)}-{sign}@{arch}",
                    "weighted",
                    f"{name} ({sign})",
                    arch,
                    None,
                    (lora, lora, r20),
                    weighted=(tuple(picked), tuple(weights[k] for k in picked), combination, density),
                )
            )
    for arch, target in (("llama", "q_proj"), ("gpt2", "c_attn"), ("t5", "q")):
        out.append(
            Case(
                f"nan-lora@{arch}",
                "nan",
                "LoRA holding a NaN (PEFT's _test_merge_layers_nan)",
                arch,
                None,
                ((tables.LoraConfig, {"target_modules": [target]}),),
                nan=True,
            )
        )
    return out


def all_checks() -> list[tuple[Case, str]]:
    """Every (case, path) of the matrix, case by case.

    Returns:
        The checks.

    Raises:
        Nothing.

    Example:
        >>> len(all_checks()) > 3000
        True
    """
    return [(case, path) for case in all_cases() for path in case.paths]


def sample_ids(checks: list[tuple[Case, str]], size: int = SAMPLE_SIZE, seed: int = SAMPLE_SEED) -> set[str]:
    """The seeded sample ``make test`` runs: one check of every PEFT type, path, case source and architecture
    first, then random checks of the types the README claims for 70% of the rest, then any random checks.

    Args:
        checks: from :func:`all_checks`.
        size: how many.
        seed: random seed.

    Returns:
        The ids ``"<case id>|<path>"`` of the sample.

    Raises:
        Nothing.

    Example:
        >>> ids = sample_ids(all_checks()); len(ids)
        150
    """
    rng = random.Random(seed)
    order = list(checks)
    rng.shuffle(order)
    chosen: dict[str, None] = {}
    seen: set = set()
    for case, path in order:  # cover every PEFT type, path, source and architecture at least once
        keys = {("type", case.peft_type), ("path", path), ("source", case.source), ("arch", case.arch)}
        if keys - seen:
            seen |= keys
            chosen[f"{case.id}|{path}"] = None
    broad = [(c, p) for c, p in order if c.configs[0][0].__name__ in BROAD_TYPES and c.arch is not None]
    for case, path in broad[: int(max(0, size - len(chosen)) * 0.7)] + order:  # mostly types that merge
        if len(chosen) >= size:
            break
        chosen.setdefault(f"{case.id}|{path}", None)
    return set(chosen)
