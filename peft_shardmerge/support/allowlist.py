"""The allowlist as data: every (PEFT type, layer, variant, path) peft-shardmerge claims to merge, and how each
adapter config field is classified (inert, handled, refused); :mod:`peft_shardmerge.support.claims` checks inputs
against it."""

from __future__ import annotations

DISK, IN_PROCESS = "disk", "in_process"
PATHS = (DISK, IN_PROCESS)
#: the pseudo-layer of options that concern a whole adapter rather than one layer
ADAPTER = "(adapter)"

LORA_VARIANTS = ("plain", "rsLoRA", "rank/alpha pattern", "DoRA", "lora_bias")
#: (PEFT type, layers, variants, paths, doc): every combination listed is claimed and tested; nothing else is
SPEC: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...], str], ...] = (
    ("LORA", ("Linear", "Conv1D", "Conv2d", "Conv3d"), LORA_VARIANTS, PATHS, "variants-layers.md"),
    ("LORA", ("Embedding",), ("plain", "rsLoRA", "rank/alpha pattern", "DoRA"), PATHS, "variants-layers.md"),
    ("LORA", ("Linear4bit",), ("plain", "rsLoRA", "rank/alpha pattern", "DoRA"), (IN_PROCESS,), "variants-layers.md"),
    ("LORA", ("Linear8bitLt",), ("plain", "rsLoRA", "rank/alpha pattern"), (IN_PROCESS,), "variants-layers.md"),
    (
        "LORA",
        ("parameter 2-D", "parameter 3-D"),
        ("plain", "rsLoRA", "rank/alpha pattern"),
        PATHS,
        "variants-layers.md",
    ),
    ("LORA", (ADAPTER,), ("modules_to_save", "bias='all'/'lora_only'"), PATHS, "variants-layers.md"),
    ("LORA", (ADAPTER,), ("residual init (PiSSA, OLoRA, CorDA, LoftQ)",), (IN_PROCESS,), "variants-layers.md"),
    ("LORA", (ADAPTER,), ("trainable_token_indices",), PATHS, "variants-vocabulary.md"),
    ("LORA", (ADAPTER,), ("several adapters",), PATHS, "variants-several-adapters.md"),
    (
        "LORA",
        ("Linear", "Conv1D", "Conv2d", "Conv3d", "Embedding"),
        ("several adapters",),
        PATHS,
        "variants-several-adapters.md",
    ),
    (
        "LORA",
        ("Linear4bit", "Linear8bitLt", "parameter 2-D", "parameter 3-D"),
        ("several adapters",),
        (IN_PROCESS,),
        "variants-several-adapters.md",
    ),
    ("TRAINABLE_TOKENS", ("Embedding", "Linear"), ("plain",), PATHS, "variants-vocabulary.md"),
    ("LOHA", ("Linear",), ("plain", "rank/alpha pattern"), PATHS, "variants-other-peft.md"),
    ("LOKR", ("Linear",), ("plain", "rank/alpha pattern"), PATHS, "variants-other-peft.md"),
    ("VERA", ("Linear",), ("plain",), PATHS, "variants-other-peft.md"),
    ("VERA", ("Linear4bit",), ("plain",), (IN_PROCESS,), "variants-other-peft.md"),
    ("IA3", ("Linear", "Conv2d"), ("plain", "feedforward"), PATHS, "variants-other-peft.md"),
    ("IA3", ("Linear4bit",), ("plain", "feedforward"), (IN_PROCESS,), "variants-other-peft.md"),
    ("LOHA", (ADAPTER,), ("modules_to_save",), PATHS, "variants-other-peft.md"),
    ("LOKR", (ADAPTER,), ("modules_to_save",), PATHS, "variants-other-peft.md"),
    ("LOHA", (ADAPTER,), ("several adapters",), (IN_PROCESS,), "variants-several-adapters.md"),
    ("LOKR", (ADAPTER,), ("several adapters",), (IN_PROCESS,), "variants-several-adapters.md"),
    ("VERA", (ADAPTER,), ("several adapters",), (IN_PROCESS,), "variants-several-adapters.md"),
    ("LOHA", ("Linear",), ("several adapters",), (IN_PROCESS,), "variants-several-adapters.md"),
    ("LOKR", ("Linear",), ("several adapters",), (IN_PROCESS,), "variants-several-adapters.md"),
    ("VERA", ("Linear",), ("several adapters",), (IN_PROCESS,), "variants-several-adapters.md"),
    ("VERA", (ADAPTER,), ("projections not saved",), (IN_PROCESS,), "variants-other-peft.md"),
)

#: every claimed ``(peft_type, layer, variant, path)``: the allowlist as data
CLAIMS: frozenset[tuple[str, str, str, str]] = frozenset(
    (t, layer, v, p) for t, layers, variants, paths, _ in SPEC for layer in layers for v in variants for p in paths
)
#: the PEFT types with at least one claim
PEFT_TYPES: tuple[str, ...] = tuple(dict.fromkeys(t for t, *_ in SPEC))

#: config fields that do not change the merged weights (metadata, target selection, training-only settings)
INERT = {
    "task_type",
    "peft_type",
    "auto_mapping",
    "peft_version",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "lora_dropout",
    "rank_dropout",
    "module_dropout",
    "rank_dropout_scale",
    "vera_dropout",
    "runtime_config",
    "megatron_core",
    "qalora_group_size",
    "loftq_config",
    "eva_config",
    "corda_config",
    "lora_ga_config",
    "init_weights",
    "init_ia3_weights",
    "d_initial",
    "projection_prng_key",
}
#: config fields whose values the merge takes into account, per PEFT type
HANDLED = {
    "LORA": {
        "r",
        "lora_alpha",
        "fan_in_fan_out",
        "bias",
        "use_rslora",
        "modules_to_save",
        "init_lora_weights",
        "rank_pattern",
        "alpha_pattern",
        "trainable_token_indices",
        "use_dora",
        "lora_bias",
        "target_parameters",
    },
    "LOHA": {"r", "alpha", "rank_pattern", "alpha_pattern", "use_effective_conv2d", "modules_to_save"},
    "LOKR": {
        "r",
        "alpha",
        "rank_pattern",
        "alpha_pattern",
        "use_effective_conv2d",
        "decompose_both",
        "decompose_factor",
        "modules_to_save",
    },
    "VERA": {"r", "save_projection", "fan_in_fan_out", "bias", "modules_to_save"},
    "IA3": {"feedforward_modules", "fan_in_fan_out", "modules_to_save"},
    "TRAINABLE_TOKENS": {"token_indices"},
}
#: config fields that change the forward in a way no path merges, refused when set, with what to do instead
REFUSED = {
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) applies the adapter only after the "
    "invocation tokens; a merged model applies it everywhere, so it is not the aLoRA model",
    "use_qalora": "QA-LoRA (use_qalora) pools the inputs of a quantized layer; its delta is not a weight delta",
    "layer_replication": "layer_replication changes the layer structure and cannot be merged into the base layout",
    "megatron_config": "megatron_config builds Megatron parallel layers; merge a regular (non-Megatron) adapter",
    "arrow_config": "Arrow routing (arrow_config) mixes adapters per token; there is no single weight delta",
    "velora_config": "VeLoRA (velora_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "ensure_weight_tying": "ensure_weight_tying ties adapter layers across tied modules, which is not supported",
}
#: init_lora_weights values that leave the base as it was (the merge ignores how A and B started)
PLAIN_INITS = {True, False, "gaussian", "eva", "orthogonal"}
RESIDUAL_INITS = ("pissa", "olora", "corda", "loftq")
PROMPT_TYPES = {
    "PROMPT_TUNING",
    "MULTITASK_PROMPT_TUNING",
    "P_TUNING",
    "PREFIX_TUNING",
    "ADAPTION_PROMPT",
    "CPT",
    "CARTRIDGE",
}
INSTEAD = (
    "for it, load the base unquantized in fp32, use PEFT's own merge_and_unload() if PEFT can merge it, and "
    "save_pretrained() the result"
)
