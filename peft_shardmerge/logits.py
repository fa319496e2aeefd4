"""Comparing a merged checkpoint's logits with base + adapter run by transformers and PEFT (``verify``'s extra
check)."""

from __future__ import annotations

import os

import torch

from .recompute import merge_settings

#: the image placeholder token of the random inputs for vision-language models (and of the tiny test configs)
IMAGE_TOKEN = 500


def model_class(config):
    """The transformers class a config's checkpoint loads into: its ``architectures`` entry when transformers
    has it, else the causal-LM, seq2seq or image-text-to-text Auto class that knows the config, else
    ``AutoModel`` (see :func:`~peft_shardmerge.model_info.model_classes`).

    Args:
        config: a transformers config.

    Returns:
        A class with ``from_pretrained``.

    Raises:
        Nothing.

    Example:
        >>> from transformers import T5Config
        >>> model_class(T5Config(architectures=["T5ForConditionalGeneration"])).__name__
        'T5ForConditionalGeneration'
    """
    from .model_info import model_classes

    return model_classes(config)[0]  # AutoModel, last, always knows a transformers config


def model_inputs(config, *, seed: int = 0, images: bool = True) -> dict:
    """Reproducible forward inputs for a model: token ids, plus decoder ids for encoder-decoders and an image
    (placeholder token :data:`IMAGE_TOKEN`) for Llava and Qwen2-VL configs.

    Args:
        config: the model's config.
        seed: random seed.
        images: add pixel inputs for vision-language models (so LoRA on the vision tower counts).

    Returns:
        Keyword arguments for the model's forward.

    Raises:
        Nothing.

    Example:
        >>> from transformers import T5Config
        >>> sorted(model_inputs(T5Config(vocab_size=512)))
        ['decoder_input_ids', 'input_ids']
    """
    text = getattr(config, "get_text_config", lambda: config)()
    vocab = min(text.vocab_size, IMAGE_TOKEN)
    ids = token_ids(vocab, seed=seed)
    if getattr(config, "is_encoder_decoder", False):
        return {"input_ids": ids, "decoder_input_ids": token_ids(vocab, length=8, seed=seed + 1)}
    g = torch.Generator().manual_seed(seed)
    if images and config.model_type == "llava":
        vision = config.vision_config
        n = (vision.image_size // vision.patch_size) ** 2
        ids = torch.cat([ids[:1, :3], torch.full((1, n), IMAGE_TOKEN), ids[:1, 3:]], dim=1)
        pixels = torch.randn(1, 3, vision.image_size, vision.image_size, generator=g)
        return {"input_ids": ids, "pixel_values": pixels}
    if images and config.model_type == "qwen2_vl":
        v = config.vision_config
        t, h, w = 1, 4, 4
        n = t * h * w // v.spatial_merge_size**2
        ids = torch.cat([ids[:1, :3], torch.tensor([[502] + [IMAGE_TOKEN] * n + [503]]), ids[:1, 3:]], dim=1)
        pixels = torch.randn(t * h * w, v.in_channels * v.temporal_patch_size * v.patch_size**2, generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels,
                "image_grid_thw": torch.tensor([[t, h, w]]), "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}
    return {"input_ids": ids}


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


def check_logits(folder: str, base: str, adapters: list[str], prompts: list[str] | None, tolerance: float | None,
                 config: dict, record: dict | None, report) -> None:
    """Compare the merged model's logits with PeftModel(base, adapter) in fp32, over the 4-bit base (loaded by
    transformers + bitsandbytes and dequantized by transformers) when the merge used one; add the result to
    ``report``. A NaN error fails.

    Args:
        folder: the merged checkpoint.
        base: the base checkpoint.
        adapters: the adapters (compared only for a single adapter of weight 1).
        prompts: texts to compare on (tokenizer from ``folder`` or ``base``); two random inputs when None.
        tolerance: largest accepted relative error; default 1e-4 for fp32 checkpoints, 3e-2 for 16-bit.
        config: the checkpoint's ``config.json``.
        record: the ``merge`` section of its record, or None.
        report: the :class:`~peft_shardmerge.verify.VerifyReport` to add checks, notes and problems to.

    Returns:
        None.

    Raises:
        Exception: transformers or PEFT cannot load the models (the caller lists it as a problem).

    Example:
        >>> check_logits("merged", "base", ["adapter"], None, None, {}, None, report)   # doctest: +SKIP
    """
    from transformers import AutoConfig

    options, _ = merge_settings(record, None)
    if options is None:
        return
    if len(adapters) > 1 or (options["weights"] or [1.0]) != [1.0]:
        report.notes.append("logits not compared: the merge combined weighted adapters (the recomputation covers it)")
        return
    if options["nf4"] and options["nf4"].get("blocksize", 64) != 64:
        report.notes.append("logits not compared: transformers loads 4-bit bases with blocksize 64 only (the "
                            "recomputation covers it)")
        return
    cls = model_class(AutoConfig.from_pretrained(folder))
    merged = cls.from_pretrained(folder, dtype=torch.float32).eval()
    ref = reference_model(cls, base, adapters[0], options)
    if prompts:
        from transformers import AutoTokenizer

        tok_dir = folder if os.path.exists(os.path.join(folder, "tokenizer_config.json")) else base
        tok = AutoTokenizer.from_pretrained(tok_dir)
        batches = []
        for p in prompts:
            ids = tok(p, return_tensors="pt")["input_ids"]
            extra = model_inputs(merged.config, images=False)  # decoder ids of an encoder-decoder
            extra["input_ids"] = ids
            batches.append(extra)
        what = f"{len(prompts)} prompt(s)"
    else:
        batches = [model_inputs(merged.config, seed=s) for s in range(2)]
        what = "2 random inputs" + (" (with an image)" if "pixel_values" in batches[0] else "")
    errors = []
    with torch.no_grad():
        for inputs in batches:
            want = ref(**inputs).logits.float()
            got = merged(**inputs).logits.float()
            errors.append(float((got - want).abs().max() / want.abs().max().clamp_min(1e-12)))
    worst = max(errors) if all(e == e for e in errors) else float("nan")  # max() would drop a NaN
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    tol = tolerance if tolerance is not None else (1e-4 if dtype == "float32" else 3e-2)
    against = "base + adapter" + (" (4-bit base)" if options["base_precision"] == "nf4" else "")
    report.logits_max_rel_err = worst
    report.checks.append(f"logits vs {against} on {what}: max relative error {worst:.2e} (tolerance {tol:g})")
    if not worst <= tol:  # a NaN error fails too
        report.problems.append(f"logits differ from {against}: max relative error {worst:.2e} > {tol:g}")


def reference_model(cls, base: str, adapter: str, options: dict):
    """PeftModel(base, adapter) in fp32; when the merge used a 4-bit base, the base is loaded in 4-bit by
    transformers + bitsandbytes (from the dtype the merge quantized) and dequantized by transformers.

    Args:
        cls: the transformers model class.
        base: the base checkpoint.
        adapter: the adapter folder.
        options: the merge's settings from :func:`~peft_shardmerge.recompute.merge_settings`.

    Returns:
        The PeftModel, in eval mode.

    Raises:
        MissingDependencyError: a 4-bit base is needed and bitsandbytes is not installed.

    Example:
        >>> ref = reference_model(LlamaForCausalLM, "base", "adapter", options)   # doctest: +SKIP
    """
    from peft import PeftModel

    if options["base_precision"] != "nf4":
        return PeftModel.from_pretrained(dequantized_base(cls, base), adapter).eval()
    from transformers import BitsAndBytesConfig

    from .quant import require_bitsandbytes

    require_bitsandbytes()
    nf4, held = options["nf4"] or {}, options["held"]
    quantized = cls.from_pretrained(base, device_map="cpu", dtype=getattr(torch, held) if held else "auto",
                                    quantization_config=BitsAndBytesConfig(
                                        load_in_4bit=True, bnb_4bit_quant_type=nf4.get("quant_type", "nf4"),
                                        bnb_4bit_use_double_quant=bool(nf4.get("double_quant", True)),
                                        bnb_4bit_compute_dtype=torch.float32))
    return PeftModel.from_pretrained(quantized.dequantize().float(), adapter).eval()


def dequantized_base(cls, base: str) -> torch.nn.Module:
    """The base as transformers loads it, in float32: a quantized checkpoint dequantized by transformers itself
    (bitsandbytes' ``model.dequantize()``; ``FineGrainedFP8Config``/``Mxfp4Config(dequantize=True)``), never run
    through a quantized CPU kernel. FP8 weights are then recomputed from the stored tensors by transformers'
    ``_dequantize_fp8_weight``, because its CPU loader takes the block as ``rows // scale rows``, wrong for a side
    that is not a multiple of the block.

    Args:
        cls: the transformers model class.
        base: the base checkpoint folder.

    Returns:
        The float32 model.

    Raises:
        OSError: the checkpoint cannot be read.

    Example:
        >>> dequantized_base(LlamaForCausalLM, "tiny-bnb-4bit").dtype   # doctest: +SKIP
        torch.float32
    """
    from .quantized import quant_method
    from .sources import open_checkpoint

    src = open_checkpoint(base)
    if src.quantized is None:
        return cls.from_pretrained(base, dtype=torch.float32)
    method = quant_method(src.config["quantization_config"])
    if method == "bitsandbytes":
        return cls.from_pretrained(base, device_map="cpu").dequantize().float()
    from transformers import FineGrainedFP8Config, Mxfp4Config

    config = FineGrainedFP8Config(dequantize=True) if method == "fp8" else Mxfp4Config(dequantize=True)
    model = cls.from_pretrained(base, quantization_config=config).float()
    if method == "fp8":
        _fp8_weights(model, src.quantized.tensors)
    return model


def _fp8_weights(model: torch.nn.Module, tensors) -> None:
    """Set every FP8 weight of ``model`` to transformers' ``_dequantize_fp8_weight`` of its stored weight and scales
    (the pair and block the checkpoint's view found)."""
    from safetensors import safe_open
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    params = dict(model.named_parameters())
    for t in tensors:
        if t.decoder is None or t.name not in params:
            continue
        weight, scales = t.decoder.stored
        with safe_open(weight.path, "pt") as a, safe_open(scales.path, "pt") as b:
            value = _dequantize_fp8_weight(a.get_tensor(weight.name), b.get_tensor(scales.name),
                                           t.decoder.block, torch.float32)
        with torch.no_grad():
            params[t.name].copy_(value.to(params[t.name].dtype))
