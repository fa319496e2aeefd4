"""Which adapters may be weighted or combined, and how: the one check both paths run on adapter configs."""

from __future__ import annotations

import math
from typing import Sequence

COMBINATIONS = ("cat", "linear")


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
        combination: ``"cat"`` or ``"linear"``.
        option: the option's name in messages (``combination_type`` in process).

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
) -> tuple[list[float], list[str]]:
    """Check a weighted combination of adapters from their configs alone (the disk and in-process paths).

    One adapter with weight 1 is no combination. Otherwise DoRA adapters (their magnitudes do not add) and IA3
    adapters (their scalings multiply) are refused, and ``"linear"`` over several adapters needs equal ranks
    (``r`` and ``rank_pattern``).

    Args:
        configs: the adapter configs, as dicts (``adapter_config.json``) or PEFT config objects.
        names: the adapters' names for messages (adapter names or folders), one per config.
        weights: one weight per adapter, or None for 1.0 each.
        combination: ``"cat"`` or ``"linear"``.
        option: the option's name in messages (``combination_type`` in process).

    Returns:
        ``(weights as a list, problems)``; every problem found, at once.

    Example:
        >>> combination_problems([{"r": 8, "use_dora": True}, {"r": 8}], ["a", "b"], [0.5, 0.5], "cat")[1]
        ["DoRA adapters cannot be weighted or combined (their magnitudes do not add): ['a']"]
    """
    weights, problems = check_weights(len(configs), weights, combination, option=option)
    if problems:
        return weights, problems
    if len(configs) <= 1 and all(w == 1 for w in weights):
        return weights, problems
    dora = [n for n, c in zip(names, configs) if config_value(c, "use_dora", False)]
    if dora:
        problems.append(f"DoRA adapters cannot be weighted or combined (their magnitudes do not add): {dora}")
    ia3 = [n for n, c in zip(names, configs) if str(config_value(c, "peft_type", "")) == "IA3"]
    if ia3:
        problems.append(f"IA3 adapters cannot be weighted or combined (their scalings multiply): {ia3}")
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
