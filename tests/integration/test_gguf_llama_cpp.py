"""GGUF output against llama.cpp itself (the pinned llama-cpp-python, built once per machine into a virtual
environment of its own; ``tests/gguf_runtime.py`` runs there):

- the quantized types equal ``llama_model_quantize`` (what ``llama-quantize`` runs) applied to the converter's f32
  file of PEFT's fp32 merge: every tensor's name, type, shape and bytes, and every metadata value;
- llama.cpp loads each type written and its logits agree with transformers' logits of PEFT's merge, within what the
  type's rounding costs (measured here, see ``LOGITS_TOLERANCE``).

The bases have hidden_size=256 and intermediate_size=512, so that every K-quant row type is used (rows of 256).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")

from peft_shardmerge import merge_checkpoint
from tests.integration.test_gguf import peft_merge

pytestmark = pytest.mark.slow

#: a base with rows of 256 (the K-quants' block) and more
SIZES = dict(hidden_size=256, intermediate_size=512)

#: the quantizer's types checked tensor for tensor against llama.cpp's (Llama and Mixtral are cheap, Qwen2's 151,936
#: token vocabulary is not: two types there)
QUANT_CASES = (
    [("llama", t) for t in ("q4_k_m", "q5_k_m", "q6_k", "q4_k_s", "q5_k_s", "q4_0", "q4_1", "q5_0", "q5_1")]
    + [("mixtral", t) for t in ("q4_k_m", "q5_k_m", "q6_k", "q4_0")]
    + [("qwen2", t) for t in ("q4_k_m", "q6_k")]
)

#: max |llama.cpp's logits - transformers' logits of PEFT's fp32 merge| / max |transformers' logits|, per type, on
#: 16 tokens; and (Llama) against transformers run on the weights the file holds, dequantized with gguf-py: what is
#: left there is llama.cpp's own rounding (its activations quantized to 8 bits against quantized weights, to bf16
#: against bf16, its KV cache in f16). Measured (llama-cpp-python 0.3.36 on CPU, GGML_NATIVE=OFF):
#:
#:   type     Llama   its weights   Qwen2
#:   f32      2.7e-4    2.7e-4     2.8e-4
#:   f16      7.3e-4    4.7e-4     6.8e-4
#:   bf16     5.0e-3    3.9e-3     5.3e-3
#:   q8_0     1.6e-2    9.8e-3     1.5e-2
#:   q6_k     5.2e-2    1.5e-2     4.1e-2
#:   q5_k_m   6.3e-2    1.3e-2
#:   q5_k_s   6.6e-2    1.6e-2
#:   q5_0     9.7e-2    1.1e-2
#:   q5_1     9.5e-2    1.2e-2
#:   q4_k_m   1.4e-1    1.3e-2     1.4e-1
#:   q4_k_s   1.3e-1    1.4e-2
#:   q4_0     1.9e-1    1.5e-2
#:   q4_1     1.7e-1    1.3e-2
#:
#: Tiny random weights have no outliers to spare: their rounding costs far more than a trained model's, hence the
#: large figures against PEFT's merge; against the file's own weights every quantized type is within 2e-2. The
#: tolerances are about twice the figures (f32's floor is the f16 KV cache).
LOGITS_TOLERANCE = {
    "f32": 1e-3,
    "f16": 1.5e-3,
    "bf16": 1e-2,
    "q8_0": 3.5e-2,
    "q6_k": 1e-1,
    "q5_k_m": 1.3e-1,
    "q5_k_s": 1.3e-1,
    "q5_0": 2e-1,
    "q5_1": 2e-1,
    "q4_k_m": 3e-1,
    "q4_k_s": 3e-1,
    "q4_0": 4e-1,
    "q4_1": 3.5e-1,
}
OWN_WEIGHTS_TOLERANCE = {"f32": 1e-3, "f16": 1e-3, "bf16": 8e-3}
OWN_WEIGHTS_QUANT_TOLERANCE = 3.5e-2

LOGITS_CASES = [("llama", t) for t in LOGITS_TOLERANCE] + [("qwen2", t) for t in ("f16", "q8_0", "q4_k_m")]

#: a text the tokenizers cut into at least 16 tokens
TEXT = "the quick brown fox merges a tensor shard, hello world 1234! " * 4


class Case:
    """One base and adapter: PEFT's fp32 merge (the references' input), the converter's f32 file of it, our files
    (each ``<type>/merged.gguf``: named as the converter names its model, after the merge's folder)."""

    def __init__(self, arch: str, gguf_case, root):
        self.arch = arch
        self.base, self.adapter, kind = gguf_case(arch, **SIZES)
        self.root = root
        self.merged = peft_merge(self.base, self.adapter, kind, str(root / "merged"))
        self._f32 = None
        self._logits = None

    def converter_f32(self) -> str:
        from tests.gguf_refs import run_converter

        if self._f32 is None:
            self._f32 = run_converter(self.merged, str(self.root / "converter-f32.gguf"), "f32")
        return self._f32

    def ours(self, outtype: str) -> str:
        out = self.root / outtype / "merged.gguf"
        if not out.exists():
            os.makedirs(out.parent, exist_ok=True)
            merge_checkpoint(self.base, self.adapter, str(out), outtype=outtype, progress=False)
        return str(out)

    def reference_logits(self) -> tuple[list[int], np.ndarray]:
        """16 ids of ``TEXT`` (no BOS) and transformers' logits of PEFT's merge on them."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self._logits is None:
            ids = AutoTokenizer.from_pretrained(self.merged)(TEXT, add_special_tokens=False)["input_ids"][:16]
            assert len(ids) == 16
            model = AutoModelForCausalLM.from_pretrained(self.merged, dtype=torch.float32).eval()
            with torch.no_grad():
                self._logits = ids, model(torch.tensor([ids])).logits[0].numpy()
        return self._logits


@pytest.fixture(scope="module")
def case(gguf_case, tmp_path_factory):
    """``arch -> Case`` (built once per module)."""
    from tests.gguf_refs import llama_cpp_python

    llama_cpp_python()  # skips here, before any merge, where llama.cpp cannot be built
    cases: dict[str, Case] = {}

    def get(arch: str) -> Case:
        if arch not in cases:
            cases[arch] = Case(arch, gguf_case, tmp_path_factory.mktemp(f"llama-cpp-{arch}"))
        return cases[arch]

    return get


def gguf_file(path: str) -> tuple[dict, list[str], dict[str, bytes]]:
    """A GGUF file's tensors (name -> (type, shape, raw bytes)), their order, and its metadata (key -> the value's
    bytes as written, type included)."""
    reader = gguf.GGUFReader(path)
    tensors = {
        t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape), np.asarray(t.data).view(np.uint8).tobytes())
        for t in reader.tensors
    }
    fields = {}
    for name, field in reader.fields.items():
        if not name.startswith("GGUF."):
            size = sum(int(p.nbytes) for p in field.parts)
            fields[name] = reader.data[field.offset : field.offset + size].tobytes()
    return tensors, [t.name for t in reader.tensors], fields


def llama_cpp_order(names: list[str]) -> list[str]:
    """The order ``llama_model_quantize`` writes tensors in (its loader's ``weight_name_comparer``): by layer
    (``blk.N.``, the others first), then by name."""

    def key(name: str):
        m = re.match(r"blk\.(\d+)\.", name)
        return (int(m.group(1)) if m else -1, name)

    return sorted(names, key=key)


@pytest.mark.parametrize("arch,outtype", QUANT_CASES, ids=[f"{a}-{t}" for a, t in QUANT_CASES])
def test_the_tensors_are_llama_quantizes_on_the_converters_f32(arch, outtype, case, tmp_path):
    """The whole file is llama.cpp's ``llama_model_quantize`` with its default parameters applied to the converter's
    f32 file: every tensor (name, type, shape, bytes), in its order (by layer then name), every metadata value, in
    its order (``general.quantization_version`` and ``general.file_type`` set anew, last)."""
    from tests.gguf_refs import llama_quantize

    c = case(arch)
    want_tensors, want_order, want_fields = gguf_file(
        llama_quantize(c.converter_f32(), str(tmp_path / "llama-quantize.gguf"), outtype)
    )
    got_tensors, got_order, got_fields = gguf_file(c.ours(outtype))
    assert sorted(got_tensors) == sorted(want_tensors)
    differ = [
        f"{name}: {got_tensors[name][:2]} != llama.cpp's {want_tensors[name][:2]}"
        + ("" if got_tensors[name][:2] != want_tensors[name][:2] else " (bytes)")
        for name in want_order
        if got_tensors[name] != want_tensors[name]
    ]
    assert differ == []
    assert got_order == want_order == llama_cpp_order(got_order)
    assert list(got_fields) == list(want_fields)
    assert [k for k in want_fields if got_fields[k] != want_fields[k]] == []
    with open(c.ours(outtype), "rb") as f, open(str(tmp_path / "llama-quantize.gguf"), "rb") as g:
        assert f.read() == g.read()
    if outtype.startswith("q4_k") or outtype.startswith("q5_k") or outtype == "q6_k":
        kinds = {t[0] for t in got_tensors.values()}
        assert {"Q6_K", outtype[:2].upper() + "_K"} <= kinds, kinds


def dequantized_logits(case: Case, path: str, ids: list[int]) -> np.ndarray:
    """transformers' logits of a Llama whose weights are a GGUF file's, dequantized with gguf-py (the converter's
    names and q/k row permutation undone)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(case.merged, dtype=torch.float32).eval()
    cfg = model.config
    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    layer = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    state = {}
    for t in gguf.GGUFReader(path).tensors:
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        stem = t.name.removesuffix(".weight")
        if stem.startswith("blk."):
            _, n, part = stem.split(".")
            name = f"model.layers.{n}.{layer[part]}"
            if part in ("attn_q", "attn_k"):
                heads = cfg.num_attention_heads if part == "attn_q" else cfg.num_key_value_heads
                w = w.reshape(heads, -1, 2, w.shape[-1]).swapaxes(1, 2).reshape(-1, w.shape[-1])
        else:
            name = top[stem]
        state[name + ".weight"] = torch.from_numpy(np.ascontiguousarray(w))
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("arch,outtype", LOGITS_CASES, ids=[f"{a}-{t}" for a, t in LOGITS_CASES])
def test_llama_cpp_runs_the_file_to_pefts_logits(arch, outtype, case):
    """llama.cpp loads the file and its logits on 16 tokens (the same ids: none added) are transformers' of PEFT's
    fp32 merge, within the type's tolerance; on Llama also, more tightly, transformers' on the weights the file holds
    (what llama.cpp computes is what the file means, and the quantization costs only what it should)."""
    from tests.gguf_refs import llama_cpp_logits

    c = case(arch)
    ids, want = c.reference_logits()
    path = c.ours(outtype)
    got = llama_cpp_logits(path, ids)
    assert got.shape == want.shape
    error = relative_error(got, want)
    own = relative_error(got, dequantized_logits(c, path, ids)) if arch == "llama" else None
    print(json.dumps({"arch": arch, "outtype": outtype, "relative_error": error, "own_weights": own}))
    assert error <= LOGITS_TOLERANCE[outtype], f"{outtype}: relative error {error:.3e}"
    if own is not None:
        assert own <= OWN_WEIGHTS_TOLERANCE.get(outtype, OWN_WEIGHTS_QUANT_TOLERANCE), f"{outtype}: {own:.3e}"
