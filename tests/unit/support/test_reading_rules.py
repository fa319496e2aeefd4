"""How inputs are read, compared case by case with the libraries that read them: safetensors' ``safe_open``,
transformers' ``from_pretrained``, PEFT's ``PeftModel.from_pretrained`` and sentence-transformers."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from peft_shardmerge import CorruptFileError, InputError, MergeCheckError, NotFoundError, merge_checkpoint
from peft_shardmerge.checkpoint.base_folder import open_checkpoint
from peft_shardmerge.engine.block_checks import check_probe_error
from peft_shardmerge.io.safetensors_io import DTYPES, RowReader, read_header, row_blocks
from peft_shardmerge.output.side_files import list_side_files
from peft_shardmerge.support.peft_reading import peft_load_problems, positive_number, stored_key_problems

# ---------------------------------------------------------------------------------------------------------------
# 1. A valid safetensors file is what safetensors itself opens and reads


def _write(path: str, header, data: bytes = b"", length: int | None = None) -> str:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _theirs(path: str):
    """What safetensors makes of the file: {name: tensor}, or None when it refuses to open or read it."""
    try:
        with safe_open(path, "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception:  # any refusal of the library counts
        return None


def _ours(path: str):
    try:
        infos, _ = read_header(path)
    except CorruptFileError:
        return None
    with RowReader() as reader:
        return {i.name: reader.read(i) for i in infos}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (so NaN payloads and float8 values compare exactly)."""
    if not a.numel() or not b.numel():
        return a.numel() == b.numel()
    boolean = a.dtype == torch.bool  # any non-zero byte is True: safetensors may normalise it
    a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    return torch.equal(a != 0, b != 0) if boolean else torch.equal(a, b)


def _f32(shape, offsets):
    return {"dtype": "F32", "shape": shape, "data_offsets": offsets}


ST_CASES = {
    "valid": ({"w": _f32([2], [0, 8])}, b"\1" * 8),
    "valid-two-tensors": ({"a": _f32([1], [0, 4]), "b": _f32([2], [4, 12])}, b"\2" * 12),
    "valid-with-metadata": ({"__metadata__": {"format": "pt"}, "w": _f32([2], [0, 8])}, b"\0" * 8),
    "valid-scalar": ({"w": _f32([], [0, 4])}, b"\3" * 4),
    "valid-empty-file": ({}, b""),
    "valid-zero-size-tensors": (
        {"a": _f32([0], [0, 0]), "b": _f32([3, 0], [0, 0]), "c": _f32([1], [0, 4])},
        b"\0" * 4,
    ),
    "valid-2**62-by-0": ({"w": _f32([2**62, 0], [0, 0])}, b""),
    "valid-0-by-2**62": ({"w": _f32([0, 2**62], [0, 0])}, b""),
    "valid-extra-entry-field": ({"w": {**_f32([2], [0, 8]), "note": 1}}, b"\0" * 8),
    "valid-bf16": ({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}, b"\5" * 8),
    "valid-i8": ({"w": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]}}, b"\7" * 3),
    "valid-c64": ({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\x09" * 8),
    "valid-f8": ({"w": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}, b"\x11" * 4),
    "trailing-byte": ({"w": _f32([2], [0, 8])}, b"\0" * 9),
    "trailing-8-bytes": ({"w": _f32([2], [0, 8])}, b"\0" * 16),
    "trailing-after-empty": ({}, b"\0"),
    "shape-float": ({"w": _f32([2.0], [0, 8])}, b"\0" * 8),
    "shape-string": ({"w": _f32(["2"], [0, 8])}, b"\0" * 8),
    "shape-negative": ({"w": _f32([-2], [0, 8])}, b"\0" * 8),
    "shape-bool": ({"w": _f32([True, 2], [0, 8])}, b"\0" * 8),
    "shape-null": ({"w": _f32(None, [0, 8])}, b"\0" * 8),
    "shape-nested": ({"w": _f32([[2]], [0, 8])}, b"\0" * 8),
    "shape-2**63-by-0": ({"w": _f32([2**63, 0], [0, 0])}, b""),
    "shape-2**64-by-0": ({"w": _f32([2**64, 0], [0, 0])}, b""),
    "shape-vs-offsets": ({"w": _f32([3], [0, 8])}, b"\0" * 8),
    "offsets-float": ({"w": _f32([2], [0, 8.0])}, b"\0" * 8),
    "offsets-negative": ({"w": _f32([2], [-8, 0])}, b"\0" * 8),
    "offsets-reversed": ({"w": _f32([2], [8, 0])}, b"\0" * 8),
    "offsets-three": ({"w": _f32([2], [0, 8, 8])}, b"\0" * 8),
    "offsets-beyond-file": ({"w": _f32([4], [0, 16])}, b"\0" * 8),
    "offsets-overlap": ({"a": _f32([2], [0, 8]), "b": _f32([2], [4, 12])}, b"\0" * 12),
    "offsets-gap-first": ({"a": _f32([1], [4, 8])}, b"\0" * 8),
    "offsets-gap-middle": ({"a": _f32([1], [0, 4]), "b": _f32([1], [8, 12])}, b"\0" * 12),
    "dtype-unknown": ({"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
    "dtype-lowercase": ({"w": {"dtype": "f32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "dtype-missing": ({"w": {"shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "metadata-int-value": ({"__metadata__": {"format": 1}, "w": _f32([2], [0, 8])}, b"\0" * 8),
    "metadata-list": ({"__metadata__": ["pt"], "w": _f32([2], [0, 8])}, b"\0" * 8),
    "header-array": (b"[]", b""),
    "header-not-json": (b"{oops", b""),
    "entry-not-object": ({"w": [1, 2]}, b""),
}


@pytest.mark.parametrize("dtype", ["F4", "F6_E2M3", "F6_E3M2"])
def test_sub_byte_dtypes_are_refused_by_name(dtype, tmp_path):
    path = _write(
        str(tmp_path / "x.safetensors"), {"w": {"dtype": dtype, "shape": [2], "data_offsets": [0, 1]}}, b"\0"
    )
    with pytest.raises(CorruptFileError, match=f"stored as {dtype} .*cannot read"):
        read_header(path)


@pytest.mark.parametrize("case", sorted(ST_CASES))
def test_safetensors_agreement(case, tmp_path):
    header, data = ST_CASES[case]
    path = _write(str(tmp_path / "x.safetensors"), header, data)
    theirs, ours = _theirs(path), _ours(path)
    assert (ours is None) == (theirs is None), f"safetensors {'refuses' if theirs is None else 'reads'} it, we don't"
    assert case.startswith("valid") == (ours is not None)
    for name, want in (theirs or {}).items():
        got = ours[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _same_bytes(got, want), name


_DT = [d for d in ("F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3") if d in DTYPES]


@settings(
    max_examples=300, deadline=3000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    entries=st.lists(
        st.tuples(
            st.sampled_from(_DT), st.lists(st.integers(0, 4), max_size=3), st.integers(-2, 2), st.integers(-2, 2)
        ),
        max_size=4,
    ),
    trailing=st.integers(0, 3) | st.just(0),
    shuffle=st.randoms(),
)
def test_safetensors_agreement_generated(tmp_path_factory, entries, trailing, shuffle):
    """Mostly valid files with small perturbations of offsets and trailing bytes: we accept exactly what
    safetensors accepts, and read the same values."""
    header, pos = {}, 0
    for i, (dtype, shape, d_begin, d_end) in enumerate(entries):
        n = math.prod(shape) * DTYPES[dtype][1]
        header[f"t{i}"] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [max(0, pos + d_begin), max(0, pos + n + d_end)],
        }
        pos += n
    items = list(header.items())
    shuffle.shuffle(items)
    data = bytes((7 * i) % 251 for i in range(pos + trailing))
    path = _write(str(tmp_path_factory.mktemp("gen") / "x.safetensors"), dict(items), data)
    theirs, ours = _theirs(path), _ours(path)
    assert (ours is None) == (theirs is None)
    for name, want in (theirs or {}).items():
        assert ours[name].shape == want.shape and ours[name].dtype == want.dtype
        assert _same_bytes(ours[name], want), name


# ---------------------------------------------------------------------------------------------------------------
# 2. Row blocks: bounded in number and memory, also for empty and absurd shapes


@pytest.mark.parametrize(
    "shape,budget",
    [
        ((2**62, 0), 1 << 22),
        ((0, 2**62), 1 << 22),
        ((5, 0, 3), 16),
        ((0,), 4),
        ((), 4),
        ((1,), 4),
        ((7, 3), 5),
        ((1000, 1000), 4096),
        ((3, 100), 10),
        ((10, 4), 16),
        ((2**40, 0, 2**20), 1),
        ((64, 1), 1 << 22),
    ],
)
def test_row_blocks_cover_rows_once(shape, budget):
    t0 = time.perf_counter()
    blocks = row_blocks(shape, budget)
    assert time.perf_counter() - t0 < 0.5
    rows = shape[0] if shape else 1
    per_row = math.prod(shape[1:]) if shape else 1
    assert blocks[0][0] == 0 and blocks[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    if rows * per_row == 0:
        assert len(blocks) == 1
    else:
        assert all((stop - start) * per_row <= budget or stop - start == 1 for start, stop in blocks)
        assert len(blocks) <= rows


def test_zero_byte_tensor_with_absurd_shape_merges(make_base, make_adapter, tmp_path):
    base = shutil.copytree(make_base("llama"), tmp_path / "base")
    path = os.path.join(base, "model.safetensors")
    tensors = load_file(path)
    tensors["extra.empty_rows"] = torch.empty(2**62, 0)
    tensors["extra.empty_cols"] = torch.empty(0, 2**62)
    save_file(tensors, path, metadata={"format": "pt"})
    t0 = time.perf_counter()
    merge_checkpoint(str(base), make_adapter("llama"), str(tmp_path / "out"), progress=False)
    assert time.perf_counter() - t0 < 60
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.get_slice("extra.empty_rows").get_shape() == [2**62, 0]
        assert f.get_slice("extra.empty_cols").get_shape() == [0, 2**62]


# ---------------------------------------------------------------------------------------------------------------
# 3. Which weights file a base folder means: the one transformers' from_pretrained reads


def _shifted_single(sharded: str, folder: str, shift: float = 1.0) -> None:
    """Write model.safetensors next to the index, with every float tensor shifted (so the two disagree)."""
    tensors = {}
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    for name in sorted({v for v in index["weight_map"].values()}):
        tensors.update(load_file(os.path.join(sharded, name)))
    save_file(
        {k: v + shift for k, v in tensors.items()},
        os.path.join(folder, "model.safetensors"),
        metadata={"format": "pt"},
    )


def _layout(kind: str, sharded: str, folder: str) -> None:
    shutil.copytree(sharded, folder)
    cfg_path = os.path.join(folder, "config.json")
    cfg = json.load(open(cfg_path))
    if kind == "index-only":
        return
    if kind == "single-only":
        _shifted_single(sharded, folder)
        for n in os.listdir(folder):
            if n.startswith("model-") or n.endswith(".index.json"):
                os.remove(os.path.join(folder, n))
        return
    if kind == "neither":
        for n in os.listdir(folder):
            if n.startswith("model"):
                os.remove(os.path.join(folder, n))
        return
    if kind == "directory-named-single":
        os.mkdir(os.path.join(folder, "model.safetensors"))
        return
    _shifted_single(sharded, folder)
    explicit = {
        "both": None,
        "both-explicit-index": "model.safetensors.index.json",
        "both-explicit-single": "model.safetensors",
        "explicit-missing": "other.safetensors",
        "explicit-outside": "../model.safetensors",
        "explicit-bin": "pytorch_model.bin",
        "explicit-shard": "model-00001-of-00006.safetensors",
    }[kind]
    if explicit is not None:
        cfg["transformers_weights"] = explicit
        json.dump(cfg, open(cfg_path, "w"))


LAYOUTS = [
    "index-only",
    "single-only",
    "neither",
    "directory-named-single",
    "both",
    "both-explicit-index",
    "both-explicit-single",
    "explicit-missing",
    "explicit-outside",
    "explicit-bin",
]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_base_folder_reads_what_transformers_reads(kind, make_base, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path / "base")
    _layout(kind, make_base("llama_sharded"), folder)
    try:
        state = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    except Exception:  # transformers refuses the folder
        state = None
    try:
        src = open_checkpoint(folder)
    except (CorruptFileError, NotFoundError, InputError):
        src = None
    assert (src is None) == (state is None), f"transformers {'refuses' if state is None else 'loads'} {kind}"
    if src is None:
        return
    with RowReader() as reader:
        for t in src.tensors:
            assert torch.equal(reader.read(t), state[t.name]), t.name


def test_both_files_merge_equals_peft_on_what_transformers_loads(make_base, make_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers import logits_of, rel_err

    folder = str(tmp_path / "base")
    _layout("both", make_base("llama_sharded"), folder)
    adapter = make_adapter("llama_sharded")
    merge_checkpoint(folder, adapter, str(tmp_path / "out"), progress=False)
    ids = torch.arange(16).reshape(2, 8)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), adapter)
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
    assert rel_err(logits_of(str(tmp_path / "out"), ids), want) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# 4. Which adapter tensors count: those PeftModel.from_pretrained loads as "default"

_Q0 = "layers.0.self_attn.q_proj"


def _rename(w, match, old, new, keep=False, scale=1.0):
    for k in [k for k in w if match in k]:
        w[k.replace(old, new)] = w[k] * scale
        if not keep:
            del w[k]


ADAPTER_VARIANTS = {
    "as-saved": lambda w: None,
    "default-name-inside-all": lambda w: _rename(w, "lora_", ".weight", ".default.weight"),
    "default-name-inside-one": lambda w: _rename(w, _Q0, ".weight", ".default.weight"),
    "two-adapters": lambda w: _rename(w, _Q0, ".weight", ".other.weight", keep=True, scale=2.0),
    "other-adapter-only": lambda w: _rename(w, _Q0, ".weight", ".other.weight"),
    "three-adapters": lambda w: (
        _rename(w, _Q0, ".weight", ".x.weight", keep=True, scale=2.0),
        _rename(w, _Q0 + ".lora_A.weight", ".weight", ".y.weight", keep=True, scale=3.0),
    ),
    "stored-twice": lambda w: _rename(w, _Q0, ".weight", ".default.weight", keep=True, scale=3.0),
    "no-prefix-all": lambda w: _rename(w, "base_model.model.", "base_model.model.", ""),
    "no-prefix-one": lambda w: _rename(w, _Q0, "base_model.model.", ""),
    "short-prefix": lambda w: _rename(w, _Q0, "base_model.model.", "base_model."),
    "base-weight-of-wrapped-module": lambda w: w.update(
        {f"base_model.model.model.{_Q0}.weight": torch.randn(128, 128)}
    ),
    "base-weight-of-plain-module": lambda w: w.update({"base_model.model.model.norm.weight": torch.randn(128)}),
    "base-weights-of-plain-modules": lambda w: w.update(
        {
            "base_model.model.model.layers.0.input_layernorm.weight": torch.randn(128),
            "base_model.model.model.layers.1.post_attention_layernorm.weight": torch.randn(128),
        }
    ),
    "bias-the-base-lacks": lambda w: w.update({f"base_model.model.model.{_Q0}.base_layer.bias": torch.randn(128)}),
    "module-not-in-base": lambda w: w.update(
        {
            "base_model.model.model.layers.0.self_attn.nope.lora_A.weight": torch.randn(8, 128),
            "base_model.model.model.layers.0.self_attn.nope.lora_B.weight": torch.randn(128, 8),
        }
    ),
}


#: the variants PEFT loads completely (every stored tensor lands in the model)
PEFT_LOADS_ALL = {
    "as-saved",
    "default-name-inside-all",
    "default-name-inside-one",
    "base-weight-of-plain-module",
    "base-weights-of-plain-modules",
}


def _peft_loads_everything(base: str, adapter: str) -> tuple[bool, object]:
    """Load with PEFT and check that every stored tensor ended up in the model (by value)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    values = list(model.state_dict().values())
    stored = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    ok = all(any(v.shape == t.shape and torch.equal(v, t) for v in values) for t in stored.values())
    return ok, model


@pytest.mark.parametrize("variant", sorted(ADAPTER_VARIANTS))
def test_adapter_keys_agree_with_peft(variant, make_base, make_adapter, tmp_path):
    from transformers import AutoConfig

    base = make_base("llama")
    adapter = shutil.copytree(make_adapter("llama"), tmp_path / "adapter")
    path = os.path.join(adapter, "adapter_model.safetensors")
    w = load_file(path)
    torch.manual_seed(3)
    ADAPTER_VARIANTS[variant](w)
    save_file(w, path, metadata={"format": "pt"})
    peft_ok, model = _peft_loads_everything(base, str(adapter))
    shapes = {k: tuple(v.shape) for k, v in w.items()}
    ours = stored_key_problems(list(w)) + peft_load_problems(str(adapter), shapes, AutoConfig.from_pretrained(base))
    assert (not ours) == peft_ok, ours
    assert peft_ok == (variant in PEFT_LOADS_ALL)  # both outcomes are exercised
    out = str(tmp_path / "out")
    if not peft_ok:
        with pytest.raises(InputError, match="PEFT"):
            merge_checkpoint(base, str(adapter), out, progress=False)
        assert not os.path.exists(out)
        return
    merge_checkpoint(base, str(adapter), out, progress=False)
    want = model.merge_and_unload().state_dict()
    got = load_file(os.path.join(out, "model.safetensors"))
    assert set(got) == set(want)
    for k, v in got.items():
        assert torch.allclose(v, want[k], atol=1e-6, rtol=0), k


@pytest.mark.parametrize(
    "names,expected",
    [
        (["base_model.model.m.q.lora_A.weight", "base_model.model.m.q.lora_B.weight"], 0),
        (["m.q.lora_A.weight"], 1),
        (["base_model.model.m.q.lora_A.other.weight"], 1),
        (["base_model.model.m.q.lora_embedding_A.other"], 1),
        (["base_model.model.m.q.lora_embedding_A.default"], 0),
        (["base_model.model.m.q.lora_embedding_A", "base_model.model.m.q.lora_embedding_A.default"], 1),
        (["base_model.model.m.q.lora_magnitude_vector.second"], 1),
        (["base_model.model.m.q.lora_A.default.weight", "base_model.model.m.q.lora_A.weight"], 1),
        (["x.lora_A.weight", "base_model.model.m.q.lora_A.other.weight"], 2),
        (["base_model.model.m.default.lora_A.weight"], 0),
        (["base_model.vera_A", "base_model.vera_B", "base_model.model.m.q.vera_lambda_b"], 0),
        (["vera_A"], 1),
    ],
)
def test_stored_key_rules(names, expected):
    assert len(stored_key_problems(names)) == expected


# ---------------------------------------------------------------------------------------------------------------
# 5. Numbers NaN cannot slip through


@pytest.mark.parametrize(
    "value,integer,ok",
    [
        (16, False, True),
        (0.5, False, True),
        (8, True, True),
        (float("nan"), False, False),
        (float("inf"), False, False),
        (float("-inf"), False, False),
        (0, False, False),
        (-1, False, False),
        (-0.0, False, False),
        (True, False, False),
        ("8", False, False),
        (None, False, False),
        (2.0, True, False),
        (1e308, False, True),
        (-(2**70), True, False),
    ],
)
def test_positive_number(value, integer, ok):
    assert positive_number(value, integer=integer) is ok


@pytest.mark.parametrize("err", [float("nan"), float("inf"), -float("nan"), 2e-3, 1.0])
def test_self_check_refuses_nan_and_large_errors(err):
    with pytest.raises(MergeCheckError, match="self-check failed"):
        check_probe_error("w", 0, 4, err)


@pytest.mark.parametrize("err", [0.0, 1e-7, 1e-3])
def test_self_check_passes_small_errors(err):
    check_probe_error("w", 0, 4, err)


# ---------------------------------------------------------------------------------------------------------------
# 6. Integer and float8 tensors never take a delta; untouched ones are copied as they are

_TARGET = "model.layers.0.self_attn.q_proj.weight"
_OTHER = "model.layers.1.mlp.down_proj.weight"


def _base_with_dtype(src: str, folder: str, names: list[str], dtype: torch.dtype) -> str:
    shutil.copytree(src, folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    for n in names:
        tensors[n] = (tensors[n] * 50).to(dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


_STORED = [
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
] + [getattr(torch, n) for n in ("uint16", "uint32") if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", _STORED, ids=str)
def test_non_float_target_is_refused(dtype, make_base, make_adapter, tmp_path):
    base = _base_with_dtype(make_base("llama"), str(tmp_path / "base"), [_TARGET], dtype)
    with pytest.raises(InputError, match=r"integers or float8: model\.layers\.0\.self_attn\.q_proj\.weight"):
        merge_checkpoint(base, make_adapter("llama"), str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.bool], ids=str)
def test_untouched_non_float_tensor_is_copied_unchanged(dtype, make_base, make_adapter, tmp_path):
    base = _base_with_dtype(make_base("llama"), str(tmp_path / "base"), [_OTHER], dtype)
    merge_checkpoint(
        base,
        make_adapter("llama", "qv", target_modules=["q_proj", "v_proj"]),
        str(tmp_path / "out"),
        progress=False,
        dtype="bfloat16",
    )
    with safe_open(os.path.join(base, "model.safetensors"), "pt") as f:
        want = f.get_tensor(_OTHER)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        got = f.get_tensor(_OTHER)
        assert f.get_tensor(_TARGET).dtype == torch.bfloat16
    assert got.dtype == dtype and _same_bytes(got, want)


def test_float64_target_is_merged(make_base, make_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = _base_with_dtype(make_base("llama"), str(tmp_path / "base"), [_TARGET], torch.float64)
    adapter = make_adapter("llama")
    merge_checkpoint(base, adapter, str(tmp_path / "out"), progress=False, dtype="float32")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    want = model.merge_and_unload().state_dict()[_TARGET]
    got = load_file(str(tmp_path / "out" / "model.safetensors"))[_TARGET]
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# 7. Every non-weight file of the base comes along (sentence-transformers pipelines included)


def _sentence_transformers_base(folder: str) -> str:
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    hf = folder + "-hf"
    os.makedirs(hf)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the a cat dog sat on mat ran fast big red".split()
    words += [f"w{i}" for i in range(100)]
    with open(os.path.join(hf, "vocab.txt"), "w") as f:
        f.write("\n".join(words) + "\n")
    torch.manual_seed(0)
    BertModel(
        BertConfig(
            vocab_size=len(words),
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
        )
    ).save_pretrained(hf)
    BertTokenizerFast(os.path.join(hf, "vocab.txt")).save_pretrained(hf)
    st_model = SentenceTransformer(
        modules=[
            models.Transformer(hf, max_seq_length=24),
            models.Pooling(64, pooling_mode="mean"),
            models.Dense(64, 32),
            models.Normalize(),
        ]
    )
    st_model.save(folder)
    return folder


@pytest.fixture(scope="module")
def st_base_and_adapter(tmp_path_factory):
    pytest.importorskip("sentence_transformers")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    from peft_shardmerge.testing import perturb_trainable

    root = tmp_path_factory.mktemp("st")
    base = _sentence_transformers_base(str(root / "base"))
    model = get_peft_model(
        AutoModel.from_pretrained(base), LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"])
    )
    perturb_trainable(model, 0.2)
    model.save_pretrained(str(root / "adapter"))
    return base, str(root / "adapter")


SENTENCES = ["the cat sat on the mat", "a big red dog ran fast", "w1 w2 w3"]


def _reference_embeddings(base: str, adapter: str) -> torch.Tensor:
    from peft import PeftModel
    from sentence_transformers import SentenceTransformer

    st_model = SentenceTransformer(base, device="cpu")
    st_model[0].model = PeftModel.from_pretrained(st_model[0].model, adapter)
    return st_model.encode(SENTENCES, convert_to_tensor=True)


def _tree(folder: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs}


@pytest.mark.slow
def test_sentence_transformers_pipeline_survives_the_disk_merge(st_base_and_adapter, tmp_path):
    from sentence_transformers import SentenceTransformer

    base, adapter = st_base_and_adapter
    out = str(tmp_path / "out")
    merge_checkpoint(base, adapter, out, progress=False)
    assert _tree(base) <= _tree(out)
    assert not any(os.path.dirname(rel) for rel in _tree(out) - _tree(base))  # nothing new inside the pipeline
    for rel in _tree(base) - {"config.json", "model.safetensors"}:
        assert open(os.path.join(base, rel), "rb").read() == open(os.path.join(out, rel), "rb").read(), rel
    merged = SentenceTransformer(out, device="cpu")
    ref_model = SentenceTransformer(base, device="cpu")
    assert (
        [type(m).__name__ for m in merged]
        == [type(m).__name__ for m in ref_model]
        == ["Transformer", "Pooling", "Dense", "Normalize"]
    )
    assert merged.max_seq_length == ref_model.max_seq_length == 24
    got = merged.encode(SENTENCES, convert_to_tensor=True)
    want = _reference_embeddings(base, adapter)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(ref_model.encode(SENTENCES, convert_to_tensor=True), want, atol=1e-3)


def test_sentence_transformers_pipeline_survives_the_in_process_merge(st_base_and_adapter, tmp_path):
    from peft import PeftModel
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from peft_shardmerge import merge_and_save

    base, adapter = st_base_and_adapter
    for precision in ("original", "dequantized"):
        model = PeftModel.from_pretrained(AutoModel.from_pretrained(base), adapter)
        out = str(tmp_path / precision)
        merge_and_save(model, out, base_precision=precision, dtype=torch.float32, progress=False)
        assert _tree(base) - {"generation_config.json"} <= _tree(out), precision
        got = SentenceTransformer(out, device="cpu").encode(SENTENCES, convert_to_tensor=True)
        assert torch.allclose(got, _reference_embeddings(base, adapter), atol=1e-5), precision


def test_side_files_rules(tmp_path):
    base = tmp_path / "base"
    (base / "1_Pooling").mkdir(parents=True)
    (base / "2_Dense").mkdir()
    (base / "notes").mkdir()
    (base / "onnx").mkdir()
    (base / ".cache").mkdir()
    outside = tmp_path / "secret.txt"
    outside.write_text("not yours")
    files = {
        "config.json": 1,
        "model.safetensors": 0,
        "model-00001-of-00002.safetensors": 0,
        "model.safetensors.index.json": 0,
        "pytorch_model.bin": 0,
        "pytorch_model.bin.index.json": 0,
        "consolidated.pth": 0,
        "model.gguf": 0,
        "training_args.pt": 0,
        "quantize_config.json": 0,
        "tokenizer.json": 1,
        "README.md": 1,
        "modules.json": 1,
        "sentence_bert_config.json": 1,
        "1_Pooling/config.json": 1,
        "2_Dense/config.json": 1,
        "2_Dense/model.safetensors": 1,
        "notes/eval.txt": 0,
        "onnx/model.onnx": 0,
        ".cache/x": 0,
        ".gitattributes": 0,
        "manifest.json": 0,
        "LICENSE": 1,
    }
    for rel in files:
        (base / rel).write_text(json.dumps([{"path": "2_Dense"}]) if rel == "modules.json" else "x")
    os.symlink(outside, base / "leak.txt")
    os.symlink(tmp_path, base / "leakdir")
    os.symlink(base / "README.md", base / "LICENSE.txt")  # a link inside the folder is followed
    got = set(list_side_files(str(base)))
    want = {rel for rel, keep in files.items() if keep and rel != "config.json"} | {"LICENSE.txt"}
    assert got == want


def test_side_files_of_a_hub_cache_snapshot_follow_links_into_blobs_only(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    (snap / "1_Pooling").mkdir(parents=True)
    for name, blob in [
        ("tokenizer.json", "b1"),
        ("modules.json", "b2"),
        ("1_Pooling/config.json", "b3"),
        ("model.safetensors", "b4"),
    ]:
        (repo / "blobs" / blob).write_text(blob)
        depth = "../" * (name.count("/") + 2)
        os.symlink(f"{depth}blobs/{blob}", snap / name)
    (tmp_path / "elsewhere.txt").write_text("no")
    os.symlink(tmp_path / "elsewhere.txt", snap / "stray.txt")
    assert list_side_files(str(snap)) == ["1_Pooling/config.json", "modules.json", "tokenizer.json"]
