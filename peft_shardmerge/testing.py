"""Test and demo helpers: tiny random models and adapters built from configs, for the demo, the tests and the
benchmarks (no library module imports this one)."""

from __future__ import annotations

import torch

from .api.quiet import quiet_libraries
from .verify.logits import IMAGE_TOKEN, model_class, model_inputs, token_ids

#: architectures with a tiny config; hidden sizes are multiples of 64 so bitsandbytes' CPU kernels apply
ARCHITECTURES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3",
    "phi3",
    "gpt2",
    "bert",
    "t5",
    "llava",
    "qwen2_vl",
)


def tiny_config(arch: str = "llama", **overrides):
    """A small transformers config of the given architecture.

    Args:
        arch: ``"llama"``, ``"mistral"``, ``"qwen2"`` (tied embeddings, attention biases), ``"qwen3"`` (q/k norms),
            the mixtures of experts ``"mixtral"`` and ``"qwen3_moe"``, ``"gemma2"``, ``"gemma3"`` (tied),
            ``"phi3"`` (fused qkv and gate/up) or ``"gpt2"`` (Conv1D layers), and ``"bert"``, ``"t5"``, ``"llava"``,
            ``"qwen2_vl"`` (:data:`ARCHITECTURES`).
        **overrides: config fields to change (``hidden_size``, ``num_hidden_layers``, ...).

    Returns:
        The config object.

    Raises:
        ValueError: unknown architecture.

    Example:
        >>> tiny_config("llama").hidden_size
        128
    """
    import copy

    import transformers

    if arch in _FLAT:  # a copy: a config may change its lists in place
        name, fields = _FLAT[arch]
        return getattr(transformers, name)(**{**copy.deepcopy(fields), **overrides})
    if arch in _NESTED:
        return _NESTED[arch](overrides)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")


#: a tiny Llama-like decoder's sizes (Llama and Qwen2 text models)
_DECODER = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
#: the fields every tiny causal LM shares
_COMMON = dict(vocab_size=512, bos_token_id=1, eos_token_id=2)
#: the smaller decoder of the vision-language models
_VL_TEXT = dict(_DECODER, vocab_size=512, hidden_size=64, intermediate_size=128)

#: the architectures of one flat config: the transformers class and its fields
_FLAT = {
    "llama": ("LlamaConfig", dict(_COMMON, **_DECODER, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(_COMMON, **_DECODER, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(_COMMON, **_DECODER, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(_COMMON, **_DECODER, head_dim=32, tie_word_embeddings=False)),
    "mixtral": (
        "MixtralConfig",
        dict(_COMMON, **_DECODER, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            _COMMON,
            **_DECODER,
            head_dim=32,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
    ),
    "gemma2": ("Gemma2Config", dict(_COMMON, **_DECODER, head_dim=32, sliding_window=128)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(_COMMON, **_DECODER, head_dim=32, sliding_window=128, architectures=["Gemma3ForCausalLM"]),
    ),
    "phi3": ("Phi3Config", dict(_COMMON, **_DECODER, pad_token_id=0, tie_word_embeddings=False)),
    "gpt2": ("GPT2Config", dict(_COMMON, n_embd=128, n_layer=2, n_head=4, n_positions=256)),
    "bert": (
        "BertConfig",
        dict(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=128,
            architectures=["BertForMaskedLM"],
        ),
    ),
    "t5": (
        "T5Config",
        dict(
            vocab_size=512,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
            architectures=["T5ForConditionalGeneration"],
        ),
    ),
}


def _tiny_llava(overrides: dict):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        projection_dim=32,
    )
    kw = dict(
        vision_config=vision,
        text_config=LlamaConfig(**_VL_TEXT),
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        architectures=["LlavaForConditionalGeneration"],
    )
    return LlavaConfig(**{**kw, **overrides})


def _tiny_qwen2_vl(overrides: dict):
    from transformers import Qwen2VLConfig

    vision = dict(
        depth=2,
        embed_dim=32,
        hidden_size=64,
        num_heads=4,
        mlp_ratio=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
    )
    kw = dict(
        text_config=dict(_VL_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}),
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
        architectures=["Qwen2VLForConditionalGeneration"],
    )
    return Qwen2VLConfig(**{**kw, **overrides})


#: the architectures whose config holds others (a vision tower and a text model)
_NESTED = {"llava": _tiny_llava, "qwen2_vl": _tiny_qwen2_vl}


def build_base(
    folder: str,
    arch: str = "llama",
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
    seed: int = 0,
    **overrides,
) -> str:
    """Build a random tiny causal LM and save it as a transformers checkpoint.

    Args:
        folder: where to save it.
        arch: see :func:`tiny_config`.
        dtype: dtype of the saved weights.
        max_shard_size: shard the checkpoint (e.g. ``"200KB"``); one file when None.
        seed: random seed.
        **overrides: config fields.

    Returns:
        ``folder``.

    Raises:
        ValueError: unknown architecture.
        OSError: the folder cannot be written.
    """
    with quiet_libraries():
        torch.manual_seed(seed)
        config = tiny_config(arch, **overrides)
        cls = model_class(config)
        model = (cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)).to(dtype)
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(folder, **kwargs)
        return folder


def build_tokenizer(folder: str, vocab_size: int = 512) -> str:
    """Train a tiny SentencePiece tokenizer (Llama's kind: ``tokenizer.model``, byte fallback, a chat template) on
    made-up text and save it into ``folder``, beside a tiny base: what a GGUF output (and llama.cpp) needs.

    Args:
        folder: the model folder.
        vocab_size: the tokenizer's size (at most the model's ``vocab_size``; the converter pads the rest).

    Returns:
        ``folder``.

    Example:
        >>> import os, tempfile
        >>> sorted(os.listdir(build_tokenizer(tempfile.mkdtemp())))
        ['special_tokens_map.json', 'tokenizer.model', 'tokenizer_config.json']
    """
    import io
    import json
    import os
    import random

    import sentencepiece as spm

    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "be", "da", "str", "ing", "tion", "er", "th"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    text = [" ".join(rng.choice(words) for _ in range(12)) + f". {rng.randint(0, 999)}" for _ in range(2000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
    )
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    )
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "chat_template": template, **special}
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
    return folder


def default_targets(arch: str) -> list[str]:
    """The usual LoRA target modules of an architecture.

    Args:
        arch: ``"llama"``, ``"qwen2"`` or ``"gpt2"``.

    Returns:
        Module names for ``LoraConfig(target_modules=...)``.

    Example:
        >>> default_targets("gpt2")
        ['c_attn', 'c_proj', 'c_fc']
    """
    if arch == "gpt2":
        return ["c_attn", "c_proj", "c_fc"]
    if arch == "bert":
        return ["query", "value", "intermediate.dense"]
    if arch == "t5":
        return ["q", "v", "wi", "wo"]
    if arch == "llava":  # text and vision attention, the Conv2d patch embedding, the projector
        return ["q_proj", "v_proj", "patch_embedding", "linear_1"]
    if arch == "qwen2_vl":  # text attention, vision qkv, the Conv3d patch embedding
        return ["q_proj", "v_proj", "qkv", "patch_embed.proj"]
    return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(
    base_folder: str, folder: str, *, arch: str | None = None, seed: int = 1, noise: float = 0.02, **lora_kwargs
) -> str:
    """Build a LoRA adapter on a saved base, with every trainable tensor moved off its initial value
    (as after training), and save it with ``save_pretrained``.

    Args:
        base_folder: a checkpoint from :func:`build_base`.
        folder: where to save the adapter.
        arch: the base's architecture (for the default targets); read from the config when None.
        seed: random seed.
        noise: standard deviation of the change added to every trainable tensor.
        **lora_kwargs: :class:`peft.LoraConfig` fields (``r``, ``lora_alpha``, ``target_modules``,
            ``use_rslora``, ``modules_to_save``, ...).

    Returns:
        ``folder``.

    Raises:
        ValueError: PEFT rejects the LoRA settings (e.g. a target module that does not exist).
        OSError: the folder cannot be written.
    """
    with quiet_libraries():
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(base_folder)
        arch = arch or config.model_type
        torch.manual_seed(seed)
        model = model_class(config).from_pretrained(base_folder, dtype=torch.float32)
        kw = dict(r=8, lora_alpha=16, target_modules=default_targets(arch))
        kw.update(lora_kwargs)
        peft_model = get_peft_model(model, LoraConfig(**kw))
        perturb_trainable(peft_model, noise)
        peft_model.save_pretrained(folder)
        return folder


def perturb_trainable(model, noise: float = 0.1) -> None:
    """Move every trainable tensor of a model off its initial value, as training would (LoRA B starts at zero,
    IA3 at one, trainable-token rows at the base rows).

    Args:
        model: a PEFT model.
        noise: standard deviation of the change.

    Returns:
        None.

    Example:
        >>> lin = torch.nn.Linear(2, 2); before = lin.weight.clone(); perturb_trainable(lin)
        >>> bool((lin.weight != before).any())
        True
    """
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * noise)


def compare_logits(base_folder: str, adapter_folder: str, merged_folder: str, *, seed: int = 0) -> float:
    """Largest absolute difference between the merged model's logits and base + adapter's (unmerged, fp32).

    Args:
        base_folder: the base checkpoint.
        adapter_folder: the adapter.
        merged_folder: the merged checkpoint.
        seed: seed for the random token ids.

    Returns:
        max |logits(merged) - logits(PeftModel(base, adapter))|, both computed in float32.

    Raises:
        OSError: a folder cannot be loaded by transformers or PEFT.
    """
    with quiet_libraries():
        from peft import PeftModel
        from transformers import AutoConfig

        cls = model_class(AutoConfig.from_pretrained(base_folder))
        base = cls.from_pretrained(base_folder, dtype=torch.float32)
        ref_model = PeftModel.from_pretrained(base, adapter_folder).eval()
        merged = cls.from_pretrained(merged_folder, dtype=torch.float32).eval()
        inputs = model_inputs(merged.config, seed=seed)
        with torch.no_grad():
            ref = ref_model(**inputs).logits
            got = merged(**inputs).logits
        return float((ref - got).abs().max())


__all__ = [
    "ARCHITECTURES",
    "IMAGE_TOKEN",
    "tiny_config",
    "build_base",
    "build_adapter",
    "build_tokenizer",
    "default_targets",
    "model_class",
    "model_inputs",
    "perturb_trainable",
    "token_ids",
    "compare_logits",
]
