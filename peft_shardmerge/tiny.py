"""Tiny random models and adapters built from configs, for the demo, the tests and the benchmarks."""

from __future__ import annotations

import torch

#: architectures with a tiny config; hidden sizes are multiples of 64 so bitsandbytes' CPU kernels apply
ARCHITECTURES = ("llama", "qwen2", "gpt2")

def tiny_config(arch: str = "llama", **overrides):
    """A small transformers config of the given architecture.

    Args:
        arch: ``"llama"``, ``"qwen2"`` (tied embeddings, attention biases) or ``"gpt2"`` (Conv1D layers).
        **overrides: config fields to change (``hidden_size``, ``num_hidden_layers``, ...).

    Returns:
        The config object.

    Raises:
        ValueError: unknown architecture.

    Example:
        >>> tiny_config("llama").hidden_size
        128
    """
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=512, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        kw = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
        return LlamaConfig(**{**common, **kw, **overrides})
    if arch == "qwen2":
        kw = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
        return Qwen2Config(**{**common, **kw, **overrides})
    if arch == "gpt2":
        kw = dict(n_embd=128, n_layer=2, n_head=4, n_positions=256)
        return GPT2Config(**{**common, **kw, **overrides})
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")

def build_base(folder: str, arch: str = "llama", *, dtype: torch.dtype = torch.float32,
               max_shard_size: int | str | None = None, seed: int = 0, **overrides) -> str:
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

    Example:
        >>> build_base("/tmp/tiny-llama")   # doctest: +SKIP
        '/tmp/tiny-llama'
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder

def default_targets(arch: str) -> list[str]:
    """The usual LoRA target modules of an architecture.

    Args:
        arch: ``"llama"``, ``"qwen2"`` or ``"gpt2"``.

    Returns:
        Module names for ``LoraConfig(target_modules=...)``.

    Raises:
        Nothing.

    Example:
        >>> default_targets("gpt2")
        ['c_attn', 'c_proj', 'c_fc']
    """
    if arch == "gpt2":
        return ["c_attn", "c_proj", "c_fc"]
    return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

def build_adapter(base_folder: str, folder: str, *, arch: str | None = None, seed: int = 1,
                  noise: float = 0.02, **lora_kwargs) -> str:
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

    Example:
        >>> build_adapter("/tmp/tiny-llama", "/tmp/tiny-adapter", r=8, lora_alpha=16)   # doctest: +SKIP
        '/tmp/tiny-adapter'
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = arch or AutoConfig.from_pretrained(base_folder).model_type
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    kw = dict(r=8, lora_alpha=16, target_modules=default_targets(arch))
    kw.update(lora_kwargs)
    peft_model = get_peft_model(model, LoraConfig(**kw))
    with torch.no_grad():
        for _, p in peft_model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * noise)
    peft_model.save_pretrained(folder)
    return folder

def token_ids(vocab_size: int = 512, batch: int = 2, length: int = 16, seed: int = 0) -> torch.Tensor:
    """Reproducible random token ids for comparing logits.

    Args:
        vocab_size: ids are drawn from ``[3, vocab_size)`` (past the special tokens).
        batch: rows.
        length: tokens per row.
        seed: random seed.

    Returns:
        An int64 tensor ``[batch, length]``.

    Raises:
        Nothing.

    Example:
        >>> token_ids(batch=1, length=4).shape
        torch.Size([1, 4])
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=g)

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

    Example:
        >>> compare_logits("base", "adapter", "merged") < 1e-4   # doctest: +SKIP
        True
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    ref_model = PeftModel.from_pretrained(base, adapter_folder).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_folder, dtype=torch.float32).eval()
    ids = token_ids(merged.config.vocab_size, seed=seed)
    with torch.no_grad():
        ref = ref_model(ids).logits
        got = merged(ids).logits
    return float((ref - got).abs().max())

__all__ = ["ARCHITECTURES", "tiny_config", "build_base", "build_adapter", "default_targets", "token_ids",
           "compare_logits"]
