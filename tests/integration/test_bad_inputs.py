"""The catalogue of bad inputs: each is refused with its own exception and message, by the API and the command
line (exit 2, no traceback), and nothing on disk is written or changed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from peft_shardmerge import CorruptFileError, InputError, NotFoundError, UnsupportedError, merge_checkpoint
from peft_shardmerge.api.cli import main as cli_main
from peft_shardmerge.testing import build_adapter, build_base


@dataclass
class Ctx:
    root: str
    base: str
    adapter: str
    sharded: str
    other_arch_adapter: str
    out: str = ""
    extra: dict = field(default_factory=dict)

    def copy(self, what: str) -> str:
        dst = os.path.join(self.root, "case-" + os.path.basename(what))
        shutil.copytree(what, dst)
        return dst


def _edit_json(path: str, **changes) -> None:
    data = json.load(open(path))
    for k, v in changes.items():
        if v is _DROP:
            data.pop(k, None)
        else:
            data[k] = v
    json.dump(data, open(path, "w"))


_DROP = object()


def adapter_config(**changes):
    def make(c: Ctx):
        a = c.copy(c.adapter)
        _edit_json(os.path.join(a, "adapter_config.json"), **changes)
        return c.base, a, {}

    return make


def adapter_weights(edit: Callable[[dict], None]):
    def make(c: Ctx):
        a = c.copy(c.adapter)
        path = os.path.join(a, "adapter_model.safetensors")
        w = load_file(path)
        edit(w)
        save_file(w, path, metadata={"format": "pt"})
        return c.base, a, {}

    return make


def raw_file(folder_attr: str, name: str, content: bytes):
    def make(c: Ctx):
        folder = c.copy(getattr(c, folder_attr))
        open(os.path.join(folder, name), "wb").write(content)
        return (folder, c.adapter, {}) if folder_attr == "base" else (c.base, folder, {})

    return make


def bad_base_shard(header: dict | bytes, data: bytes = b"", length: int | None = None):
    def make(c: Ctx):
        b = c.copy(c.base)
        raw = header if isinstance(header, bytes) else json.dumps(header).encode()
        n = len(raw) if length is None else length
        open(os.path.join(b, "model.safetensors"), "wb").write(struct.pack("<Q", n) + raw + data)
        return b, c.adapter, {}

    return make


def index_edit(edit: Callable[[dict, str], None]):
    def make(c: Ctx):
        b = c.copy(c.sharded)
        path = os.path.join(b, "model.safetensors.index.json")
        index = json.load(open(path))
        edit(index, b)
        json.dump(index, open(path, "w"))
        return b, c.sharded_adapter, {}

    return make


def option(**kwargs):
    def make(c: Ctx):
        return c.base, c.adapter, kwargs

    return make


def out_at(where: Callable[[Ctx, str, str], str], **kwargs):
    def make(c: Ctx):
        b, a = c.copy(c.base), c.copy(c.adapter)
        c.out = where(c, b, a)
        return b, a, kwargs

    return make


def _drop_b(w):
    for k in [k for k in w if "layers.0.self_attn.q_proj.lora_B" in k]:
        del w[k]


def _rank4_b(w):
    k = next(k for k in w if "layers.0.self_attn.q_proj.lora_B" in k)
    w[k] = w[k][:, :4].contiguous()


def _rename_target(w):
    for k in [k for k in w if "layers.0.self_attn.q_proj" in k]:
        w[k.replace("q_proj", "qq_proj")] = w.pop(k)


def _nan(w, value=float("nan")):
    k = next(k for k in w if "lora_B" in k)
    w[k][0, 0] = value


def _resized_head(w):
    w["base_model.model.lm_head.weight"] = torch.zeros(600, 128)


def _pickled_code(c: Ctx):
    a = c.copy(c.adapter)
    os.remove(os.path.join(a, "adapter_model.safetensors"))
    torch.save({"w": torch.ones(1), "f": os.getcwd}, os.path.join(a, "adapter_model.bin"))
    return c.base, a, {}


def _only_bin_base(c: Ctx):
    b = c.copy(c.base)
    os.rename(os.path.join(b, "model.safetensors"), os.path.join(b, "pytorch_model.bin"))
    return b, c.adapter, {}


def _no_config(c: Ctx):
    b = c.copy(c.base)
    os.remove(os.path.join(b, "config.json"))
    return b, c.adapter, {}


def _no_weights(c: Ctx):
    a = c.copy(c.adapter)
    os.remove(os.path.join(a, "adapter_model.safetensors"))
    return c.base, a, {}


def _prequantized(c: Ctx):
    b = c.copy(c.base)
    _edit_json(os.path.join(b, "config.json"), quantization_config={"quant_method": "bitsandbytes"})
    return b, c.adapter, {}


def _prequantized_str(c: Ctx):
    b = c.copy(c.base)
    _edit_json(os.path.join(b, "config.json"), quantization_config="bnb")
    return b, c.adapter, {}


def _nf4_on_a_4bit_base(c: Ctx):
    """base precision nf4 re-quantizes a 16-bit base: on a base stored in 4-bit already it is refused."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    folder = os.path.join(c.root, "case-bnb-4bit")
    AutoModelForCausalLM.from_pretrained(
        c.base, quantization_config=BitsAndBytesConfig(load_in_4bit=True), device_map="cpu"
    ).save_pretrained(folder)
    return folder, c.adapter, {"base_precision": "nf4"}


def _quantized_as(method: str, **extra):
    """A base whose config.json says it is stored in a quantization format this version does not read."""

    def build(c: Ctx):
        b = c.copy(c.base)
        _edit_json(os.path.join(b, "config.json"), quantization_config={"quant_method": method, **extra})
        return b, c.adapter, {}

    return build


def _truncate(folder_attr: str, name: str):
    def make(c: Ctx):
        folder = c.copy(getattr(c, folder_attr))
        path = os.path.join(folder, name)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) - 100])
        return (folder, c.adapter, {}) if folder_attr == "base" else (c.base, folder, {})

    return make


def _first(index):
    return next(iter(index["weight_map"]))


def _dup_across_shards(c: Ctx):
    b = c.copy(c.sharded)
    index = json.load(open(os.path.join(b, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    t = load_file(os.path.join(b, shards[1]))
    t.update({k: v for k, v in load_file(os.path.join(b, shards[0])).items()})
    save_file(t, os.path.join(b, shards[1]), metadata={"format": "pt"})
    return b, c.sharded_adapter, {}


def _symlink_into_base(c: Ctx, b: str, a: str) -> str:
    link = os.path.join(c.root, "link-out")
    os.symlink(os.path.join(b, "sub"), link)
    os.mkdir(os.path.join(b, "sub"))
    return link


def _symlink_elsewhere(c: Ctx, b: str, a: str) -> str:
    target = os.path.join(c.root, "real-out")
    os.mkdir(target)
    link = os.path.join(c.root, "link-out")
    os.symlink(target, link)
    return link


def _out_is_file(c: Ctx, b: str, a: str) -> str:
    p = os.path.join(c.root, "out-file")
    open(p, "w").write("mine")
    return p


def _out_not_empty(c: Ctx, b: str, a: str) -> str:
    p = os.path.join(c.root, "out-full")
    os.mkdir(p)
    open(os.path.join(p, "keep.txt"), "w").write("mine")
    return p


def _base_file_edit(edit: Callable[[bytes], bytes], sharded: bool = False):
    """Rewrite the base's (last) weights file with ``edit`` applied to its bytes."""

    def make(c: Ctx):
        b = c.copy(c.sharded if sharded else c.base)
        names = sorted(n for n in os.listdir(b) if n.endswith(".safetensors"))
        path = os.path.join(b, names[-1])
        data = open(path, "rb").read()
        open(path, "wb").write(edit(data))
        return b, c.sharded_adapter if sharded else c.adapter, {}

    return make


def _header_edit(change: Callable[[dict], None]):
    """Change the JSON header of the base's model.safetensors (data left as is)."""

    def edit(data: bytes) -> bytes:
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + n])
        change(header)
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + data[8 + n :]

    return edit


def _first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


def _base_dtype(name: str, dtype: torch.dtype):
    """The base with one tensor stored in another dtype."""

    def make(c: Ctx):
        b = c.copy(c.base)
        path = os.path.join(b, "model.safetensors")
        w = load_file(path)
        w[name] = (w[name] * 50).to(dtype)
        save_file(w, path, metadata={"format": "pt"})
        return b, c.adapter, {}

    return make


def _base_config(**changes):
    def make(c: Ctx):
        b = c.copy(c.base)
        _edit_json(os.path.join(b, "config.json"), **changes)
        return b, c.adapter, {}

    return make


def _rename_keys(match: str, old: str, new: str, keep: bool = False):
    def edit(w):
        for k in [k for k in w if match in k]:
            w[k.replace(old, new)] = w[k] * 2 if keep else w.pop(k)

    return edit


_Q0 = "layers.0.self_attn.q_proj"
_NAN, _INF = float("nan"), float("inf")


# (id, builder, exception, message regex)
CASES = [
    (
        "adapter-other-architecture",
        lambda c: (c.base, c.other_arch_adapter, {}),
        InputError,
        r"LoRA target 'transformer\.h\.0\.attn\.c_attn' does not exist in the base",
    ),
    (
        "adapter-other-hidden-size",
        lambda c: (c.base, c.wide_adapter, {}),
        InputError,
        r"gives a delta of shape \[192, 192\] but the base weight .* is \[128, 128\]",
    ),
    (
        "target-missing-in-base",
        adapter_weights(_rename_target),
        InputError,
        r"LoRA target 'model\.layers\.0\.self_attn\.qq_proj' does not exist in the base",
    ),
    ("rank-mismatch-A-B", adapter_weights(_rank4_b), InputError, r"do not form a rank-r pair"),
    ("only-A-no-B", adapter_weights(_drop_b), InputError, r"has only one of its A/B factors"),
    ("rank-config-vs-weights", adapter_config(r=4), InputError, r"rank 8 in its weights but .* says r=4"),
    ("nan-in-adapter", adapter_weights(_nan), InputError, r"adapter weights contain NaN or Inf"),
    (
        "inf-in-adapter",
        adapter_weights(lambda w: _nan(w, float("inf"))),
        InputError,
        r"adapter weights contain NaN or Inf",
    ),
    (
        "resized-head-only",
        adapter_weights(_resized_head),
        InputError,
        r"resizes the vocabulary to 600 rows but has no 'model\.embed_tokens\.weight' of that size",
    ),
    ("peft-type-oft", adapter_config(peft_type="OFT"), UnsupportedError, r"peft_type='OFT'; the disk engine merges"),
    (
        "lora-weights-labelled-loha",
        adapter_config(peft_type="LOHA"),
        InputError,
        r"adapter tensors .*lora_A.* have no place in the LOHA layers PEFT builds on this base",
    ),
    ("peft-type-missing", adapter_config(peft_type=_DROP), UnsupportedError, r"peft_type=None; the disk engine"),
    (
        "dora-config-without-magnitudes",
        adapter_config(use_dora=True),
        InputError,
        r"use_dora=True in adapter_config\.json but the weights lack a lora_magnitude_vector",
    ),
    (
        "target-parameters-missing",
        adapter_config(target_parameters=["mlp.experts.gate_up_proj"], target_modules=[]),
        InputError,
        r"PEFT cannot build the LORA layers of .* on this base \(.*\); the adapter was trained on a "
        r"different model",
    ),
    (
        "trainable-tokens-without-rows",
        adapter_config(trainable_token_indices=[1, 2]),
        InputError,
        r"asks for trainable tokens but the weights hold no trainable_tokens_delta",
    ),
    ("layer-replication", adapter_config(layer_replication=[[0, 2]]), UnsupportedError, r"layer_replication"),
    ("config-missing-r", adapter_config(r=_DROP), InputError, r"adapter_config\.json lacks 'r'"),
    ("config-r-string", adapter_config(r="8"), InputError, r"'r' must be a positive finite number, got '8'"),
    (
        "config-alpha-negative",
        adapter_config(lora_alpha=-16),
        InputError,
        r"'lora_alpha' must be a positive finite number",
    ),
    (
        "config-rank-pattern-list",
        adapter_config(rank_pattern=["q_proj"]),
        InputError,
        r"'rank_pattern' must be an object, got list",
    ),
    (
        "pissa-residual-base",
        adapter_config(init_lora_weights="pissa_niter_4"),
        UnsupportedError,
        r"init_lora_weights='pissa_niter_4' trains against a residual base",
    ),
    (
        "rank-pattern-none-value",
        adapter_config(rank_pattern={"q_proj": None}),
        InputError,
        r"rank_pattern\['q_proj'\] must be a positive int, got None",
    ),
    (
        "alpha-pattern-string-value",
        adapter_config(alpha_pattern={"v_proj": "3"}),
        InputError,
        r"alpha_pattern\['v_proj'\] must be a positive finite number, got '3'",
    ),
    (
        "pattern-bad-regex",
        adapter_config(rank_pattern={"q_proj(": 4}),
        InputError,
        r"rank_pattern key 'q_proj\(' is not a valid pattern",
    ),
    (
        "config-not-json",
        raw_file("adapter", "adapter_config.json", b"{r: 8"),
        CorruptFileError,
        r"adapter_config\.json is not valid JSON",
    ),
    (
        "config-not-object",
        raw_file("adapter", "adapter_config.json", b"[1, 2]"),
        CorruptFileError,
        r"adapter_config\.json is not a JSON object",
    ),
    (
        "adapter-folder-missing",
        lambda c: (c.base, os.path.join(c.root, "nope"), {}),
        NotFoundError,
        r"adapter .*nope' is not a folder, nor a Hub id",
    ),
    ("adapter-weights-missing", _no_weights, NotFoundError, r"has neither adapter_model\.safetensors nor"),
    ("adapter-pickle-with-code", _pickled_code, CorruptFileError, r"cannot be read safely with torch\.load"),
    ("adapter-truncated", _truncate("adapter", "adapter_model.safetensors"), CorruptFileError, r"truncated"),
    (
        "adapter-empty",
        raw_file("adapter", "adapter_model.safetensors", struct.pack("<Q", 2) + b"{}"),
        InputError,
        r"holds no LoRA weights",
    ),
    (
        "base-folder-missing",
        lambda c: (os.path.join(c.root, "nobase"), c.adapter, {}),
        NotFoundError,
        r"base .*nobase' is not a folder, nor a Hub id",
    ),
    ("base-without-config", _no_config, NotFoundError, r"has none of config\.json"),
    ("base-only-pickle", _only_bin_base, InputError, r"has only pickle weights \(pytorch_model\.bin\)"),
    (
        "base-quantization-config-but-no-quantized-tensor",
        _prequantized,
        InputError,
        r"quantization_config says bitsandbytes .*no tensor is stored quantized",
    ),
    ("base-quantization-config-string", _prequantized_str, InputError, r"quantization_config is not an object"),
    (
        "base-gptq",
        _quantized_as("gptq", bits=4),
        InputError,
        r"is stored quantized as GPTQ, which this version does not read .*merge into the unquantized checkpoint",
    ),
    ("base-awq", _quantized_as("awq"), InputError, r"stored quantized as AWQ, which this version does not read"),
    (
        "base-compressed-tensors",
        _quantized_as("compressed-tensors"),
        InputError,
        r"stored quantized as compressed-tensors \(llm-compressor\), which this version does not read",
    ),
    (
        "base-precision-nf4-on-a-4bit-base",
        _nf4_on_a_4bit_base,
        InputError,
        r"base precision 'nf4' re-quantizes a 16-bit base, but this base is already stored as bitsandbytes 4-bit",
    ),
    (
        "base-unknown-quant-method",
        _quantized_as("magic"),
        InputError,
        r"stored quantized as quant_method='magic', which this version does not read",
    ),
    (
        "base-config-not-json",
        raw_file("base", "config.json", b"{oops"),
        CorruptFileError,
        r"base config\.json is not valid JSON",
    ),
    (
        "header-length-beyond-file",
        bad_base_shard(b"{}", length=10**9),
        CorruptFileError,
        r"header length 1000000000 is beyond the file",
    ),
    ("header-bad-json", bad_base_shard(b"{not json}"), CorruptFileError, r"header is not valid JSON"),
    (
        "offsets-out-of-range",
        bad_base_shard({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
        CorruptFileError,
        r"ends beyond the file",
    ),
    (
        "overlapping-tensors",
        bad_base_shard(
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
        ),
        CorruptFileError,
        r"overlaps another or leaves a gap",
    ),
    (
        "unknown-dtype",
        bad_base_shard({"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
        CorruptFileError,
        r"unknown dtype 'F7'",
    ),
    (
        "empty-shard-file",
        raw_file("base", "model.safetensors", b""),
        CorruptFileError,
        r"is 0 bytes, too short to be safetensors",
    ),
    (
        "index-missing-shard",
        index_edit(lambda i, b: i["weight_map"].update({_first(i): "model-99999.safetensors"})),
        NotFoundError,
        r"names shard\(s\) that do not exist: model-99999\.safetensors",
    ),
    (
        "index-dotdot",
        index_edit(lambda i, b: i["weight_map"].update({_first(i): "../x.safetensors"})),
        CorruptFileError,
        r"shard name '\.\./x\.safetensors' is not a plain",
    ),
    (
        "index-absolute",
        index_edit(lambda i, b: i["weight_map"].update({_first(i): "/etc/x.safetensors"})),
        CorruptFileError,
        r"shard name '/etc/x\.safetensors' is not a plain",
    ),
    (
        "index-not-safetensors",
        index_edit(lambda i, b: i["weight_map"].update({_first(i): "model.bin"})),
        CorruptFileError,
        r"shard name 'model\.bin' is not a plain \.safetensors",
    ),
    (
        "index-without-weight-map",
        index_edit(lambda i, b: i.pop("weight_map")),
        CorruptFileError,
        r"has no 'weight_map' object",
    ),
    (
        "index-names-absent-tensor",
        index_edit(lambda i, b: i["weight_map"].update({"ghost.weight": i["weight_map"][_first(i)]})),
        CorruptFileError,
        r"names tensors no shard holds: ghost",
    ),
    ("duplicate-across-shards", _dup_across_shards, CorruptFileError, r"appears in both"),
    ("unknown-dtype-option", option(dtype="int4"), InputError, r"dtype 'int4' is not supported"),
    ("shard-size-unit", option(max_shard_size="5XB"), InputError, r"max_shard_size '5XB' is not a size"),
    ("shard-size-negative", option(max_shard_size="-1GB"), InputError, r"max_shard_size '-1GB' is not a size"),
    ("shard-size-empty", option(max_shard_size=""), InputError, r"max_shard_size '' is not a size"),
    ("shard-size-zero", option(max_shard_size="0MB"), InputError, r"max_shard_size must be positive"),
    (
        "base-precision",
        option(base_precision="int8"),
        InputError,
        r"base_precision must be one of auto, original, nf4",
    ),
    (
        "nf4-blocksize",
        option(base_precision="nf4", nf4_blocksize=100),
        InputError,
        r"4-bit blocksize must be a power of two",
    ),
    ("device-cuda-without-cuda", option(device="cuda"), InputError, r"CUDA is not available"),
    ("out-not-empty", out_at(_out_not_empty), InputError, r"did not write \(keep\.txt\).*choose another output"),
    ("out-is-a-file", out_at(_out_is_file), InputError, r"exists and is not a folder"),
    ("out-equals-base", out_at(lambda c, b, a: b, overwrite=True), InputError, r"is the base folder"),
    ("out-inside-base", out_at(lambda c, b, a: os.path.join(b, "m")), InputError, r"is inside the base folder"),
    ("out-inside-adapter", out_at(lambda c, b, a: os.path.join(a, "m")), InputError, r"is inside the adapter folder"),
    (
        "base-inside-out",
        out_at(lambda c, b, a: c.root, overwrite=True),
        InputError,
        r"the base folder .* is inside the output folder",
    ),
    ("symlink-out-into-base", out_at(_symlink_into_base), InputError, r"is inside the base folder"),
    ("symlink-out-elsewhere", out_at(_symlink_elsewhere), InputError, r"is a symlink; .* pass the real path"),
    # numbers NaN and infinities cannot slip through
    (
        "alpha-nan",
        adapter_config(lora_alpha=_NAN),
        InputError,
        r"'lora_alpha' must be a positive finite number, got nan",
    ),
    (
        "alpha-inf",
        adapter_config(lora_alpha=_INF),
        InputError,
        r"'lora_alpha' must be a positive finite number, got inf",
    ),
    (
        "alpha-minus-inf",
        adapter_config(lora_alpha=-_INF),
        InputError,
        r"'lora_alpha' must be a positive finite number",
    ),
    ("alpha-zero", adapter_config(lora_alpha=0), InputError, r"'lora_alpha' must be a positive finite number, got 0"),
    ("r-zero", adapter_config(r=0), InputError, r"'r' must be a positive finite number, got 0"),
    ("r-negative", adapter_config(r=-8), InputError, r"'r' must be a positive finite number, got -8"),
    ("r-nan", adapter_config(r=_NAN), InputError, r"'r' must be a positive finite number, got nan"),
    ("r-fraction", adapter_config(r=8.5), InputError, r"'r' must be a positive finite number, got 8\.5"),
    (
        "rank-pattern-nan",
        adapter_config(rank_pattern={"q_proj": _NAN}),
        InputError,
        r"rank_pattern\['q_proj'\] must be a positive int, got nan",
    ),
    (
        "rank-pattern-zero",
        adapter_config(rank_pattern={"q_proj": 0}),
        InputError,
        r"rank_pattern\['q_proj'\] must be a positive int, got 0",
    ),
    (
        "alpha-pattern-nan",
        adapter_config(alpha_pattern={"q_proj": _NAN}),
        InputError,
        r"alpha_pattern\['q_proj'\] must be a positive finite number, got nan",
    ),
    (
        "alpha-pattern-inf",
        adapter_config(alpha_pattern={"q_proj": _INF}),
        InputError,
        r"alpha_pattern\['q_proj'\] must be a positive finite number, got inf",
    ),
    (
        "alpha-pattern-minus-inf",
        adapter_config(alpha_pattern={"v_proj": -_INF}),
        InputError,
        r"alpha_pattern\['v_proj'\] must be a positive finite number, got -inf",
    ),
    (
        "alpha-pattern-zero",
        adapter_config(alpha_pattern={"v_proj": 0.0}),
        InputError,
        r"alpha_pattern\['v_proj'\] must be a positive finite number, got 0\.0",
    ),
    # base files safetensors itself refuses
    (
        "base-trailing-bytes",
        _base_file_edit(lambda d: d + b"\0" * 8),
        CorruptFileError,
        r"8 byte\(s\) follow the last tensor's data",
    ),
    (
        "base-trailing-byte-last-shard",
        _base_file_edit(lambda d: d + b"x", sharded=True),
        CorruptFileError,
        r"model-(\d+)-of-\1\.safetensors: 1 byte\(s\) follow the last tensor's data",
    ),
    (
        "base-shape-float",
        _base_file_edit(
            _header_edit(lambda h: _first_tensor(h).update(shape=[float(x) for x in _first_tensor(h)["shape"]]))
        ),
        CorruptFileError,
        r"a shape is a list of integers",
    ),
    (
        "base-shape-string",
        _base_file_edit(
            _header_edit(lambda h: _first_tensor(h).update(shape=[str(x) for x in _first_tensor(h)["shape"]]))
        ),
        CorruptFileError,
        r"a shape is a list of integers",
    ),
    (
        "base-shape-negative",
        _base_file_edit(
            _header_edit(lambda h: _first_tensor(h).update(shape=[-x for x in _first_tensor(h)["shape"]]))
        ),
        CorruptFileError,
        r"a shape is a list of integers",
    ),
    (
        "base-shape-2**63",
        _base_file_edit(
            _header_edit(
                lambda h: h.update({"extra.huge": {"dtype": "F32", "shape": [2**63, 0], "data_offsets": [0, 0]}})
            )
        ),
        CorruptFileError,
        r"'extra\.huge' has shape \[9223372036854775808, 0\]",
    ),
    (
        "base-offsets-float",
        _base_file_edit(
            _header_edit(
                lambda h: _first_tensor(h).update(data_offsets=[float(x) for x in _first_tensor(h)["data_offsets"]])
            )
        ),
        CorruptFileError,
        r"has data_offsets .* they are two integers",
    ),
    (
        "base-metadata-not-string",
        _base_file_edit(_header_edit(lambda h: h.update(__metadata__={"format": 1}))),
        CorruptFileError,
        r"__metadata__ is not an object of strings",
    ),
    (
        "base-explicit-weights-outside",
        _base_config(transformers_weights="../model.safetensors"),
        CorruptFileError,
        r"transformers_weights='\.\./model\.safetensors' leads out of the folder",
    ),
    (
        "base-explicit-weights-missing",
        _base_config(transformers_weights="other.safetensors"),
        CorruptFileError,
        r"transformers_weights='other\.safetensors' names a file that does not exist",
    ),
    (
        "base-explicit-weights-bin",
        _base_config(transformers_weights="pytorch_model.bin"),
        CorruptFileError,
        r"is neither a \.safetensors file nor a \.safetensors\.index\.json",
    ),
    # adapter tensors PeftModel.from_pretrained would not load
    (
        "adapter-keys-without-prefix",
        adapter_weights(_rename_keys("base_model.model.", "base_model.model.", "")),
        InputError,
        r"28 of 28 adapter tensor\(s\) lack the 'base_model\.model\.' prefix .* PEFT loads none of them",
    ),
    (
        "adapter-one-module-without-prefix",
        adapter_weights(_rename_keys(_Q0, "base_model.model.", "")),
        InputError,
        r"2 of 28 adapter tensor\(s\) lack the 'base_model\.model\.' prefix",
    ),
    (
        "adapter-two-adapters-in-one-file",
        adapter_weights(_rename_keys(_Q0, ".weight", ".other.weight", keep=True)),
        InputError,
        r"belong to another adapter than 'default' \(other: .*PEFT loads a folder as 'default'",
    ),
    (
        "adapter-only-another-adapter",
        adapter_weights(_rename_keys(_Q0, ".weight", ".second.weight")),
        InputError,
        r"belong to another adapter than 'default' \(second",
    ),
    (
        "adapter-factor-stored-twice",
        adapter_weights(_rename_keys(_Q0, ".weight", ".default.weight", keep=True)),
        InputError,
        r"stored twice, with and without the adapter name",
    ),
    (
        "adapter-base-weight-of-lora-module",
        adapter_weights(lambda w: w.update({f"base_model.model.model.{_Q0}.weight": torch.ones(128, 128)})),
        InputError,
        r"1 adapter tensor\(s\) would not be loaded by PEFT onto this base \(base_model\.model\.model\.layers\.0\."
        r"self_attn\.q_proj\.weight\)",
    ),
    (
        "adapter-bias-the-base-lacks",
        adapter_weights(lambda w: w.update({f"base_model.model.model.{_Q0}.base_layer.bias": torch.ones(128)})),
        InputError,
        r"would not be loaded by PEFT onto this base",
    ),
    # tensors that cannot take a delta
    (
        "target-stored-int8",
        _base_dtype("model.layers.0.self_attn.q_proj.weight", torch.int8),
        InputError,
        r"integers or float8: model\.layers\.0\.self_attn\.q_proj\.weight \(I8\)",
    ),
    (
        "target-stored-uint8",
        _base_dtype("model.layers.1.self_attn.v_proj.weight", torch.uint8),
        InputError,
        r"integers or float8: model\.layers\.1\.self_attn\.v_proj\.weight \(U8\)",
    ),
    (
        "target-stored-float8-e4m3",
        _base_dtype("model.layers.0.self_attn.q_proj.weight", torch.float8_e4m3fn),
        InputError,
        r"model\.layers\.0\.self_attn\.q_proj\.weight \(F8_E4M3\)",
    ),
    (
        "target-stored-float8-e5m2",
        _base_dtype("model.layers.0.self_attn.q_proj.weight", torch.float8_e5m2),
        InputError,
        r"model\.layers\.0\.self_attn\.q_proj\.weight \(F8_E5M2\)",
    ),
]

CLI_FLAGS = {
    "dtype": "--dtype",
    "max_shard_size": "--max-shard-size",
    "base_precision": "--base-precision",
    "nf4_blocksize": "--nf4-blocksize",
    "device": "--device",
}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, make_base, make_adapter):
    root = str(tmp_path_factory.mktemp("catalogue"))
    c = Ctx(
        root,
        make_base("llama"),
        make_adapter("llama", "default"),
        make_base("llama_sharded"),
        make_adapter("gpt2", "default", fan_in_fan_out=True),
    )
    c.sharded_adapter = make_adapter("llama_sharded", "default")
    wide = build_base(os.path.join(root, "wide"), "llama", hidden_size=192, intermediate_size=256)
    c.wide_adapter = build_adapter(wide, os.path.join(root, "wide-adapter"), target_modules=["q_proj"])
    return c


def _snapshot(folder: str) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, files in os.walk(folder):
        for name in files + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, folder)] = (
                os.readlink(p) if os.path.islink(p) else hashlib.sha256(open(p, "rb").read()).hexdigest()
            )
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, ctx, tmp_path, capsys):
    name, build, exc, message = case
    if name == "device-cuda-without-cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is available")
    ctx.root = str(tmp_path)
    ctx.out = str(tmp_path / "out")
    base, adapter, kwargs = build(ctx)
    before = _snapshot(str(tmp_path))
    with pytest.raises(exc, match=message):
        merge_checkpoint(base, adapter, ctx.out, progress=False, **kwargs)
    assert _snapshot(str(tmp_path)) == before, "the API wrote or changed something"

    argv = ["merge", base, adapter, ctx.out, "-q"]
    for k, v in kwargs.items():
        argv += ["--overwrite"] if k == "overwrite" else [f"{CLI_FLAGS[k]}={v}"]
    capsys.readouterr()
    try:
        code = cli_main(argv)
    except SystemExit as e:  # argparse refuses values outside its choices, also with status 2
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    if "invalid choice" not in err:
        assert err.startswith("peft-shardmerge: error: ")
    assert _snapshot(str(tmp_path)) == before, "the command line wrote or changed something"


def test_catalogue_is_large():
    assert len(CASES) >= 40
