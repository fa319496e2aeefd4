"""What the allowlist (``peft_shardmerge.support.claims``) claims about a conformance case, read through its public
data (``is_claimed``, ``layer_kind``, ``config_variants``): the matrix then asserts that claimed cases are merged,
never refused."""

from __future__ import annotations

try:
    from peft_shardmerge.support import claims as support
except ImportError:  # an allowlist is optional to the matrix: without one nothing is claimed
    support = None

#: config fields whose variants the allowlist has no name for; a case setting one is never counted as claimed
_UNNAMED_FIELDS = (
    "alora_invocation_tokens",
    "use_qalora",
    "velora_config",
    "monteclora_config",
    "use_bdlora",
    "kasa_config",
    "layer_replication",
    "arrow_config",
    "ensure_weight_tying",
    "megatron_config",
)


def base_layer_kind(module) -> str:
    """The allowlist's kind of the layer a PEFT layer wraps (its class name without an allowlist).

    Args:
        module: a PEFT tuner layer.

    Returns:
        E.g. ``"Linear"``, ``"Conv1D"``, ``"parameter 2-D"``, ``"Conv2d (groups=8)"``.

    Raises:
        Nothing.

    Example:
        >>> import torch
        >>> base_layer_kind(torch.nn.Linear(2, 2))
        'Linear'
    """
    base = module if type(module).__name__ == "ParamWrapper" else getattr(module, "get_base_layer", lambda: module)()
    if support is not None:
        return support.layer_kind(base)
    return type(base).__name__


def is_claimed(configs: list, layer_kinds: set, path: str, several: bool, peft_merges: bool) -> bool:
    """Whether the allowlist claims a case on a path: its PEFT type on each targeted layer kind with each variant
    it uses, and each adapter-wide option, all claimed; and PEFT itself can merge it.

    Args:
        configs: the case's PEFT config objects.
        layer_kinds: kinds of the base layers PEFT wrapped (:func:`base_layer_kind`).
        path: ``"merge_checkpoint"`` or one of the in-process paths.
        several: the case merges several adapters at once.
        peft_merges: PEFT's own ``merge_and_unload`` succeeds on the case.

    Returns:
        True when claimed.

    Raises:
        Nothing.

    Example:
        >>> is_claimed([], set(), "merge_checkpoint", False, False)
        False
    """
    if support is None or not peft_merges or not configs:
        return False
    # merge_and_save(base_precision="original") merges from disk through merge_checkpoint: the disk claims apply
    where = support.DISK if path in ("merge_checkpoint", "merge_and_save:original") else support.IN_PROCESS
    for config in configs:
        c = config.to_dict()
        if any(c.get(f) not in (None, False, [], {}) for f in _UNNAMED_FIELDS):
            return False
        if c.get("init_lora_weights", True) not in (True, False, "gaussian"):
            return False
        peft_type = support.peft_type_of(config)
        if peft_type not in support.PEFT_TYPES or not layer_kinds:
            return False
        layer_variants, adapter_variants = support.config_variants(config)
        if c.get("use_dora"):
            layer_variants.append("DoRA")
        if c.get("lora_bias"):
            layer_variants.append("lora_bias")
        if peft_type == "IA3" and c.get("feedforward_modules"):
            layer_variants.append("feedforward")
        if several:
            adapter_variants.append("several adapters")
            layer_variants.append("several adapters")  # claimed per layer kind too (not on disk for parameters)
        for kind in layer_kinds:
            for variant in layer_variants or ["plain"]:
                if not support.is_claimed(peft_type, kind, variant, where):
                    return False
        for variant in adapter_variants:
            if not support.is_claimed(peft_type, support.ADAPTER, variant, where):
                return False
    return True
