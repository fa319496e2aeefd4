"""Shared fixtures: tiny random bases and adapters built once per session, and the PEFT reference merge."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")  # pushes to the test hub take the LFS path
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the model-class checks run in every test (a kept verdict would skip them); tests of the cache turn it on themselves
os.environ.setdefault("PEFT_SHARDMERGE_CHECKS_CACHE", "0")

import pytest
import torch

from peft_shardmerge.testing import build_adapter, build_base, token_ids

#: name -> (arch, dtype, shard size of the saved base, config overrides)
BASES = {
    "llama": ("llama", torch.float32, None, {}),
    "llama_sharded": ("llama", torch.float32, "100KB", {}),
    "llama_bias": ("llama", torch.float32, None, {"attention_bias": True}),
    "llama_bf16": ("llama", torch.bfloat16, "200KB", {}),
    "qwen2": ("qwen2", torch.float32, None, {}),
    "gpt2": ("gpt2", torch.float32, "150KB", {}),
}


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def make_base(workdir):
    """Return a function name -> folder of a saved tiny base (built once)."""
    cache: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in cache:
            arch, dtype, shard, overrides = BASES[name]
            cache[name] = build_base(
                str(workdir / f"base-{name}"), arch, dtype=dtype, max_shard_size=shard, **overrides
            )
        return cache[name]

    return make


@pytest.fixture(scope="session")
def make_adapter(workdir, make_base):
    """Return a function (base name, adapter tag, **lora kwargs) -> folder of a saved adapter (built once)."""
    cache: dict[tuple[str, str], str] = {}

    def make(base: str, tag: str = "default", **kwargs) -> str:
        key = (base, tag)
        if key not in cache:
            cache[key] = build_adapter(
                make_base(base), str(workdir / f"adapter-{base}-{tag}"), arch=BASES[base][0], **kwargs
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def peft_reference():
    """Return a function (base, adapter) -> (PEFT merge_and_unload state dict in fp32, unmerged logits, ids)."""
    cache: dict[tuple[str, str], tuple[dict, torch.Tensor, torch.Tensor]] = {}

    def ref(base: str, adapter: str):
        if (base, adapter) not in cache:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            peft_model = PeftModel.from_pretrained(model, adapter).eval()
            ids = token_ids(model.config.vocab_size)
            with torch.no_grad():
                logits = peft_model(ids).logits
            merged = peft_model.merge_and_unload()
            state = {k: v.detach().clone() for k, v in merged.state_dict().items()}
            cache[(base, adapter)] = (state, logits, ids)
        return cache[(base, adapter)]

    return ref


def pytest_sessionstart(session):
    """Where the run includes the slow tests (make test-all, CI), start building llama.cpp's references this
    machine lacks now, while the other tests run (tests/gguf_refs.py)."""
    markers = session.config.option.markexpr or ""
    if "PYTEST_XDIST_WORKER" not in os.environ and "not slow" not in markers:
        from tests.gguf_refs import build_in_background

        build_in_background()


def pytest_collection_modifyitems(config, items):
    """For the conformance matrix (tests/conformance): ``CONFORMANCE_SHARD=i/n`` keeps the checks of every n-th
    conformance case from the i-th (to spread the matrix over processes); other tests are kept by shard 0 only."""
    shard = os.environ.get("CONFORMANCE_SHARD")
    if not shard:
        return
    i, n = (int(x) for x in shard.split("/"))
    keep, drop, cases = [], [], {}
    for item in items:
        if "conformance" in item.nodeid and "[" in item.nodeid:
            case = item.nodeid.split("[", 1)[1].split("|", 1)[0]  # a case's paths stay together
            (keep if cases.setdefault(case, len(cases)) % n == i else drop).append(item)
        else:
            (keep if i == 0 else drop).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)


@pytest.fixture(scope="session")
def gguf_case(tmp_path_factory):
    """``(arch, **config) -> (base, adapter, tokenizer kind)``: a tiny base with a tokenizer and its adapter (built
    once per session)."""
    cache: dict = {}

    def make(arch: str, **config) -> tuple[str, str, str]:
        key = (arch, tuple(sorted(config.items())))
        if key not in cache:
            from tests.gguf_tokenizers import TOKENIZERS, write_tokenizer

            kind = TOKENIZERS[arch]
            model_arch = "llama" if arch == "llama3" else arch
            root = tmp_path_factory.mktemp(f"gguf-{arch}")
            os.makedirs(root / "tokenizer")
            n = write_tokenizer(str(root / "tokenizer"), kind)
            base = build_base(str(root / "base"), model_arch, vocab_size=n, **config)
            write_tokenizer(base, kind)
            adapter = build_adapter(base, str(root / "adapter"), arch=model_arch)
            cache[key] = (base, adapter, kind)
        return cache[key]

    return make
