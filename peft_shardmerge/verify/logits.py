"""Comparing a merged checkpoint's logits with base + adapter run by transformers and PEFT (``verify``'s extra
check)."""

from __future__ import annotations

import os

import torch

from .recompute import merge_settings, settle_stored_base

#: the largest relative logits error left UNCHECKED, not FAILED, when the merge read 4-bit weights from bitsandbytes'
#: CPU repacking (their block scales off by up to 2^-9 and re-quantized): the 16-bit tolerance
REPACK_TOLERANCE = 3e-2
#: the image placeholder token of the random inputs for vision-language models (and of the tiny test configs)
IMAGE_TOKEN = 500


def model_class(config):
    """The transformers class a config's checkpoint loads into: its ``architectures`` entry when transformers
    has it, else the causal-LM, seq2seq or image-text-to-text Auto class that knows the config, else
    ``AutoModel`` (see :func:`~peft_shardmerge.support.model_info.model_classes`).

    Args:
        config: a transformers config.

    Returns:
        A class with ``from_pretrained``.

    Example:
        >>> from transformers import T5Config
        >>> model_class(T5Config(architectures=["T5ForConditionalGeneration"])).__name__
        'T5ForConditionalGeneration'
    """
    from ..support.model_info import model_classes

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
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "pixel_values": pixels,
            "image_grid_thw": torch.tensor([[t, h, w]]),
            "mm_token_type_ids": (ids == IMAGE_TOKEN).int(),
        }
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

    Example:
        >>> token_ids(batch=1, length=4).shape
        torch.Size([1, 4])
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=g)


def check_logits(
    folder: str,
    base: str,
    adapters: list[str],
    prompts: list[str] | None,
    tolerance: float | None,
    config: dict,
    record: dict | None,
    report,
) -> None:
    """Compare the merged model's logits with PeftModel(base, adapter) in fp32, over the 4-bit base (loaded by
    transformers + bitsandbytes and dequantized by transformers) when the merge used one; add the result to
    ``report``. A NaN error fails. A model without an LM head (``BertModel``, a sentence-transformers checkpoint) is
    compared on its hidden states instead (see :func:`model_outputs`). When base + adapter cannot be loaded or run
    as the reference, nothing is compared and the reason goes to ``report.unchecked`` (the verdict UNCHECKED).

    Args:
        folder: the merged checkpoint.
        base: the base checkpoint.
        adapters: the adapters (compared only for a single adapter of weight 1).
        prompts: texts to compare on (tokenizer from ``folder`` or ``base``); two random inputs when None.
        tolerance: largest accepted relative error; default 1e-4 for fp32 checkpoints, 3e-2 for 16-bit.
        config: the checkpoint's ``config.json``.
        record: the ``merge`` section of its record, or None.
        report: the :class:`~peft_shardmerge.verify.report.VerifyReport` to add checks, notes and problems to.

    Raises:
        Exception: transformers cannot load or run the merged checkpoint (the caller lists it as a problem).
    """
    from transformers import AutoConfig

    options, _ = merge_settings(record, None)
    options, _ = settle_stored_base(options, record, base)  # the recomputation notes what it settled
    if options is None:
        return
    if options.get("task_vectors"):
        report.notes.append(
            "logits not compared: the merge combined adapters by a task-vector method (the recomputation covers it)"
        )
        return
    if len(adapters) > 1 or (options["weights"] or [1.0]) != [1.0]:
        report.notes.append("logits not compared: the merge combined weighted adapters (the recomputation covers it)")
        return
    if options["nf4"] and options["nf4"].get("blocksize", 64) != 64:
        report.notes.append(
            "logits not compared: transformers loads 4-bit bases with blocksize 64 only (the recomputation covers it)"
        )
        return
    cls = model_class(AutoConfig.from_pretrained(folder))
    quantized = (record or {}).get("quantize")  # loaded as it is served: its dtype, its quantized layers
    merged = cls.from_pretrained(folder, dtype="auto" if quantized else torch.float32).eval()
    try:
        ref = reference_model(cls, base, adapters[0], options, _vocab_size(merged.config))
    except Exception as e:  # without a reference nothing is wrong, only unchecked
        return _no_reference(report, e)
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
            try:
                want = model_outputs(ref(**inputs))
            except Exception as e:  # the reference cannot run: unchecked, not failed
                return _no_reference(report, e)
            got = _merged_outputs(merged, inputs, quantized, report)
            if got is None:
                return
            errors += [float((got[k] - w).abs().max() / w.abs().max().clamp_min(1e-12)) for k, w in want.items()]
    worst = max(errors) if all(e == e for e in errors) else float("nan")  # max() would drop a NaN
    compared = "logits" if list(want) == ["logits"] else f"hidden states ({', '.join(want)})"
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    tol = tolerance if tolerance is not None else (1e-4 if dtype == "float32" else 3e-2)
    against = "base + adapter" + (" (4-bit base)" if options["base_precision"] == "nf4" else "")
    report.logits_max_rel_err = worst
    if quantized and tolerance is None and worst == worst:  # the format's own error: measured, not judged
        report.checks.append(
            f"{compared} of the {quantized['format']} model vs {against} on {what}: max relative error {worst:.2e} "
            "(the format's own error; its stored bytes are what the recomputation compares)"
        )
        return
    report.checks.append(f"{compared} vs {against} on {what}: max relative error {worst:.2e} (tolerance {tol:g})")
    repacked = len((record or {}).get("cpu_repacked") or ())
    if not worst <= tol and repacked and worst <= REPACK_TOLERANCE:  # the reference is not the base merged
        report.unchecked.append(
            f"{compared} differ from {against} by {worst:.2e} > {tol:g}, "
            f"within what the {repacked} "
            "4-bit weight(s) read from bitsandbytes' CPU repacking (bf16 block scales) explain"
        )
    elif not worst <= tol:  # a NaN error fails too
        report.problems.append(f"{compared} differ from {against}: max relative error {worst:.2e} > {tol:g}")


def _merged_outputs(merged, inputs: dict, quantized: dict | None, report) -> dict[str, torch.Tensor] | None:
    """The merged model's outputs; None where a quantized model's format kernel cannot run on this machine
    (bitsandbytes' CPU 4-bit matmul wants whole groups of 32), noted: its logits are measured, never judged."""
    try:
        return model_outputs(merged(**inputs))
    except Exception as e:
        if not quantized:
            raise
        report.notes.append(
            f"logits not compared: the {quantized['format']} model does not run here ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160]}); its stored bytes are what the recomputation compares"
        )
        return None


def model_outputs(out) -> dict[str, torch.Tensor]:
    """What verify compares of a forward's output, in float32: the logits; for a model without an LM head
    (``BertModel``, ``T5Model``), its last hidden state, plus the pooled output and the encoder's last hidden state
    where it has them.

    Args:
        out: a transformers model output (or a PEFT model's).

    Returns:
        ``{name: tensor}``, e.g. ``{"logits": ...}`` or ``{"last_hidden_state": ..., "pooler_output": ...}``.

    Raises:
        TypeError: the output has none of these.

    Example:
        >>> from transformers.modeling_outputs import BaseModelOutputWithPooling
        >>> sorted(model_outputs(BaseModelOutputWithPooling(last_hidden_state=torch.ones(1, 2, 4),
        ...                                                 pooler_output=torch.ones(1, 4))))
        ['last_hidden_state', 'pooler_output']
    """
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return {"logits": logits.float()}
    names = ("last_hidden_state", "pooler_output", "encoder_last_hidden_state")
    found = {n: getattr(out, n, None) for n in names}
    found = {n: t.float() for n, t in found.items() if isinstance(t, torch.Tensor)}
    if not found:
        raise TypeError(f"{type(out).__name__} has no logits and no {', '.join(names)} to compare")
    return found


def _vocab_size(config) -> int | None:
    """The text vocabulary of a transformers config (a multimodal config's text part)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None)


def _no_reference(report, error: Exception) -> None:
    """Record that base + adapter could not serve as the outputs' reference: UNCHECKED with the reason (a message
    that only introduces its details, such as torch's "Error(s) in loading state_dict for ...:", with the first)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        lines[0] = f"{lines[0]} {lines[1]}"
    why = f"{type(error).__name__}: {lines[0][:300]}" if lines else type(error).__name__
    report.unchecked.append(f"logits not compared: base + adapter could not be run as the reference ({why})")


def reference_model(cls, base: str, adapter: str, options: dict, vocab_size: int | None = None):
    """PeftModel(base, adapter) in fp32; when the merge used a 4-bit base, the base is loaded in 4-bit by
    transformers + bitsandbytes (from the dtype the merge quantized) and dequantized by transformers. A base
    whose vocabulary the adapter resized is resized first, as before training (``resize_token_embeddings``; the
    adapter's saved embedding layers then replace the rows).

    Args:
        cls: the transformers model class.
        base: the base checkpoint.
        adapter: the adapter folder.
        options: the merge's settings from :func:`~peft_shardmerge.verify.recompute.merge_settings`.
        vocab_size: the merged checkpoint's vocabulary (None: the base's).

    Returns:
        The PeftModel, in eval mode.

    Raises:
        MissingDependencyError: a 4-bit base is needed and bitsandbytes is not installed.
    """
    from peft import PeftModel

    if options["base_precision"] != "nf4":
        return PeftModel.from_pretrained(_resized(dequantized_base(cls, base), vocab_size), adapter).eval()
    from transformers import BitsAndBytesConfig

    from ..quant.nf4 import require_bitsandbytes

    require_bitsandbytes()
    nf4, held = options["nf4"] or {}, options["held"]
    quantized = cls.from_pretrained(
        base,
        device_map="cpu",
        dtype=getattr(torch, held) if held else "auto",
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=nf4.get("quant_type", "nf4"),
            bnb_4bit_use_double_quant=bool(nf4.get("double_quant", True)),
            bnb_4bit_compute_dtype=torch.float32,
        ),
    )
    return PeftModel.from_pretrained(_resized(exact_dequantize(quantized), vocab_size), adapter).eval()


def _resized(model: torch.nn.Module, vocab_size: int | None) -> torch.nn.Module:
    """The model with ``vocab_size`` token embeddings where it has another number (the new rows are the adapter's)."""
    embeddings = model.get_input_embeddings()
    if vocab_size and embeddings is not None and embeddings.num_embeddings != vocab_size:
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    return model


def exact_dequantize(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' ``model.dequantize()`` of a bitsandbytes model, with every 4-bit weight then set to the
    format's definition applied to its packed bytes (:func:`~peft_shardmerge.quant.nf4.dequantize_state`, the function
    the merge itself uses), in float32: bitsandbytes' CPU ``dequantize_4bit``, which ``dequantize()`` calls, is wrong
    on rows that are not whole 64-value blocks. Run no forward before: that may repack the weights.

    Args:
        model: a transformers model loaded with a bitsandbytes ``quantization_config``.

    Returns:
        The same model, dequantized, in float32.

    Raises:
        MissingDependencyError: bitsandbytes is not installed.
    """
    from ..quant.bnb_layers import bnb_layer_kind, dequantize

    exact = {
        name: dequantize(m, torch.device("cpu")) for name, m in model.named_modules() if bnb_layer_kind(m) == "4bit"
    }
    model = model.dequantize()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, value in exact.items():
            weight = modules[name].weight  # as dequantize() left it: its dtype, its layout ([out, in])
            weight.copy_(value.to(weight.dtype).reshape(weight.shape))
    return model.float()


def dequantized_base(cls, base: str) -> torch.nn.Module:
    """The base as transformers loads it, in float32: a quantized checkpoint dequantized by transformers itself
    (bitsandbytes' ``model.dequantize()``; ``Mxfp4Config(dequantize=True)``), never run through a quantized CPU
    kernel. A fine-grained FP8 base is not given to transformers' FP8 loader, which takes the block as ``rows //
    scale rows`` (wrong, or refused, for a side that is not a multiple of the block, e.g. 320 rows): each FP8 weight
    is dequantized by the format's definition in float32 (the merge's own
    :class:`~peft_shardmerge.quant.fp8.Fp8Decoder`) and transformers loads the model from those tensors.

    Args:
        cls: the transformers model class.
        base: the base checkpoint folder.

    Returns:
        The float32 model.

    Raises:
        OSError: the checkpoint cannot be read.
    """
    from ..checkpoint.base_folder import open_checkpoint
    from ..quant.formats import quant_method

    src = open_checkpoint(base)
    if src.quantized is None:
        return cls.from_pretrained(base, dtype=torch.float32)
    method = quant_method(src.config["quantization_config"])
    if method == "bitsandbytes":
        return exact_dequantize(cls.from_pretrained(base, device_map="cpu"))
    if method == "fp8":
        return _fp8_base(cls, src)
    from transformers import Mxfp4Config

    return cls.from_pretrained(base, quantization_config=Mxfp4Config(dequantize=True)).float()


def _fp8_base(cls, src) -> torch.nn.Module:
    """The FP8 base in float32 loaded by transformers from a state dict of the checkpoint's dequantized view (each
    FP8 weight by its :class:`~peft_shardmerge.quant.fp8.Fp8Decoder`, in float32); raises if keys are lost."""
    from dataclasses import replace

    from transformers import AutoConfig

    from ..io.safetensors_io import RowReader
    from ..support.model_info import build_on_meta

    config = AutoConfig.from_pretrained(src.folder)
    for sub in (config, getattr(config, "text_config", None)):
        if sub is not None and getattr(sub, "quantization_config", None) is not None:
            del sub.quantization_config
    state = {}
    with RowReader() as reader:
        for t in src.tensors:
            rows = t.shape[0] if t.shape else 1
            value = (
                replace(t.decoder, dtype=torch.float32).rows(reader, 0, rows)
                if t.decoder is not None
                else reader.read(t)
            )
            state[t.name] = value.float() if value.is_floating_point() else value
    concrete = type(build_on_meta(config, cls))  # from_pretrained without a folder needs the model's own class
    model, info = concrete.from_pretrained(
        None, config=config, state_dict=state, dtype=torch.float32, output_loading_info=True
    )
    lost = sorted(info["missing_keys"]) + sorted(info["unexpected_keys"])
    if lost:
        raise ValueError(f"the dequantized FP8 base does not load into {concrete.__name__}: {', '.join(lost[:5])}")
    return model.float()
