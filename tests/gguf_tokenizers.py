"""Hugging Face tokenizers written into a model folder, for the GGUF tests: a tiny SentencePiece one trained here
(Llama-, Gemma- and Phi-3-style), and the BPE tokenizers of Qwen2 and Llama 3 rebuilt from llama.cpp's vocabulary
files (``models/ggml-vocab-*.gguf``), which llama.cpp's converter recognizes by its pre-tokenizer hash.

Each is built once per machine into ``gguf_refs.cache_dir()`` and copied into the folder asked for.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from pathlib import Path

from filelock import FileLock

from tests.gguf_refs import cache_dir, llama_cpp_source

#: the vocabulary size of the SentencePiece tokenizers (the tiny model's ``vocab_size`` must cover the tokens)
SPM_VOCAB_SIZE = 512
#: the tokens of llama.cpp's Qwen2 vocabulary (151,643 BPE tokens, 3 special ones, then padding: the config's size)
QWEN2_VOCAB_SIZE = 151936
#: the tokens of llama.cpp's Llama 3 vocabulary (128,000 BPE tokens and 256 special ones)
LLAMA3_VOCAB_SIZE = 128256

#: bumped when a tokenizer built here changes, so that a stale cache is not used
_VERSION = "1"

#: the chat templates written into tokenizer_config.json
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] "
    "+ ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' + message['content'] "
    "+ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

#: Gemma's first pieces (ids 0-3 are pad, eos, bos, unk) and whether its tokenizer_config marks each special; the
#: others are the ones llama.cpp's converter marks as control tokens by their look, and a user-defined "▁▁"
_GEMMA_PIECES = (
    ("<mask>", False),
    ("[@BOS@]", False),
    ("<start_of_turn>", True),
    ("<end_of_turn>", True),
    ("<unused0>", False),
    ("<unused1>", False),
    ("▁▁", False),
)
#: Phi-3's added tokens, after the SentencePiece vocabulary (special or not, as in its tokenizer_config)
_PHI3_ADDED = (
    ("<|endoftext|>", True),
    ("<|assistant|>", True),
    ("<|placeholder1|>", True),
    ("<|end|>", True),
    ("<|user|>", True),
    ("<|system|>", True),
    ("<|custom|>", False),
)


def _training_text(n: int = 3000) -> list[str]:
    """Sentences of made-up words (ASCII, Latin-1, CJK), digits and punctuation, the same every time."""
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "be", "da", "fu", "go", "hi", "je", "ze", "qu"]
    syllables += ["str", "ing", "tion", "er", "th", "ch", "ö", "é", "語", "ñ"]
    words = ["the", "quick", "brown", "fox", "merge", "adapter", "shard", "tensor", "llama", "hello", "world"]
    words += ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    return [
        " ".join(rng.choice(words) for _ in range(12)) + rng.choice(".,!?") + " " + str(rng.randint(0, 9999))
        for _ in range(n)
    ]


def _built(name: str, build) -> Path:
    """The cached folder ``name`` (``build(folder)`` fills it on first use, once across processes)."""
    home = cache_dir() / f"gguf-tokenizers-{_VERSION}" / name
    home.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(home) + ".lock"):
        if not (home / ".ready").exists():
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir()
            build(home)
            (home / ".ready").touch()
    return home


def _copy_into(cached: Path, folder: str) -> None:
    """Copy the tokenizer files of a cached folder into ``folder``."""
    os.makedirs(folder, exist_ok=True)
    for f in sorted(cached.iterdir()):
        if f.name != ".ready":
            shutil.copyfile(f, os.path.join(folder, f.name))


def _dump(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def _decoder_entry(content: str, special: bool) -> dict:
    """An ``added_tokens_decoder`` entry of tokenizer_config.json."""
    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)
    return {"content": content, **flags, "special": special}


# ----------------------------------------------------------------------------------------------------------------
# SentencePiece


def _train_spm(folder: Path, style: str) -> None:
    """Train the tiny SentencePiece model of a style into ``folder/tokenizer.model``."""
    import sentencepiece as spm

    if style == "gemma":
        ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>")
        extra = dict(user_defined_symbols=[p for p, _ in _GEMMA_PIECES])
    else:
        ids = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
        extra = {}
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_text()),
        model_writer=model,
        vocab_size=SPM_VOCAB_SIZE,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        num_threads=1,
        minloglevel=2,
        **ids,
        **extra,
    )
    (folder / "tokenizer.model").write_bytes(model.getvalue())


def _spm_config(style: str) -> dict:
    """tokenizer_config.json of a style, as the real checkpoints' (``added_tokens_decoder`` included)."""
    if style == "gemma":
        decoder = {"0": ("<pad>", True), "1": ("<eos>", True), "2": ("<bos>", True), "3": ("<unk>", True)}
        decoder.update({str(4 + i): piece for i, piece in enumerate(_GEMMA_PIECES)})
        tokens = dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
        return {
            "add_bos_token": True,
            "add_eos_token": False,
            "added_tokens_decoder": {k: _decoder_entry(c, s) for k, (c, s) in decoder.items()},
            **tokens,
            "chat_template": GEMMA_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 8192,
            "spaces_between_special_tokens": False,
            "tokenizer_class": "GemmaTokenizer",
            "use_default_system_prompt": False,
        }
    decoder = {"0": ("<unk>", True), "1": ("<s>", True), "2": ("</s>", True)}
    template = LLAMA_CHAT_TEMPLATE
    if style == "phi3":
        decoder.update({str(SPM_VOCAB_SIZE + i): t for i, t in enumerate(_PHI3_ADDED)})
        template = PHI3_CHAT_TEMPLATE
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {k: _decoder_entry(c, s) for k, (c, s) in decoder.items()},
        "bos_token": "<s>",
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>" if style == "phi3" else "</s>",
        "legacy": False,
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>" if style == "phi3" else None,
        "padding_side": "left",
        "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }


def _build_spm(folder: Path, style: str, fast: bool) -> None:
    _train_spm(folder, style)
    config = _spm_config(style)
    _dump(folder / "tokenizer_config.json", config)
    if fast:  # transformers converts the SentencePiece model to its tokenizer.json (added tokens included)
        from transformers import AutoTokenizer

        scratch = folder / "fast"
        AutoTokenizer.from_pretrained(str(folder)).save_pretrained(str(scratch))
        shutil.move(scratch / "tokenizer.json", folder / "tokenizer.json")
        shutil.rmtree(scratch)
    _dump(folder / "special_tokens_map.json", {k: v for k, v in config.items() if k.endswith("_token") and v})


def spm_vocab_size(style: str = "llama") -> int:
    """The tokens of :func:`write_spm_tokenizer`'s tokenizer of ``style`` (its model's ``vocab_size`` at least).

    Example:
        >>> spm_vocab_size("phi3")
        519
    """
    return SPM_VOCAB_SIZE + (len(_PHI3_ADDED) if style == "phi3" else 0)


def write_spm_tokenizer(folder: str, style: str = "llama", *, fast: bool = False, **config) -> int:
    """Write a tiny SentencePiece tokenizer (``tokenizer.model``, tokenizer_config.json with a chat template, bos,
    eos and ``add_bos_token``, special_tokens_map.json) into ``folder``.

    Args:
        folder: the model folder.
        style: ``"llama"`` (unk, bos, eos as ids 0-2, Llama 2 and Mistral), ``"gemma"`` (pad, eos, bos, unk, then
            Gemma's control and user-defined pieces) or ``"phi3"`` (Llama's, and Phi-3's added tokens after the
            :data:`SPM_VOCAB_SIZE` pieces).
        fast: write the tokenizer.json transformers converts it to, too.
        **config: tokenizer_config.json fields to change (None removes one), e.g. ``add_prefix_space=True``.

    Returns:
        The number of tokens (:func:`spm_vocab_size`).
    """
    cached = _built(f"spm-{style}{'-fast' if fast else ''}", lambda home: _build_spm(home, style, fast))
    _copy_into(cached, folder)
    if config:
        path = Path(folder, "tokenizer_config.json")
        merged = {**json.loads(path.read_text(encoding="utf-8")), **config}
        _dump(path, {k: v for k, v in merged.items() if v is not None})
    return spm_vocab_size(style)


# ----------------------------------------------------------------------------------------------------------------
# BPE rebuilt from llama.cpp's vocabularies

#: the pre-tokenizer regexes of the two (Llama 3 groups digits by 3, Qwen2 splits every digit)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def _byte_level(**flags) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False, **flags}


def _read_vocab(name: str) -> tuple[list[str], list[int], list[str], str | None]:
    """``(tokens, token types, merges, chat template)`` of ``models/ggml-vocab-{name}.gguf``."""
    import gguf

    reader = gguf.GGUFReader(llama_cpp_source() / "models" / f"ggml-vocab-{name}.gguf")

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    types = reader.fields["tokenizer.ggml.token_type"]
    template = reader.fields.get("tokenizer.chat_template")
    return (
        strings("tokenizer.ggml.tokens"),
        [int(types.parts[i][0]) for i in types.data],
        strings("tokenizer.ggml.merges"),
        bytes(template.parts[-1]).decode("utf-8") if template else None,
    )


def _bpe_json(tokens, types, merges, *, normalizer, pre_regex, post, decoder, ignore_merges) -> tuple[dict, dict]:
    """tokenizer.json of a byte-level BPE vocabulary (normal tokens in the model, control ones added as special
    tokens, padding left out) and the ``added_tokens_decoder`` of its tokenizer_config.json."""
    import gguf

    vocab = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == gguf.TokenType.NORMAL}
    special = [(i, t) for i, (t, k) in enumerate(zip(tokens, types)) if k == gguf.TokenType.CONTROL]
    flags = dict(single_word=False, lstrip=False, rstrip=False, normalized=False)
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": ignore_merges,
        "vocab": vocab,
        "merges": merges,
    }
    split = {"type": "Split", "pattern": {"Regex": pre_regex}, "behavior": "Isolated", "invert": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": t, **flags, "special": True} for i, t in special],
        "normalizer": normalizer,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, _byte_level(trim_offsets=True)]},
        "post_processor": post,
        "decoder": decoder,
        "model": model,
    }
    return tokenizer, {str(i): _decoder_entry(t, True) for i, t in special}


def _build_qwen2(folder: Path) -> None:
    tokens, types, merges, template = _read_vocab("qwen2")
    tokenizer, decoder = _bpe_json(
        tokens,
        types,
        merges,
        normalizer={"type": "NFC"},
        pre_regex=_QWEN2_REGEX,
        post=_byte_level(),
        decoder=_byte_level(),
        ignore_merges=False,
    )
    _dump(folder / "tokenizer.json", tokenizer)
    _dump(
        folder / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "added_tokens_decoder": decoder,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "chat_template": template,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>",
            "errors": "replace",
            "model_max_length": 32768,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )


def _build_llama3(folder: Path) -> None:
    tokens, types, merges, _ = _read_vocab("llama-bpe")
    bos = "<|begin_of_text|>"
    template = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [tokens.index(bos)], "tokens": [bos]}},
    }
    tokenizer, decoder = _bpe_json(
        tokens,
        types,
        merges,
        normalizer=None,
        pre_regex=_LLAMA3_REGEX,
        post={"type": "Sequence", "processors": [_byte_level(add_prefix_space=True, use_regex=True), template]},
        decoder=_byte_level(add_prefix_space=True, trim_offsets=True, use_regex=True),
        ignore_merges=True,
    )
    _dump(folder / "tokenizer.json", tokenizer)
    _dump(
        folder / "tokenizer_config.json",
        {
            "added_tokens_decoder": decoder,
            "bos_token": bos,
            "chat_template": LLAMA3_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": True,
            "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )


def write_qwen2_tokenizer(folder: str) -> int:
    """Write Qwen2's BPE tokenizer (tokenizer.json, tokenizer_config.json with its chat template), rebuilt from
    llama.cpp's ``ggml-vocab-qwen2.gguf``, into ``folder``.

    Returns:
        The model's ``vocab_size`` (:data:`QWEN2_VOCAB_SIZE`, the padded size of Qwen2's configs).
    """
    _copy_into(_built("qwen2", _build_qwen2), folder)
    return QWEN2_VOCAB_SIZE


def write_llama3_tokenizer(folder: str) -> int:
    """Write Llama 3's BPE tokenizer (tokenizer.json, tokenizer_config.json with a chat template), rebuilt from
    llama.cpp's ``ggml-vocab-llama-bpe.gguf``, into ``folder``.

    Returns:
        The model's ``vocab_size`` (:data:`LLAMA3_VOCAB_SIZE`).
    """
    _copy_into(_built("llama3", _build_llama3), folder)
    return LLAMA3_VOCAB_SIZE


def write_unknown_bpe_tokenizer(folder: str) -> int:
    """Write a tiny byte-level BPE tokenizer trained here, whose pre-tokenizer hash llama.cpp's converter does not
    know.

    Returns:
        The number of tokens.
    """

    def build(home: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_training_text(500), trainer)
        tok.save(str(home / "tokenizer.json"))
        _dump(
            home / "tokenizer_config.json",
            {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512},
        )

    cached = _built("unknown-bpe", build)
    _copy_into(cached, folder)
    return len(json.loads((cached / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"])


#: architecture -> tokenizer its tiny base gets (a SentencePiece style, or a real BPE vocabulary)
TOKENIZERS = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen2",
    "qwen3_moe": "qwen2",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "phi3": "phi3",
    "llama3": "llama3",
}


def write_tokenizer(folder: str, kind: str) -> int:
    """The tokenizer of ``kind`` written into ``folder``; its number of tokens."""
    if kind == "qwen2":
        return write_qwen2_tokenizer(folder)
    if kind == "llama3":
        return write_llama3_tokenizer(folder)
    return write_spm_tokenizer(folder, kind)
