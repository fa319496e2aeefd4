"""The K-quant ports against llama.cpp: bytes equal to ``ggml-quants.c`` compiled from the pinned source (all
inputs, the edge cases included), values that gguf-py's own dequantizer reads back, and the type llama-quantize
gives each tensor (``src/llama-quant.cpp``: read by hand, and llama.cpp's own recorded answers for real models)."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from peft_shardmerge.output import gguf_kquants
from peft_shardmerge.output.gguf_kquants import kquant_tensor_types, quantize_q4_k, quantize_q5_k, quantize_q6_k
from tests import gguf_cquants

PORTS = {"q4_K": quantize_q4_k, "q5_K": quantize_q5_k, "q6_K": quantize_q6_k}
_NUMPY_BLOCKS = {
    "q4_K": gguf_kquants._q4_k_blocks,
    "q5_K": gguf_kquants._q5_k_blocks,
    "q6_K": gguf_kquants._q6_k_blocks,
}


@pytest.fixture(params=["numba", "numpy"])
def impl(request) -> dict:
    """Both implementations, each on the same inputs: the numba kernels (what ``quantize_q*_k`` run where numba
    imports) and the numpy port (what they run without it)."""
    if request.param == "numba":
        pytest.importorskip("numba")
        assert gguf_kquants.numba_kernels is not None  # the public functions run the kernels
        return PORTS
    return {
        kind: functools.partial(gguf_kquants._quantize, kind=kind.upper(), quantize_blocks=blocks, numba=False)
        for kind, blocks in _NUMPY_BLOCKS.items()
    }


def _cases(seed: int, n: int = 160) -> dict[str, np.ndarray]:
    """Rows of 512 values (two super-blocks each) from distributions that reach every branch of the C."""
    rng = np.random.default_rng(seed)
    shape = (n, 512)
    normal = rng.standard_normal(shape)
    cases = {
        "weights": normal * 0.02,
        "normal": normal,
        "tiny": normal * 1e-30,
        "denormal": normal * 1e-41,  # every value below float32's normal range
        "eps": normal * 1e-15,  # around GROUP_MAX_EPS
        "huge": normal * 1e30,  # squares overflow to inf
        "float32 max": rng.choice([-1.0, 1.0], shape) * np.finfo(np.float32).max * rng.random(shape),
        "wide range": normal * 10.0 ** rng.integers(-20, 20, shape),
        "negative only": -np.abs(normal),
        "positive offset": np.abs(normal) + 3,
        "narrow offset": 1000 + normal * 1e-3,
        "negative narrow": -1000 + normal * 1e-3,
        "zeros": np.zeros(shape),
        "signed zeros and denormals": rng.choice(np.array([-0.0, 0.0, 1e-45, -1e-45], np.float32), shape),
        "constant": np.full(shape, -2.5),
        "heavy tails": rng.standard_cauchy(shape),
        "sparse": np.where(rng.random(shape) < 0.8, 0, normal),
        "one value per row": np.where(np.arange(512) == rng.integers(0, 512, (n, 1)), normal, 0),
        "integers": rng.integers(-8, 8, shape),
        "ties": rng.choice(np.array([-1, 1, 0.5, -0.5, 0], np.float32), shape),
        "bf16 values": (normal.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32),
        "f16 values": (normal * 0.05).astype(np.float16),
        "inf": np.where(rng.random(shape) < 0.02, np.inf * np.sign(normal), normal),
        "nan": np.where(rng.random(shape) < 0.02, np.nan, normal),
    }
    # half the super-blocks mixed from different cases, so one row holds blocks that take different branches
    mixed = np.stack([cases[k][: n // 2].reshape(-1, 256) for k in ("zeros", "normal", "constant", "tiny")], 1)
    cases["mixed blocks"] = mixed.reshape(-1, 512)
    return {name: np.asarray(x, dtype=np.float32) for name, x in cases.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", sorted(PORTS))
def test_bytes_equal_llama_cpp(kind, seed, impl):
    with np.errstate(all="ignore"):
        cases = _cases(seed)
    for name, rows in cases.items():
        want = gguf_cquants.quantize(kind, rows)
        got = impl[kind](rows)
        assert got.dtype == np.uint8 and got.shape == want.shape, name
        bad = np.flatnonzero((got != want).any(axis=1))
        assert bad.size == 0, (
            f"{kind} {name}: {bad.size} of {len(rows)} rows differ from llama.cpp, first row {bad[0]}"
        )


def _nan_payloads(n: int = 64) -> np.ndarray:
    """Rows holding NaNs of either sign with payloads (quiet and signalling) among normal values: nearest_int reads a
    NaN's payload bits, so they reach the levels."""
    rng = np.random.default_rng(5)
    bits = rng.standard_normal((n, 512)).astype(np.float32).view(np.uint32)
    nans = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0xFFA00000, 0x7FFFFFFF], np.uint32)
    return np.where(rng.random(bits.shape) < 0.01, rng.choice(nans, bits.shape), bits).view(np.float32)


@pytest.mark.parametrize("kind", sorted(PORTS))
def test_bytes_equal_llama_cpp_long_rows_and_chunks(kind, impl, monkeypatch):
    """Long rows, a single row, non-float32 input, super-blocks split over several chunks (the numpy port's
    ``_CHUNK``; the kernels' 16 a prange iteration, a partial one last), NaN payloads, and numba's thread count."""
    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((24, 4096)) * 0.02).astype(np.float32)
    assert np.array_equal(impl[kind](rows), gguf_cquants.quantize(kind, rows))
    assert np.array_equal(impl[kind](rows[:1].astype(np.float64)), gguf_cquants.quantize(kind, rows[:1]))
    odd = rows.reshape(-1, 256)[:37]  # 37 super-blocks: 2 whole chunks of 16 and a partial one
    assert np.array_equal(impl[kind](odd), gguf_cquants.quantize(kind, odd))
    assert np.array_equal(impl[kind](_nan_payloads()), gguf_cquants.quantize(kind, _nan_payloads()))
    monkeypatch.setattr(gguf_kquants, "_CHUNK", 7)
    assert np.array_equal(impl[kind](rows[:5]), gguf_cquants.quantize(kind, rows[:5]))
    assert impl[kind](np.zeros((0, 256), np.float32)).shape == (0, gguf_kquants.BLOCK_BYTES[kind.upper()])
    if impl is PORTS:
        import numba

        threads = numba.get_num_threads()
        try:
            numba.set_num_threads(1)
            assert np.array_equal(impl[kind](rows[:5]), gguf_cquants.quantize(kind, rows[:5]))
        finally:
            numba.set_num_threads(threads)


@pytest.mark.parametrize("kind", sorted(PORTS))
def test_rows_must_be_whole_super_blocks(kind, impl):
    with pytest.raises(ValueError, match="multiple of 256"):
        impl[kind](np.zeros((2, 300), np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        impl[kind](np.zeros(512, np.float32))


def testnumba_kernels_take_float32_super_blocks():
    gguf_kquants_numba = pytest.importorskip("peft_shardmerge.output.gguf_kquants_numba")
    for bad in (np.zeros((2, 512), np.float32), np.zeros((2, 256), np.float64), np.zeros(256, np.float32)):
        with pytest.raises(ValueError, match="float32"):
            gguf_kquants_numba.quantize_blocks(bad, "Q4_K")
    strided = np.random.default_rng(6).standard_normal((8, 512)).astype(np.float32)[:, :256]
    assert np.array_equal(gguf_kquants_numba.quantize_blocks(strided, "Q5_K"), gguf_cquants.quantize("q5_K", strided))


@pytest.mark.parametrize(("kind", "levels"), [("q4_K", 15), ("q5_K", 31), ("q6_K", 63)])
def test_gguf_py_dequantizes_what_we_write(kind, levels):
    """gguf-py's dequantizer (written independently of llama.cpp's C) reads our bytes back to within the format's
    step: a wrong layout (nibbles, scales, signs, the half scales) lands far outside it."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((64, 1024)) * rng.uniform(0.01, 3, (64, 1))).astype(np.float32)
    x[:4] = -np.abs(x[:4])  # rows with a negative range only
    x[4:8] += 5  # and a positive one
    back = gguf.quants.dequantize(PORTS[kind](x), gguf.GGMLQuantizationType[kind.upper()])
    assert back.shape == x.shape and back.dtype == np.float32
    blocks = x.reshape(-1, 256)
    err = np.abs(back - x).reshape(-1, 256).max(axis=1)
    span = np.maximum(blocks.max(axis=1), 0) - np.minimum(blocks.min(axis=1), 0)  # the mins are never above 0
    assert (err <= 1.1 * span / levels).all()
    assert np.sqrt(np.mean((back - x) ** 2)) < 1.5 * np.sqrt(np.mean(x**2)) / levels
    zeros = np.zeros((2, 256), np.float32)
    assert not gguf.quants.dequantize(PORTS[kind](zeros), gguf.GGMLQuantizationType[kind.upper()]).any()


# ---------------------------------------------------------------------------------------------------------------------
# tensor types. Line numbers: src/llama-quant.cpp of the pinned llama-cpp-python sdist (tests/gguf_refs.py)
# ---------------------------------------------------------------------------------------------------------------------


def _llama_like(n_layer: int, n_embd: int = 256, n_ff: int = 768, n_vocab: int = 1000, kv: int = 64, tied=False):
    tensors = [("token_embd.weight", (n_embd, n_vocab)), ("output_norm.weight", (n_embd,))]
    if not tied:
        tensors.append(("output.weight", (n_embd, n_vocab)))
    for i in range(n_layer):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (n_embd,)),
            (f"blk.{i}.attn_q.weight", (n_embd, n_embd)),
            (f"blk.{i}.attn_k.weight", (n_embd, kv)),
            (f"blk.{i}.attn_v.weight", (n_embd, kv)),
            (f"blk.{i}.attn_output.weight", (n_embd, n_embd)),
            (f"blk.{i}.ffn_norm.weight", (n_embd,)),
            (f"blk.{i}.ffn_gate.weight", (n_embd, n_ff)),
            (f"blk.{i}.ffn_up.weight", (n_embd, n_ff)),
            (f"blk.{i}.ffn_down.weight", (n_ff, n_embd)),
        ]
    return tensors


# use_more_bits(i, 8) (line 452-454): i < 1 or i >= 7 or (i - 1) % 3 == 2
MORE_BITS_OF_8 = {0, 3, 6, 7}


def _expected_tiny_llama(ftype: str) -> dict[str, str]:
    """Read off llama_tensor_get_type_impl for an 8-layer untied llama whose rows are all multiples of 256."""
    default = {"q4_k_m": "Q4_K", "q4_k_s": "Q4_K", "q5_k_m": "Q5_K", "q5_k_s": "Q5_K", "q6_k": "Q6_K"}.get(
        ftype, ftype.upper()
    )  # llama_ftype_get_default_type (line 878-920)
    want = {name: default for name, _ in _llama_like(8)}
    for name in want:
        if name.endswith("norm.weight"):
            want[name] = "F32"  # tensor_allows_quantization: "_norm.weight" and 1-D (lines 292, 300): kept
    # OUTPUT (line 490-510): Q6_K unless the default is Q8_0; the untied token_embd keeps the default (line 524)
    want["output.weight"] = "Q8_0" if default == "Q8_0" else "Q6_K"
    for i in range(8):
        # attn_v (lines 590-592): Q4_K_M / Q5_K_M -> Q6_K where use_more_bits(i_attention_wv, n_attention_wv);
        # Q4_K_S -> Q5_K for the first four
        if ftype in ("q4_k_m", "q5_k_m") and i in MORE_BITS_OF_8:
            want[f"blk.{i}.attn_v.weight"] = "Q6_K"
        if ftype == "q4_k_s" and i < 4:
            want[f"blk.{i}.attn_v.weight"] = "Q5_K"
        # ffn_down (lines 646-660): Q4_K_M / Q5_K_M -> Q6_K where use_more_bits(i, n_layer); Q4_K_S -> Q5_K for
        # i < n_layer / 8
        if ftype in ("q4_k_m", "q5_k_m") and i in MORE_BITS_OF_8:
            want[f"blk.{i}.ffn_down.weight"] = "Q6_K"
        if ftype == "q4_k_s" and i < 1:
            want[f"blk.{i}.ffn_down.weight"] = "Q5_K"
    return want


@pytest.mark.parametrize("ftype", ["q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q8_0", "q4_0", "q5_1"])
def test_types_of_a_tiny_llama(ftype):
    got = kquant_tensor_types(ftype, _llama_like(8), n_layer=8)
    assert got == _expected_tiny_llama(ftype)


def test_types_table_q4_k_m():
    """The same, spelled out for Q4_K_M."""
    got = kquant_tensor_types("Q4_K_M", _llama_like(8), n_layer=8)
    assert got["token_embd.weight"] == "Q4_K"
    assert got["output.weight"] == "Q6_K"
    assert got["output_norm.weight"] == got["blk.5.attn_norm.weight"] == got["blk.5.ffn_norm.weight"] == "F32"
    attn_v = [got[f"blk.{i}.attn_v.weight"] for i in range(8)]
    assert attn_v == ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert [got[f"blk.{i}.ffn_down.weight"] for i in range(8)] == attn_v
    for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert {got[f"blk.{i}.{part}.weight"] for i in range(8)} == {"Q4_K"}


def test_counters_follow_llama_cpp_order():
    """llama.cpp visits tensors by layer number then name (llama-model-loader.h weight_name_comparer), whatever the
    file's order: blk.10 comes after blk.9, so Q4_K_S's "first four attn_v" (line 592) are blk.0-3."""
    tensors = _llama_like(12)
    rng = np.random.default_rng(0)
    shuffled = [tensors[i] for i in rng.permutation(len(tensors))]
    got = kquant_tensor_types("q4_k_s", shuffled, n_layer=12)
    assert got == kquant_tensor_types("q4_k_s", tensors, n_layer=12)
    assert [i for i in range(12) if got[f"blk.{i}.attn_v.weight"] == "Q5_K"] == [0, 1, 2, 3]
    assert [i for i in range(12) if got[f"blk.{i}.ffn_down.weight"] == "Q5_K"] == [0]  # 12 / 8 = 1


def test_tied_embeddings_and_rows_that_do_not_fit():
    """Gemma-3-1B-shaped: no output.weight, so token_embd takes the output rule (line 490); n_embd 1152 is not a
    multiple of 256, so that rule gives Q8_0 (line 502) and the K-types fall back (tensor_type_fallback, lines
    390-444: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; F16 when not even 32 divides the row)."""
    tensors = _llama_like(26, n_embd=1152, n_ff=6912, n_vocab=262144, kv=256, tied=True)
    tensors = [(n, (1024, s[1]) if "attn_output" in n else s) for n, s in tensors]  # 4 heads of 256
    tensors.append(("blk.0.odd.weight", (100, 8)))
    got = kquant_tensor_types("q4_k_m", tensors, n_layer=26)
    assert got["token_embd.weight"] == "Q8_0"
    assert got["blk.0.attn_q.weight"] == "Q5_0" and got["blk.0.attn_output.weight"] == "Q4_K"
    assert got["blk.0.attn_v.weight"] == "Q8_0" and got["blk.4.attn_v.weight"] == "Q5_0"  # Q6_K / Q4_K fell back
    assert got["blk.0.ffn_down.weight"] == "Q6_K" and got["blk.4.ffn_down.weight"] == "Q4_K"  # 6912 = 27 * 256
    assert got["blk.0.odd.weight"] == "F16"
    got = kquant_tensor_types("q5_k_s", tensors, n_layer=26)
    assert got["blk.0.attn_q.weight"] == "Q5_1" and got["token_embd.weight"] == "Q8_0"
    got = kquant_tensor_types("q4_k_m", _llama_like(4, tied=True), n_layer=4)
    assert got["token_embd.weight"] == "Q6_K"
    assert kquant_tensor_types("q8_0", _llama_like(4, tied=True), n_layer=4)["token_embd.weight"] == "Q8_0"


def test_kept_tensors_keep_their_source_type():
    tensors = [*_llama_like(2), ("rope_freqs.weight", (32,)), ("blk.0.ffn_gate_inp.weight", (256, 8))]
    got = kquant_tensor_types("q4_k_m", tensors, n_layer=2, source_types={"blk.0.ffn_gate_inp.weight": "F16"})
    assert got["rope_freqs.weight"] == "F32" and got["blk.0.ffn_gate_inp.weight"] == "F16"
    # ggml_n_dims counts trailing axes of 1 out: a (256, 1) tensor is 1-D (line 292)
    got = kquant_tensor_types("q4_k_m", [("blk.0.attn_q.weight", (256, 1))], n_layer=1)
    assert got == {"blk.0.attn_q.weight": "F32"}


def _moe(n_layer: int, n_expert: int, n_embd: int = 512, n_ff: int = 256):
    tensors = [("token_embd.weight", (n_embd, 1000)), ("output.weight", (n_embd, 1000))]
    for i in range(n_layer):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (n_embd,)),
            (f"blk.{i}.attn_q.weight", (n_embd, n_embd)),
            (f"blk.{i}.attn_k.weight", (n_embd, 128)),
            (f"blk.{i}.attn_v.weight", (n_embd, 128)),
            (f"blk.{i}.attn_output.weight", (n_embd, n_embd)),
            (f"blk.{i}.ffn_gate_inp.weight", (n_embd, n_expert)),
            (f"blk.{i}.ffn_gate_exps.weight", (n_embd, n_ff, n_expert)),
            (f"blk.{i}.ffn_up_exps.weight", (n_embd, n_ff, n_expert)),
            (f"blk.{i}.ffn_down_exps.weight", (n_ff, n_embd, n_expert)),
        ]
    return tensors


def test_mixtral_rules():
    """n_expert == 8: attn_v and attn_k Q8_0 whatever the file type (lines 599-603, 606-609), attn_output Q5_K for
    Q4_K_* (lines 671-677); the router is not quantized; ffn_down's layer comes from its name (layer_info)."""
    got = kquant_tensor_types("q4_k_m", _moe(32, 8), n_layer=32, n_expert=8)
    assert {got[f"blk.{i}.attn_v.weight"] for i in range(32)} == {"Q8_0"}
    assert {got[f"blk.{i}.attn_k.weight"] for i in range(32)} == {"Q8_0"}
    assert {got[f"blk.{i}.attn_output.weight"] for i in range(32)} == {"Q5_K"}
    assert got["blk.0.ffn_gate_inp.weight"] == "F32"
    # use_more_bits(i, 32): i < 4, i >= 28, (i - 4) % 3 == 2
    more = [i for i in range(32) if i < 4 or i >= 28 or (i - 4) % 3 == 2]
    assert [i for i in range(32) if got[f"blk.{i}.ffn_down_exps.weight"] == "Q6_K"] == more
    got = kquant_tensor_types("q6_k", _moe(2, 8), n_layer=2, n_expert=8)
    assert got["blk.1.attn_v.weight"] == got["blk.1.attn_k.weight"] == "Q8_0"
    assert got["blk.1.attn_output.weight"] == "Q6_K"


def test_qwen3_moe_rules():
    """128 experts: no Mixtral rules, attn_v counted as for a dense model, ffn_down_exps by the layer in its name."""
    got = kquant_tensor_types("q4_k_m", _moe(16, 128), n_layer=16, n_expert=128)
    more = [i for i in range(16) if i < 2 or i >= 14 or (i - 2) % 3 == 2]
    assert [i for i in range(16) if got[f"blk.{i}.attn_v.weight"] == "Q6_K"] == more
    assert [i for i in range(16) if got[f"blk.{i}.ffn_down_exps.weight"] == "Q6_K"] == more
    assert {got[f"blk.{i}.attn_k.weight"] for i in range(16)} == {"Q4_K"}
    assert got["blk.3.ffn_gate_inp.weight"] == "F32"


def test_phi3_fused_qkv_counts_as_attn_v():
    """attn_qkv is attn_v-like (category_is_attn_v, line 157): Q4_K_M gives it Q6_K where use_more_bits."""
    tensors = [("token_embd.weight", (256, 1000)), ("output.weight", (256, 1000))]
    for i in range(8):
        tensors += [(f"blk.{i}.attn_qkv.weight", (256, 768)), (f"blk.{i}.ffn_up.weight", (256, 1024))]
        tensors += [(f"blk.{i}.ffn_down.weight", (512, 256)), (f"blk.{i}.attn_output.weight", (256, 256))]
    got = kquant_tensor_types("q4_k_m", tensors, n_layer=8, arch="phi3")
    assert {i for i in range(8) if got[f"blk.{i}.attn_qkv.weight"] == "Q6_K"} == MORE_BITS_OF_8
    assert got["blk.1.attn_qkv.weight"] == "Q4_K"


def test_70b_attn_v_and_65b():
    """LLM_TYPE_70B (models/llama.cpp line 28: 80 blocks and grouped-query attention) bumps Q4_K attn_v to Q5_K
    (line 593-597); a 65B (n_head == n_head_kv) does not; an 80-block llama needs the head counts to tell."""
    tensors = _llama_like(80)
    got = kquant_tensor_types("q4_k_s", tensors, n_layer=80, n_head=64, n_head_kv=8)
    assert {got[f"blk.{i}.attn_v.weight"] for i in range(80)} == {"Q5_K"}
    got = kquant_tensor_types("q4_k_s", tensors, n_layer=80, n_head=64, n_head_kv=64)
    assert got["blk.4.attn_v.weight"] == "Q4_K"
    assert kquant_tensor_types("q4_k_s", tensors, n_layer=80, arch="qwen2")["blk.4.attn_v.weight"] == "Q5_K"
    with pytest.raises(ValueError, match="n_head"):
        kquant_tensor_types("q4_k_s", tensors, n_layer=80)
    with pytest.raises(ValueError, match="unknown file type"):
        kquant_tensor_types("q3_k_m", tensors, n_layer=80)


# ---------------------------------------------------------------------------------------------------------------------
# llama.cpp's own answers: tests/snapshots/*.schema of ggml-org/llama.cpp (written by tests/test-quant-type-selection
# from llama_quant_compute_types, i.e. this very llama_tensor_get_type, for real models' tensor lists). Each section
# lists the tensors whose type differs from the file type's default; the others (among the quantized) have it.
# The tensor lists below are written with brace expansion ({a,b}) and ranges (0-9) instead of one line each.
# ---------------------------------------------------------------------------------------------------------------------

QWEN3_06B = """
# qwen3-0.6b.schema (commit a45da44f): n_embd=1024, n_ff=3072, n_vocab=151936, n_layer=28, n_head=16, n_head_kv=8
[Q4_0] output.weight q6_K
[Q4_1] output.weight q6_K
[Q8_0]
[Q5_0] output.weight q6_K
[Q5_1] output.weight q6_K
[Q4_K_S] output.weight q6_K; blk.{0-3}.attn_v.weight q5_K; blk.{0-2}.ffn_down.weight q5_K
[Q4_K_M] output.weight q6_K; blk.{0-2,5,8,11,14,17,20,23,24-27}.{attn_v,ffn_down}.weight q6_K
[Q5_K_S] output.weight q6_K
[Q5_K_M] output.weight q6_K; blk.{0-2,5,8,11,14,17,20,23,24-27}.{attn_v,ffn_down}.weight q6_K
[Q6_K]
"""

QWEN3_14B = """
# qwen3-14b.schema (commit a45da44f): n_embd=5120, n_ff=17408, n_vocab=151936, n_layer=40, n_head=40, n_head_kv=8
[Q4_0] output.weight q6_K
[Q8_0]
[Q5_1] output.weight q6_K
[Q4_K_S] output.weight q6_K; blk.{0-3}.attn_v.weight q5_K; blk.{0-4}.ffn_down.weight q5_K
[Q4_K_M] output.weight q6_K; blk.{0-4,7,10,13,16,19,22,25,28,31,34,35-39}.{attn_v,ffn_down}.weight q6_K
[Q5_K_S] output.weight q6_K
[Q5_K_M] output.weight q6_K; blk.{0-4,7,10,13,16,19,22,25,28,31,34,35-39}.{attn_v,ffn_down}.weight q6_K
[Q6_K]
"""

LLAMA31_70B = """
# meta-llama-3.1-70b-instruct.schema (commit 343313bd): n_embd=8192, n_ff=28672, n_vocab=128256, n_layer=80,
# n_head=64, n_head_kv=8 (an older snapshot, in the file's order: the same one for attn_v and ffn_down here)
[Q4_0] output.weight q6_K
[Q8_0]
[Q4_K_S] output.weight q6_K; blk.{0-79}.attn_v.weight q5_K; blk.{0-9}.ffn_down.weight q5_K
[Q4_K_M] output.weight q6_K
    blk.{0-9,12,15,18,21,24,27,30,33,36,39,42,45,48,51,54,57,60,63,66,69,70-79}.{attn_v,ffn_down}.weight q6_K
    blk.{10,11,13,14,16,17,19,20,22,23,25,26,28,29,31,32,34,35,37,38,40,41,43,44}.attn_v.weight q5_K
    blk.{46,47,49,50,52,53,55,56,58,59,61,62,64,65,67,68}.attn_v.weight q5_K
[Q5_K_S] output.weight q6_K
[Q5_K_M] output.weight q6_K
    blk.{0-9,12,15,18,21,24,27,30,33,36,39,42,45,48,51,54,57,60,63,66,69,70-79}.{attn_v,ffn_down}.weight q6_K
[Q6_K]
"""


def _expand(pattern: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", pattern)
    if not m:
        return [pattern]
    out = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        items = [str(i) for i in range(int(lo), int(hi) + 1)] if hi and lo.isdigit() else [part]
        for item in items:
            out += _expand(pattern[: m.start()] + item + pattern[m.end() :])
    return out


def _snapshot(text: str) -> dict[str, dict[str, str]]:
    """``[FTYPE] name type; name type`` lines (indented lines go on the section above) -> ftype -> name -> type."""
    sections: dict[str, dict[str, str]] = {}
    for line in text.strip().splitlines():
        if line.startswith("#"):
            continue
        if line.startswith("["):
            ftype, _, line = line[1:].partition("]")
            overrides = sections[ftype.lower()] = {}
        for entry in filter(None, (e.strip() for e in line.split(";"))):
            pattern, ttype = entry.rsplit(" ", 1)
            overrides.update({name: ttype.upper() for name in _expand(pattern)})
    return sections


def _qwen3_tensors(n_embd, n_ff, n_vocab, n_layer, n_head, n_head_kv, head_dim=128):
    tensors = [("token_embd.weight", (n_embd, n_vocab)), ("output.weight", (n_embd, n_vocab))]
    tensors.append(("output_norm.weight", (n_embd,)))
    for i in range(n_layer):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (n_embd,)),
            (f"blk.{i}.attn_q.weight", (n_embd, n_head * head_dim)),
            (f"blk.{i}.attn_k.weight", (n_embd, n_head_kv * head_dim)),
            (f"blk.{i}.attn_v.weight", (n_embd, n_head_kv * head_dim)),
            (f"blk.{i}.attn_q_norm.weight", (head_dim,)),
            (f"blk.{i}.attn_k_norm.weight", (head_dim,)),
            (f"blk.{i}.attn_output.weight", (n_head * head_dim, n_embd)),
            (f"blk.{i}.ffn_norm.weight", (n_embd,)),
            (f"blk.{i}.ffn_gate.weight", (n_embd, n_ff)),
            (f"blk.{i}.ffn_up.weight", (n_embd, n_ff)),
            (f"blk.{i}.ffn_down.weight", (n_ff, n_embd)),
        ]
    return tensors


@pytest.mark.parametrize(
    ("snapshot", "arch", "dims"),
    [
        (QWEN3_06B, "qwen3", (1024, 3072, 151936, 28, 16, 8)),
        (QWEN3_14B, "qwen3", (5120, 17408, 151936, 40, 40, 8)),
        (LLAMA31_70B, "llama", (8192, 28672, 128256, 80, 64, 8)),
    ],
    ids=["qwen3-0.6b", "qwen3-14b", "llama-3.1-70b"],
)
def test_types_match_llama_cpp_snapshots(snapshot, arch, dims):
    tensors = _qwen3_tensors(*dims)
    if arch == "llama":
        tensors = [t for t in tensors if "_q_norm" not in t[0] and "_k_norm" not in t[0]]
    n_layer, n_head, n_head_kv = dims[3:]
    for ftype, overrides in _snapshot(snapshot).items():
        got = kquant_tensor_types(ftype, tensors, n_layer, arch=arch, n_head=n_head, n_head_kv=n_head_kv)
        default = gguf_kquants.FTYPES[ftype]
        quantized = {name for name, shape in tensors if len(shape) == 2}
        assert set(overrides) <= quantized
        want = {name: overrides.get(name, default) for name in quantized}
        assert {name: got[name] for name in quantized} == want, ftype
        assert {got[name] for name, shape in tensors if len(shape) == 1} == {"F32"}


@pytest.mark.skipif(gguf_kquants.numba_kernels is None, reason="numba is not installed")
def test_q8_0_kernel_is_gguf_pys_q8_0():
    """Q8_0 through the numba kernel: the bytes of gguf-py's numpy Q8_0 (the converter's), on values of every
    scale, exact halves of a step, zero blocks and tiny values."""
    from peft_shardmerge.output.gguf_types import encode

    rng = np.random.default_rng(3)
    cases = [
        rng.standard_normal((300, 256)).astype(np.float32) * 0.02,
        np.zeros((3, 64), np.float32),
        (rng.standard_normal((40, 64)) * 1e-30).astype(np.float32),
        (rng.standard_normal((40, 64)) * 1e30).astype(np.float32),
        (np.round(rng.standard_normal((64, 64)) * 254) / 2).astype(np.float32),  # x * 127 / max on a .5
        rng.integers(-300, 300, (64, 96)).astype(np.float32),
    ]
    for x in cases:
        want = np.ascontiguousarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)).tobytes()
        assert encode(x, gguf.GGMLQuantizationType.Q8_0) == want
