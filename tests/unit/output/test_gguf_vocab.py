"""The tokenizer's GGUF keys (output/gguf_vocab.py) against llama.cpp's converter: for SentencePiece tokenizers
(Llama, Mistral, Gemma 2/3, Phi-3 styles) and the BPE tokenizers of Qwen2 and Llama 3, every ``tokenizer.*`` key
and value we write is byte for byte the converter's ``--vocab-only`` output, in its order; and the refusals."""

from __future__ import annotations

import ast
import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")

from peft_shardmerge.errors import InputError, UnsupportedError
from peft_shardmerge.output import gguf_vocab
from peft_shardmerge.output.gguf_vocab import add_tokenizer
from tests import gguf_tokenizers as tk
from tests.gguf_refs import converter_python, run_converter

#: a tiny decoder's sizes, for every architecture's config (the vocab-only conversion reads no weights)
_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=128,
)


def _config(folder: str, model_type: str, arch: str, vocab_size: int, **fields) -> dict:
    """Write a tiny ``config.json`` of a transformers model type into ``folder``; return the converter's hparams."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, **_SIZES, **fields)
    config.architectures = [arch]
    config.save_pretrained(folder)
    return AutoConfig.from_pretrained(folder).to_dict()


def _records(path: str) -> list[tuple[str, bytes]]:
    """Every key-value record of a GGUF file as ``(key, its bytes: key, type and value)``, in the file's order."""
    data = Path(path).read_bytes()
    assert data[:4] == b"GGUF"
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    assert n_tensors == 0
    at, out = 24, []
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(kind: int, at: int) -> int:
        if kind == 8:  # string
            return at + 8 + struct.unpack_from("<Q", data, at)[0]
        if kind == 9:  # array
            inner, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if inner in sizes:
                return at + count * sizes[inner]
            for _ in range(count):
                at = skip(inner, at)
            return at
        return at + sizes[kind]

    for _ in range(n_kv):
        start = at
        (length,) = struct.unpack_from("<Q", data, at)
        key = data[at + 8 : at + 8 + length].decode()
        at += 8 + length
        (kind,) = struct.unpack_from("<I", data, at)
        at = skip(kind, at + 4)
        out.append((key, data[start:at]))
    return out


def _ours(folder: str, hparams: dict, outfile: str) -> str:
    """Our vocab-only GGUF of ``folder``: the architecture key and the tokenizer's."""
    writer = gguf.GGUFWriter(outfile, hparams["model_type"])  # no tokenizer key depends on it
    add_tokenizer(writer, folder, hparams)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return outfile


def _tokenizer_records(path: str) -> list[tuple[str, bytes]]:
    return [(k, v) for k, v in _records(path) if k.startswith("tokenizer.")]


def _describe(path: str, key: str) -> str:
    """A key's value as gguf-py reads it, shortened, for a failure's message."""
    field = gguf.GGUFReader(path).fields.get(key)
    if field is None:
        return "(absent)"
    value = field.contents()
    return repr(value[:8] if isinstance(value, list) else value)[:300]


def assert_same_tokenizer(ours: str, reference: str) -> None:
    """Every ``tokenizer.*`` record of ``ours`` is byte for byte the reference's, in the same order."""
    got, want = _tokenizer_records(ours), _tokenizer_records(reference)
    assert [k for k, _ in got] == [k for k, _ in want], "keys or their order differ"
    for (key, a), (_, b) in zip(got, want):
        if a != b:
            raise AssertionError(f"{key}: ours {_describe(ours, key)}, converter's {_describe(reference, key)}")


# ----------------------------------------------------------------------------------------------------------------
# the cases: (name, model_type, HF architecture, tokenizer writer, config fields, edits of the tokenizer files)


def _no_bos_in_config(folder: str) -> None:
    """Llama 3 without bos_token in tokenizer_config.json: the converter's SpecialVocab takes the template's
    leading special token for bos and cls (gguf-py 0.19's only warns)."""
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    del config["bos_token"]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)


def _lowercase_normalizer(folder: str) -> None:
    """A tokenizer.json normalizer with the flags the converter's SpecialVocab writes (lowercase, strip accents)."""
    path = os.path.join(folder, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        tokenizer = json.load(f)
    bert = {"type": "BertNormalizer", "lowercase": False, "strip_accents": True}
    tokenizer["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Lowercase"}, bert]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tokenizer, f)


def _without_tokenizer_model(folder: str) -> None:
    """Only tokenizer.json: Llama's BPE with byte fallback, which the converter reads with gguf-py's LlamaHfVocab."""
    os.remove(os.path.join(folder, "tokenizer.model"))


def _spm(style, fast=False, **config):
    return lambda folder: tk.write_spm_tokenizer(folder, style, fast=fast, **config)


CASES = {
    # SentencePiece, no tokenizer.json: bos/eos ids from config.json
    "llama-spm": ("llama", "LlamaForCausalLM", _spm("llama"), {}, None),
    # with tokenizer.json (ids from its added tokens, add_bos from its template) and add_prefix_space
    "mistral-spm-fast": ("mistral", "MistralForCausalLM", _spm("llama", True, add_prefix_space=False), {}, None),
    # no tokenizer.model: the converter's _set_vocab_llama_hf
    "llama-hf-bpe": ("llama", "LlamaForCausalLM", _spm("llama", True), {}, _without_tokenizer_model),
    # the normalizer flags of the converter's SpecialVocab, and a vocab_size past the pieces (padding)
    "mixtral-spm-normalizer": (
        "mixtral",
        "MixtralForCausalLM",
        _spm("llama", True),
        {"vocab_size": 640, "num_local_experts": 2},
        _lowercase_normalizer,
    ),
    # Gemma's control and user-defined added tokens, no space prefix (and CodeGemma's infill ids for Gemma 1)
    "gemma2-spm": ("gemma2", "Gemma2ForCausalLM", _spm("gemma"), {}, None),
    "gemma-spm": ("gemma", "GemmaForCausalLM", _spm("gemma"), {}, None),
    "gemma3-spm": ("gemma3_text", "Gemma3ForCausalLM", _spm("gemma", True), {}, None),
    # Phi-3's own reading: added tokens from tokenizer_config.json and tokenizer.json, padded to vocab_size
    "phi3-spm": ("phi3", "Phi3ForCausalLM", _spm("phi3", True), {"vocab_size": 576, "pad_token_id": 512}, None),
    # the vocabulary sizes of CodeLlama (infill tokens) and Granite's small models (no bos added)
    "codellama-spm": ("llama", "LlamaForCausalLM", _spm("llama"), {"vocab_size": 32016}, None),
    "granite-size-spm": ("llama", "LlamaForCausalLM", _spm("llama"), {"vocab_size": 49152}, None),
    "qwen2-bpe": ("qwen2", "Qwen2ForCausalLM", tk.write_qwen2_tokenizer, {}, None),
    "llama3-bpe": ("llama", "LlamaForCausalLM", tk.write_llama3_tokenizer, {"bos_token_id": 128000}, None),
    "llama3-bpe-no-bos": ("llama", "LlamaForCausalLM", tk.write_llama3_tokenizer, {}, _no_bos_in_config),
    "qwen3-moe-bpe": (
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        tk.write_qwen2_tokenizer,
        {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32},
        None,
    ),
}


def _build(root: Path, name: str) -> tuple[str, dict]:
    """The model folder of a case (config.json and tokenizer files) and its hparams."""
    model_type, arch, write, fields, edit = CASES[name]
    folder = str(root / name)
    fields = {"vocab_size": write(folder), **fields}
    hparams = _config(folder, model_type, arch, **fields)
    if edit is not None:
        edit(folder)
    return folder, hparams


@pytest.fixture(scope="module")
def references(request, tmp_path_factory):
    """name -> (folder, hparams, the converter's vocab-only GGUF), converted on first use; in a run without xdist,
    the other selected cases convert meanwhile, two at a time."""
    converter_python()  # skips where the converter cannot be built
    root = tmp_path_factory.mktemp("gguf-vocab")
    pool = ThreadPoolExecutor(2)
    futures: dict = {}
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and "name" in getattr(getattr(item, "callspec", None), "params", {})
    ]
    ahead = [] if os.environ.get("PYTEST_XDIST_WORKER") else selected  # xdist: the other worker runs them

    def start(name: str) -> None:
        if name not in futures:
            folder, hparams = _build(root, name)
            out = str(root / f"{name}.converter.gguf")
            futures[name] = (folder, hparams, pool.submit(run_converter, folder, out, "f16", "--vocab-only"))

    def get(name: str) -> tuple[str, dict, str]:
        start(name)
        for each in ahead:
            try:
                start(each)
            except (Exception, pytest.skip.Exception):  # that case fails or skips when it runs, not this one
                pass
        folder, hparams, future = futures[name]
        return folder, hparams, future.result()

    yield get
    pool.shutdown(wait=True)


def _scalar(path: str, key: str):
    """A string, bool or uint32 key's value, read from its record (gguf-py's reader is slow on 150k tokens)."""
    record = dict(_records(path))[key]
    at = 8 + len(key)
    (kind,) = struct.unpack_from("<I", record, at)
    if kind == gguf.GGUFValueType.STRING:
        return record[at + 12 :].decode()
    if kind == gguf.GGUFValueType.BOOL:
        return bool(record[at + 4])
    assert kind == gguf.GGUFValueType.UINT32, kind
    return struct.unpack_from("<I", record, at + 4)[0]


def _fields(path: str) -> dict:
    """The ``tokenizer.*`` values of a small GGUF file, as gguf-py reads them."""
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if k.startswith("tokenizer.")}


def _normalizer_flags(path: str) -> None:
    fields = _fields(path)
    assert fields["tokenizer.ggml.normalizer.lowercase"] is False
    assert fields["tokenizer.ggml.normalizer.strip_accents"] is True
    assert fields["tokenizer.ggml.tokens"][-1] == "[PAD639]"


def _gemma_tokens(path: str) -> None:
    fields = _fields(path)
    assert [fields["tokenizer.ggml.token_type"][i] for i in (4, 5, 8, 10)] == [3, 3, 3, 4]  # control, user-defined
    assert fields["tokenizer.ggml.tokens"][10] == "  " and fields["tokenizer.ggml.add_space_prefix"] is False


def _phi3_tokens(path: str) -> None:
    fields = _fields(path)
    assert fields["tokenizer.ggml.tokens"][512:519] == [t for t, _ in tk._PHI3_ADDED]
    assert fields["tokenizer.ggml.token_type"][518] == 4 and fields["tokenizer.ggml.eos_token_id"] == 512


def _llama_hf_tokens(path: str) -> None:
    fields = _fields(path)  # LlamaHfVocab scores every token -1000 and types the byte tokens
    assert set(fields["tokenizer.ggml.scores"]) == {-1000.0} and fields["tokenizer.ggml.token_type"][3] == 6


def _key(key: str, value):
    """A check that the reference holds ``key`` with ``value``."""

    def check(path: str) -> None:
        assert _scalar(path, key) == value, key

    return check


def _has_tokens(path: str) -> None:
    assert "tokenizer.ggml.tokens" in dict(_tokenizer_records(path))


#: what a case's reference shows, so that the case reaches the converter's branch it is meant for
BRANCHES = {
    "llama-hf-bpe": _llama_hf_tokens,
    "mixtral-spm-normalizer": _normalizer_flags,
    "gemma2-spm": _gemma_tokens,
    "phi3-spm": _phi3_tokens,
    "codellama-spm": _key("tokenizer.ggml.eot_token_id", 32010),
    "granite-size-spm": _key("tokenizer.ggml.add_bos_token", False),
    "qwen2-bpe": _key("tokenizer.ggml.pre", "qwen2"),
    "llama3-bpe": _key("tokenizer.ggml.pre", "llama-bpe"),
    "llama3-bpe-no-bos": _key("tokenizer.ggml.bos_token_id", 128000),
    "qwen3-moe-bpe": _key("tokenizer.ggml.pre", "qwen2"),
}


@pytest.mark.slow  # the converter runs in a subprocess
@pytest.mark.parametrize("name", list(CASES))
def test_tokenizer_keys_are_the_converters(references, tmp_path, name):
    folder, hparams, reference = references(name)
    BRANCHES.get(name, _has_tokens)(reference)
    ours = _ours(folder, hparams, str(tmp_path / "ours.gguf"))
    assert_same_tokenizer(ours, reference)
    assert [k for k, _ in _records(ours) if not k.startswith("tokenizer.")] == ["general.architecture"]


def test_vocab_rows_as_gemma3s_converter_cuts_the_embedding(tmp_path):
    """SentencePiece: the vocabulary padded to the config's size; tokenizer.json: its tokens and added tokens."""
    spm, bpe = str(tmp_path / "spm"), str(tmp_path / "bpe")
    tk.write_spm_tokenizer(spm, "gemma")
    assert gguf_vocab.vocab_rows(spm, {"vocab_size": 640}) == 640
    assert gguf_vocab.vocab_rows(spm, {"text_config": {"vocab_size": 600}}) == 600
    assert gguf_vocab.vocab_rows(spm, {}) == tk.SPM_VOCAB_SIZE
    tk.write_unknown_bpe_tokenizer(bpe)
    with open(os.path.join(bpe, "tokenizer.json"), encoding="utf-8") as f:
        tokenizer = json.load(f)
    assert gguf_vocab.vocab_rows(bpe, {"vocab_size": 1024}) == len(tokenizer["model"]["vocab"]) + 1
    with pytest.raises(InputError, match="needs the model's tokenizer"):
        gguf_vocab.vocab_rows(str(tmp_path), {"vocab_size": 1024})


# ----------------------------------------------------------------------------------------------------------------
# refusals


def test_unknown_pre_tokenizer_is_refused_before_writing(tmp_path):
    folder = str(tmp_path)
    hparams = _config(folder, "qwen2", "Qwen2ForCausalLM", tk.write_unknown_bpe_tokenizer(folder))
    writer = gguf.GGUFWriter(None, "qwen2")
    before = dict(writer.kv_data[0])
    with pytest.raises(UnsupportedError, match=r"chkhsh [0-9a-f]{64}.*convert_hf_to_gguf_update\.py"):
        add_tokenizer(writer, folder, hparams)
    assert writer.kv_data[0] == before


@pytest.mark.slow
def test_the_converter_refuses_the_unknown_pre_tokenizer_too(tmp_path):
    folder = str(tmp_path / "model")
    _config(folder, "qwen2", "Qwen2ForCausalLM", tk.write_unknown_bpe_tokenizer(folder))
    with pytest.raises(AssertionError, match="BPE pre-tokenizer was not recognized"):
        run_converter(folder, str(tmp_path / "out.gguf"), "f16", "--vocab-only")


@pytest.mark.parametrize("model_type, arch", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_no_tokenizer_is_refused(tmp_path, model_type, arch):
    hparams = _config(str(tmp_path), model_type, arch, 512)
    writer = gguf.GGUFWriter(None, model_type)
    with pytest.raises(InputError, match=r"needs the model's tokenizer.*tokenizer\.save_pretrained\(BASE\)"):
        add_tokenizer(writer, str(tmp_path), hparams)
    assert list(writer.kv_data[0]) == ["general.architecture"]


@pytest.mark.parametrize(
    "hparams",
    [
        {"architectures": ["GPT2LMHeadModel"]},
        {
            "architectures": ["InternS1ForConditionalGeneration"],
            "text_config": {"architectures": ["Qwen3ForCausalLM"]},
        },
        {"architectures": ["LlamaForCausalLM"], "draft_vocab_size": 512, "num_hidden_layers": 1},  # EAGLE-3
    ],
    ids=["gpt2", "interns1", "eagle3"],
)
def test_architecture_with_other_rules_is_refused(tmp_path, hparams):
    tk.write_spm_tokenizer(str(tmp_path))
    writer = gguf.GGUFWriter(None, "llama")
    with pytest.raises(UnsupportedError, match="not written by peft-shardmerge.*llama.cpp's converter"):
        add_tokenizer(writer, str(tmp_path), hparams)
    assert list(writer.kv_data[0]) == ["general.architecture"]


# ----------------------------------------------------------------------------------------------------------------
# the data ported from the converter's script


def _converter_source() -> str:
    python = converter_python()
    (base,) = python.parent.parent.glob("lib/python3*/site-packages/conversion/base.py")
    return base.read_text(encoding="utf-8")


@pytest.mark.slow  # the converter's environment is built (pip) where the machine has none yet
def test_pre_tokenizer_table_and_check_text_are_the_converters():
    source = _converter_source()
    function = next(
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.name == "get_vocab_base_pre"
    )
    text = next(
        n.value.value
        for n in ast.walk(function)
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "chktxt"
    )
    assert text == gguf_vocab.CHECK_TEXT
    body = ast.get_source_segment(source, function)
    table = re.findall(r'if chkhsh == "([0-9a-f]{64})":\n(?:\s*#.*\n)*\s*res = "([^"]+)"', body)
    assert body.count("if chkhsh ==") == len(table) == len(gguf_vocab.PRE_TOKENIZER_HASHES)
    assert list(gguf_vocab.PRE_TOKENIZER_HASHES) == table


def test_repeated_hash_takes_the_last_name_as_the_converter():
    assert gguf_vocab.pre_tokenizer("b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166") == "olmo"
