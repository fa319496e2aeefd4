"""How several adapters may be combined: the methods and their parameters, and the one check both paths run."""

from __future__ import annotations

import logging
import math
from typing import Sequence

log = logging.getLogger(__name__)

#: the task-vector combinations of full deltas, as MergeKit defines them: each method's (sparsification, sign
#: election, normalize by default); ``magnitude_prune`` is PEFT's name for magnitude sparsification and a weighted sum
TASK_VECTOR_METHODS = {
    "ties": ("magnitude", True, True),
    "dare_ties": ("random", True, False),
    "dare_linear": ("random", False, False),
    "magnitude_prune": ("magnitude", False, False),
}
#: how a sign is elected per element: the sign of the weighted sum of the deltas, or the sign most deltas have
MAJORITY_SIGNS = ("total", "frequency")
#: every way several adapters combine: PEFT's two on factors (``cat`` is exactly the weighted sum of the deltas),
#: then the task-vector methods
COMBINATIONS = ("cat", "linear", *TASK_VECTOR_METHODS)


def config_value(config, key: str, default=None):
    """One field of an adapter config given as a dict (``adapter_config.json``) or a PEFT config object.

    Args:
        config: the config.
        key: the field.
        default: returned when the field is absent or None.

    Returns:
        The value (an enum such as ``PeftType.IA3`` as its string value).

    Example:
        >>> config_value({"peft_type": "IA3"}, "peft_type"), config_value({}, "r", 8)
        ('IA3', 8)
    """
    value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    value = getattr(value, "value", value)
    return default if value is None else value


def check_weights(
    count: int, weights: "Sequence[float] | None", combination: str, *, option: str = "combination"
) -> tuple[list[float], list[str]]:
    """Check the weights and combination of ``count`` adapters merged together.

    Args:
        count: how many adapters.
        weights: one weight per adapter, or None for 1.0 each.
        combination: one of :data:`COMBINATIONS`.
        option: the option's name in messages (``combination_type`` in process).
        in_process: the adapters are combined on a loaded model (the advice names what works there).

    Returns:
        ``(weights as a list, problems)``.

    Example:
        >>> check_weights(2, None, "cat")
        ([1.0, 1.0], [])
    """
    problems = []
    weights = [1.0] * count if weights is None else list(weights)
    if len(weights) != count:
        problems.append(f"{len(weights)} weight(s) given for {count} adapter(s); give one weight per adapter")
    elif not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
        problems.append(f"adapter weights must be finite numbers, got {weights!r}")
    if combination not in COMBINATIONS:
        problems.append(f"{option} must be one of {', '.join(COMBINATIONS)}, got {combination!r}")
    return weights, problems


def _ranks(config) -> set[int]:
    pattern = config_value(config, "rank_pattern", {}) or {}
    return {int(config_value(config, "r", 0))} | {int(v) for v in pattern.values()}


def combination_problems(
    configs: Sequence,
    names: Sequence[str],
    weights: "Sequence[float] | None",
    combination: str,
    *,
    option: str = "combination",
    in_process: bool = False,
) -> tuple[list[float], list[str]]:
    """Check a weighted combination of adapters from their configs alone (the disk and in-process paths).

    One adapter with weight 1 is no combination (unless a task-vector method sparsifies it). Otherwise DoRA
    adapters (their magnitudes do not add) and IA3 adapters (their scalings multiply) are refused, and ``"linear"``
    over several adapters needs equal ranks (``r`` and ``rank_pattern``). The task-vector methods take plain LoRA
    adapters only (:data:`TASK_VECTOR_METHODS`).

    Args:
        configs: the adapter configs, as dicts (``adapter_config.json``) or PEFT config objects.
        names: the adapters' names for messages (adapter names or folders), one per config.
        weights: one weight per adapter, or None for 1.0 each.
        combination: one of :data:`COMBINATIONS`.
        option: the option's name in messages (``combination_type`` in process).
        in_process: the adapters are combined on a loaded model (the advice names what works there).

    Returns:
        ``(weights as a list, problems)``; every problem found, at once.

    Example:
        >>> combination_problems([{"r": 8, "use_dora": True}, {"r": 8}], ["a", "b"], [0.5, 0.5], "cat")[1]
        ["DoRA adapters cannot be weighted or combined (their magnitudes do not add): ['a']"]
    """
    weights, problems = check_weights(len(configs), weights, combination, option=option)
    if problems:
        return weights, problems
    vectors = combination in TASK_VECTOR_METHODS
    if len(configs) <= 1 and all(w == 1 for w in weights) and not vectors:
        return weights, problems
    dora = [n for n, c in zip(names, configs) if config_value(c, "use_dora", False)]
    if dora:
        problems.append(f"DoRA adapters cannot be weighted or combined (their magnitudes do not add): {dora}")
    ia3 = [n for n, c in zip(names, configs) if str(config_value(c, "peft_type", "")) == "IA3"]
    if ia3:
        problems.append(f"IA3 adapters cannot be weighted or combined (their scalings multiply): {ia3}")
    if vectors:
        problems += _task_vector_config_problems(configs, names, combination, option, in_process)
    if combination == "linear" and len(configs) > 1:
        shapes = {
            (config_value(c, "r"), tuple(sorted((config_value(c, "rank_pattern", {}) or {}).items()))) for c in configs
        }
        if len(shapes) > 1:
            ranks = sorted(set().union(*(_ranks(c) for c in configs)))
            problems.append(
                f"{option} 'linear' needs adapters of equal rank: every adapter must have the same rank, "
                f"got {ranks}; use 'cat'"
            )
    return weights, problems


def _task_vector_config_problems(
    configs: Sequence, names: Sequence[str], combination: str, option: str, in_process: bool
) -> list[str]:
    """What a task-vector method cannot combine: anything but plain LoRA deltas of modules (an allowlist); the
    advice names a combination the same path then accepts."""
    problems = []
    for name, c in zip(names, configs):
        kinds = []
        peft_type = str(config_value(c, "peft_type", "LORA"))
        if peft_type != "LORA":
            kinds.append(f"peft_type {peft_type}")
        if config_value(c, "target_parameters"):
            kinds.append("LoRA on target_parameters")
        if kinds and not in_process:  # the disk engine combines LoRA on modules only, whatever the method
            problems.append(
                f"{option} {combination!r} combines the LoRA deltas of modules only; the adapter {name} has "
                f"{', '.join(kinds)}, and on disk only LoRA adapters on modules are combined at all: combine such "
                "adapters (of one PEFT type) in process, with merge_and_save(model, out_dir, adapter_names=[...], "
                "combination_type='cat'), or use an adapter trained without them"
            )
            continue
        if config_value(c, "modules_to_save"):
            kinds.append(f"modules_to_save {list(config_value(c, 'modules_to_save'))}")
        if config_value(c, "trainable_token_indices"):
            kinds.append("trainable_token_indices")
        if config_value(c, "lora_bias", False):
            kinds.append("lora_bias")
        if kinds:
            problems.append(
                f"{option} {combination!r} combines the LoRA deltas of modules only; the adapter {name} also has "
                f"{', '.join(kinds)}, which {combination} does not define. Combine it with 'cat' (or 'linear', "
                "for adapters of equal rank), or use an adapter trained without them"
            )
    return problems


def task_vector_problems(
    combination: str,
    density: object,
    majority_sign: object,
    normalize: object,
    seed: object,
    *,
    option: str = "combination",
    sign_option: str = "majority_sign",
) -> list[str]:
    """Check the parameters of a task-vector combination: ``density`` is required by those methods and refused by
    the others, ``majority_sign`` applies to the methods that elect a sign, ``seed`` to DARE's.

    Args:
        combination: one of :data:`COMBINATIONS`.
        density: the fraction of each delta kept, in (0, 1], or None.
        majority_sign: one of :data:`MAJORITY_SIGNS`.
        normalize: True, False or None (the method's default).
        seed: DARE's seed, an int >= 0.
        option: the combination option's name in messages.
        sign_option: the majority-sign option's name in messages (``majority_sign_method`` in process).

    Returns:
        Every problem, at once.

    Example:
        >>> task_vector_problems("ties", None, "total", None, 0)[0][:40]
        "combination 'ties' needs a density: the "
        >>> task_vector_problems("cat", 0.5, "total", None, 0)[0][:60]
        'density=0.5 applies to the task-vector combinations (ties, d'
    """
    problems = []
    methods = ", ".join(TASK_VECTOR_METHODS)
    if combination not in TASK_VECTOR_METHODS:
        for name, value, default in (
            ("density", density, None),
            (sign_option, majority_sign, "total"),
            ("normalize", normalize, None),
            ("seed", seed, 0),
        ):
            if value != default or isinstance(value, bool) != isinstance(default, bool):
                problems.append(
                    f"{name}={value!r} applies to the task-vector combinations ({methods}), not {option} "
                    f"{combination!r}"
                )
        return problems
    sparsification, elects, _ = TASK_VECTOR_METHODS[combination]
    if density is None:
        problems.append(
            f"{option} {combination!r} needs a density: the fraction of each adapter's delta kept, in (0, 1] "
            "(e.g. 0.5)"
        )
    elif isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        problems.append(f"density must be a number in (0, 1], got {density!r}")
    elif sparsification == "random" and density < 1e-30:  # DARE multiplies the kept elements by 1 / density
        problems.append(
            f"density={density!r} is too small for DARE: 1 / density overflows float32; use at least 1e-30"
        )
    if majority_sign not in MAJORITY_SIGNS:
        problems.append(f"{sign_option} must be one of {', '.join(MAJORITY_SIGNS)}, got {majority_sign!r}")
    elif majority_sign != "total" and not elects:
        problems.append(
            f"{sign_option}={majority_sign!r} applies to the methods that elect a sign (ties, dare_ties), "
            f"not {combination!r}"
        )
    if normalize is not None and not isinstance(normalize, bool):
        problems.append(f"normalize must be True, False or None (the method's default), got {normalize!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        problems.append(f"seed must be an int >= 0, got {seed!r}")
    elif seed != 0 and sparsification != "random":
        problems.append(f"seed={seed!r} applies to DARE's random draw (dare_ties, dare_linear), not {combination!r}")
    return problems


def warn_about_combination(vectors) -> None:
    """Log, as warnings, what a task-vector combination does that a user may not expect (its ``notes()``: one adapter
    is only sparsified, weights that nearly cancel scale deltas up), once, as the plan is made (a warning, not a note
    of the report: the command line shows it once, under ``-q`` too).

    Args:
        vectors: the :class:`~peft_shardmerge.engine.task_vectors.TaskVectorMethod`, or None.

    Example:
        >>> warn_about_combination(None)
    """
    for note in vectors.notes() if vectors is not None else []:
        log.warning("%s", note)
