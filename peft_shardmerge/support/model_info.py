"""What the model class says about a checkpoint: module types, embeddings, ties and which weights bnb quantizes."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

from .claims import layer_kind
from .ties import tie_enabled

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
        unconverted: the modules transformers' quantizers leave unquantized by default (the output layer, as
            ``get_keys_to_not_convert`` finds it), and those holding a mixture's fused experts (``*.experts``, which
            its FP8 quantizer converts as a whole), by their names in memory.
        tied: tied weight pairs, ``{target: source}`` (e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``).
        input_embedding: the input embedding's weight name.
        output_embedding: the output embedding's weight name.
        state_names: every parameter/buffer name the class expects.
        buffers: every buffer the class holds, persistent or not (``embeddings.position_ids``, ``inv_freq``).
        shapes: the expected shape of each of them.
        tie_enabled: whether the config ties the output embedding to the input embedding.
        layers: the allowlist's kind of each module that holds parameters (``{"model.layers.0.mlp.up_proj":
            "Linear"}``; see :func:`~peft_shardmerge.support.claims.layer_kind`).
    """

    available: bool = False
    architecture: str = ""
    transposed: set[str] = field(default_factory=set)
    linear_weights: set[str] = field(default_factory=set)
    unconverted: tuple[set[str], set[str]] = field(default_factory=lambda: (set(), set()))
    tied: dict[str, str] = field(default_factory=dict)
    input_embedding: str | None = None
    output_embedding: str | None = None
    state_names: set[str] = field(default_factory=set)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    tie_enabled: bool = False
    conversions: tuple = ((), (), (), "")
    layers: dict[str, str] = field(default_factory=dict)
    buffers: set[str] = field(default_factory=set)
    _adjust_keys: object = field(default=None, repr=False, compare=False)

    def load_ignores(self, keys: list[str], *, missing: bool = False) -> set[str]:
        """The keys ``from_pretrained`` drops without a warning, asked of transformers (the class's
        ``_keys_to_ignore_on_load_unexpected`` / ``_keys_to_ignore_on_load_missing`` and the buffers it moved,
        e.g. ``position_ids`` or ``rotary_emb.inv_freq`` that older checkpoints store).

        Args:
            keys: in-memory names a checkpoint has that the class does not (``missing=False``), or that the class
                expects and the checkpoint lacks (``missing=True``).
            missing: which of the two ``keys`` are.

        Returns:
            The subset of ``keys`` transformers does not report; empty when the class is unknown.

        Example:
            >>> ModelInfo().load_ignores(["embeddings.position_ids"])
            set()
        """
        if self._adjust_keys is None or not keys:
            return set()
        from types import SimpleNamespace

        # the two sets of transformers' LoadStateDictInfo that _adjust_missing_and_unexpected_keys filters in place
        report = SimpleNamespace(
            missing_keys=set(keys) if missing else set(), unexpected_keys=set() if missing else set(keys)
        )
        self._adjust_keys(report)
        return set(keys) - (report.missing_keys if missing else report.unexpected_keys)

    def memory_names(self, file_keys: "list[str]") -> dict[str, tuple[str, bool]]:
        """The in-memory name each checkpoint key loads into, as ``from_pretrained`` renames it (transformers'
        conversion mappings: e.g. LLaVA's ``language_model.model.*`` -> ``model.language_model.*``).

        Args:
            file_keys: tensor names as stored in the checkpoint.

        Returns:
            ``{file key: (in-memory name, converted)}``; ``converted`` is True when the key is one part of a tensor
            that loading builds from several (fused MoE experts and the like). Identity when the class is unknown.
        """
        renamings, converters, _, prefix = self.conversions
        if not renamings and not converters:
            return {k: (k, False) for k in file_keys}
        from transformers.core_model_loading import rename_source_key

        meta = dict.fromkeys(self.state_names, True)
        out = {}
        for key in file_keys:
            name, pattern = rename_source_key(key, list(renamings), list(converters), prefix or None, meta)
            out[key] = (name, pattern is not None)
        return out

    def file_name(self, memory_name: str) -> str:
        """The name ``save_pretrained`` writes an in-memory tensor under (the reverse of :meth:`memory_names`).

        Args:
            memory_name: a ``state_dict`` name.

        Returns:
            The checkpoint key.
        """
        _, _, reverse, _ = self.conversions
        if not reverse:
            return memory_name
        from transformers.core_model_loading import apply_renamings

        return apply_renamings(memory_name, list(reverse))


def model_classes(config, model_class: type | None = None) -> list[type]:
    """The transformers classes a config's checkpoint can be built as, best first: the given one, the config's
    ``architectures`` (transformers classes only, never remote code), then the Auto classes of causal LMs,
    seq2seq LMs and vision-language models that know the config, then ``AutoModel``.

    Args:
        config: a transformers config.
        model_class: a class to try first (a loaded model's own).

    Returns:
        The classes.

    Example:
        >>> from transformers import GPT2Config
        >>> model_classes(GPT2Config())[0].__name__
        'AutoModelForCausalLM'
    """
    import transformers

    out = [model_class] if model_class is not None else []
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls is not None and hasattr(cls, "_from_config"):
            out.append(cls)
    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForImageTextToText"):
        cls = getattr(transformers, auto, None)
        if cls is not None and type(config) in cls._model_mapping:
            out.append(cls)
    out.append(transformers.AutoModel)
    return out


def build_on_meta(config, model_class: type | None = None):
    """The checkpoint's model built on the meta device (no memory, no weights), as the first of
    :func:`model_classes` that accepts the config.

    Args:
        config: a transformers config (without ``quantization_config``).
        model_class: a class to try first.

    Returns:
        The model, or None when no class accepts the config.

    Example:
        >>> from transformers import GPT2Config
        >>> type(build_on_meta(GPT2Config(n_layer=1))).__name__
        'GPT2LMHeadModel'
    """
    import torch

    for cls in model_classes(config, model_class):
        try:
            with torch.device("meta"):
                if cls.__name__.startswith("Auto"):
                    return cls.from_config(config, trust_remote_code=False)
                return cls._from_config(config)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return None


def inspect_model(folder: "str | object", model_class: type | None = None) -> ModelInfo:
    """Build the checkpoint's model class on the meta device (no memory, no weights) and read its structure.

    Never runs code from the checkpoint (``trust_remote_code`` stays off): a custom architecture yields
    ``ModelInfo(available=False)``.

    Args:
        folder: a folder with ``config.json``, or a transformers config object.
        model_class: the transformers class to build (a loaded model's class); by default the config's
            ``architectures`` entry, else the first Auto class that knows the config.

    Returns:
        The :class:`ModelInfo`; a failure is logged and reported as ``available=False``, never raised.
    """
    try:
        from torch import nn
        from transformers import AutoConfig
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
        model = build_on_meta(config, model_class)
        if model is None:
            raise ValueError(f"no Auto class knows {type(config).__name__}")
    except Exception as e:  # any failure only disables the structural hints
        log.warning("could not build the model class for %s (%s); using the adapter config alone", folder, e)
        return ModelInfo()
    info = ModelInfo(available=True, architecture=type(model).__name__)
    info.conversions = _conversions(model)
    state = model.state_dict()
    info.state_names = set(state.keys())
    info.buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    info._adjust_keys = getattr(model, "_adjust_missing_and_unexpected_keys", None)  # transformers' own rule
    info.shapes = {k: tuple(v.shape) for k, v in state.items()}
    info.tie_enabled = tie_enabled(config)  # the one tie policy (ties.py), also the plan's
    skip = set(get_keys_to_not_convert(model))
    info.unconverted = (skip, {n for n, _ in model.named_modules() if n.endswith(".experts")})
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None:
            info.layers[name] = layer_kind(module)
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


def _conversions(model) -> tuple:
    """transformers' key renamings for this class: (load renamings, load converters, save renamings, prefix)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except ImportError:  # transformers < 5 renames nothing on load
        return (), (), (), ""
    try:
        load = get_model_conversion_mapping(model)
        save = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
    except Exception as e:  # only the renaming hints are lost
        log.warning("could not read transformers' key conversions for %s (%s)", type(model).__name__, e)
        return (), (), (), ""
    reverse = [t.reverse_transform() for t in save[::-1]]
    return (
        tuple(t for t in load if isinstance(t, WeightRenaming)),
        tuple(t for t in load if isinstance(t, WeightConverter)),
        tuple(t for t in reverse if isinstance(t, WeightRenaming)),
        getattr(model, "base_model_prefix", "") or "",
    )


def in_file_names(info: ModelInfo, file_keys: list[str]):
    """Translate the structure facts of ``info`` (in-memory names) into the checkpoint's own key names.

    transformers renames some checkpoints' keys on load (LLaVA's ``language_model.model.*`` becomes
    ``model.language_model.*``, Qwen2-VL's ``model.*`` becomes ``model.language_model.*``); adapters use the
    in-memory names. The merged checkpoint keeps the base's names.

    Args:
        info: the model structure.
        file_keys: the base checkpoint's tensor names.

    Returns:
        ``(info in file names, function in-memory name -> file name, parts)``; names the checkpoint does not hold
        go through the reverse renaming ``save_pretrained`` applies; ``parts`` maps an in-memory tensor that the
        checkpoint stores as several keys (fused MoE experts stored per expert) to those keys.

    Example:
        >>> info, to_file, parts = in_file_names(ModelInfo(), ["w"])
        >>> to_file("w"), parts
        ('w', {})
    """
    if not info.available:
        return info, lambda name: name, {}
    memory = info.memory_names(file_keys)
    by_memory = {m: f for f, (m, converted) in memory.items() if not converted}
    parts: dict[str, list[str]] = {}
    for f, (m, converted) in memory.items():
        if converted:
            parts.setdefault(m, []).append(f)

    def to_file(name: str) -> str:
        return by_memory.get(name) or info.file_name(name)

    out = copy.copy(info)
    out.transposed = {to_file(n) for n in info.transposed}
    out.linear_weights = {to_file(n) for n in info.linear_weights}
    out.tied = {to_file(t): to_file(s) for t, s in info.tied.items()}
    out.input_embedding = to_file(info.input_embedding) if info.input_embedding else None
    out.output_embedding = to_file(info.output_embedding) if info.output_embedding else None
    return out, to_file, parts
