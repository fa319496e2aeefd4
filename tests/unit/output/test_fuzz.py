"""Fuzzing the safetensors header parser and the index reader: only our own error, quickly, in bounded memory."""

from __future__ import annotations

import json
import os
import resource
import struct
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peft_shardmerge import ShardMergeError
from peft_shardmerge.checkpoint.base_folder import open_checkpoint
from peft_shardmerge.errors import CorruptFileError
from peft_shardmerge.io.safetensors_io import read_header

FUZZ = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
_DIR = tempfile.mkdtemp(prefix="peft-shardmerge-fuzz-")


def _parse(raw: bytes):
    path = os.path.join(_DIR, "x.safetensors")
    with open(path, "wb") as f:
        f.write(raw)
    try:
        return read_header(path)
    except CorruptFileError:
        return None


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(raw):
    _parse(raw)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "BOOL", "F7", ""]) | json_values,
        "shape": st.lists(st.integers(-2, 2**40), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-10, 2**40), min_size=0, max_size=3) | json_values,
    }
)


@pytest.mark.slow
@FUZZ
@given(
    st.dictionaries(st.text(max_size=10), entries | json_values, max_size=5),
    st.binary(max_size=256),
    st.one_of(st.none(), st.integers(0, 2**64 - 1)),
)
def test_structured_headers(header, data, length):
    raw = json.dumps(header).encode()
    n = len(raw) if length is None else length
    result = _parse(struct.pack("<Q", n) + raw + data)
    if result is not None:
        tensors, _ = result
        end = 8 + len(raw) + len(data)
        assert all(0 <= t.offset and t.offset + t.nbytes <= end for t in tensors)


def test_hostile_header_length_allocates_nothing():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for n in (2**64 - 1, 2**40, 99_999_999):
        assert _parse(struct.pack("<Q", n) + b"{}") is None
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 10_000  # KiB


def test_deeply_nested_header_is_our_error():
    raw = b"[" * 100_000 + b"]" * 100_000
    assert _parse(struct.pack("<Q", len(raw)) + raw) is None


@FUZZ
@given(
    st.one_of(
        json_values,
        st.fixed_dictionaries(
            {"weight_map": st.dictionaries(st.text(max_size=8), st.text(max_size=20) | json_values, max_size=4)}
        ),
    )
)
def test_index_reader(index):
    folder = tempfile.mkdtemp(dir=_DIR)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    try:
        open_checkpoint(folder)
    except ShardMergeError:
        pass


def test_nothing_unpickles_but_the_weights_only_adapter_reader():
    """Security: the only torch.load is the weights_only one for legacy adapter_model.bin; no pickle anywhere."""
    import ast

    import peft_shardmerge

    root = os.path.dirname(peft_shardmerge.__file__)
    loads = []
    for name in sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs):
        if not name.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(open(os.path.join(root, name)).read())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(m.split(".")[0] in ("pickle", "dill", "cloudpickle") for m in mods), name
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
            ):
                safe = any(k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in node.keywords)
                loads.append((name, safe))
    assert loads == [(os.path.join("checkpoint", "adapter.py"), True)]


def test_code_in_a_checkpoint_is_never_run(tmp_path, make_base, make_adapter):
    import shutil

    from peft_shardmerge import merge_checkpoint

    base = shutil.copytree(make_base("llama"), tmp_path / "base")
    marker = tmp_path / "pwned"
    (base / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((base / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    (base / "config.json").write_text(json.dumps(config))
    merge_checkpoint(str(base), make_adapter("llama", "default"), str(tmp_path / "out"), progress=False)
    assert not marker.exists()
