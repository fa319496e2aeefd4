"""What the model class says about a checkpoint: module types, embeddings, ties and which weights bnb quantizes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    """Facts about a model's structure, taken from its class instantiated on the meta device.

    Attributes:
        available: False when the class could not be built (then the other fields are empty and the
            planner falls back to the adapter config and tensor shapes).
        architecture: the class name, e.g. ``"LlamaForCausalLM"``.
        transposed: weight names stored as ``[in, out]`` (GPT-2 style ``Conv1D``).
        linear_weights: weight names of ``nn.Linear``/``Conv1D`` modules bitsandbytes would quantize.
        tied: tied weight pairs, ``{target: source}`` (e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``).
        input_embedding: the input embedding's weight name.
        output_embedding: the output embedding's weight name.
        state_names: every parameter/buffer name the class expects.
        shapes: the expected shape of each of them.
        tie_enabled: whether the config ties the output embedding to the input embedding.
    """

    available: bool = False
    architecture: str = ""
    transposed: set[str] = field(default_factory=set)
    linear_weights: set[str] = field(default_factory=set)
    tied: dict[str, str] = field(default_factory=dict)
    input_embedding: str | None = None
    output_embedding: str | None = None
    state_names: set[str] = field(default_factory=set)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    tie_enabled: bool = False


def inspect_model(folder: "str | object") -> ModelInfo:
    """Build the checkpoint's model class on the meta device (no memory, no weights) and read its structure.

    Never runs code from the checkpoint (``trust_remote_code`` stays off): a custom architecture yields
    ``ModelInfo(available=False)``.

    Args:
        folder: a folder with ``config.json``, or a transformers config object.

    Returns:
        The :class:`ModelInfo`.

    Raises:
        Nothing: failures are logged and reported as ``available=False``.

    Example:
        >>> info = inspect_model("./tiny-gpt2")   # doctest: +SKIP
        >>> "transformer.h.0.attn.c_attn.weight" in info.transposed   # doctest: +SKIP
        True
    """
    try:
        import torch
        from torch import nn
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
        from transformers.pytorch_utils import Conv1D
        from transformers.quantizers.base import get_keys_to_not_convert

        if isinstance(folder, str):
            config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        else:
            import copy

            config = copy.deepcopy(folder)
            for sub in (config, getattr(config, "text_config", None)):
                if sub is not None and getattr(sub, "quantization_config", None) is not None:
                    del sub.quantization_config
        model = None
        for auto in (AutoModelForCausalLM, AutoModel):
            try:
                with torch.device("meta"):
                    model = auto.from_config(config, trust_remote_code=False)
                break
            except (ValueError, KeyError):
                continue
        if model is None:
            raise ValueError(f"no Auto class knows {type(config).__name__}")
    except Exception as e:  # noqa: BLE001 - any failure only disables the structural hints
        log.warning("could not build the model class for %s (%s); using the adapter config alone", folder, e)
        return ModelInfo()
    info = ModelInfo(available=True, architecture=type(model).__name__)
    state = model.state_dict()
    info.state_names = set(state.keys())
    info.shapes = {k: tuple(v.shape) for k, v in state.items()}
    text = getattr(config, "get_text_config", lambda: config)()
    info.tie_enabled = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    skip = set(get_keys_to_not_convert(model))
    for name, module in model.named_modules():
        if isinstance(module, Conv1D):
            info.transposed.add(f"{name}.weight")
        if (isinstance(module, Conv1D) or type(module) is nn.Linear) and not any(
            name == s or name.endswith("." + s) or name.startswith(s + ".") for s in skip
        ):
            info.linear_weights.add(f"{name}.weight")
    info.tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    names = {id(m): n for n, m in model.named_modules()}
    emb_in, emb_out = model.get_input_embeddings(), model.get_output_embeddings()
    info.input_embedding = f"{names[id(emb_in)]}.weight" if emb_in is not None and id(emb_in) in names else None
    info.output_embedding = f"{names[id(emb_out)]}.weight" if emb_out is not None and id(emb_out) in names else None
    return info
