"""Small helpers shared by the test modules: a checkpoint folder's tensors, comparing a merged checkpoint's logits
with a reference, a merge killed after some shards, and a command run on a terminal."""

from __future__ import annotations

import hashlib
import os
import time
from importlib.metadata import version

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

#: the repository's root folder
ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|."""
    return float((got - ref).abs().max() / ref.abs().max())


def logits_of(folder: str, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a merged checkpoint reloaded in fp32, which must load with no missing or unexpected keys."""
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def folder_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor the ``.safetensors`` files of a checkpoint folder hold, by name."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def no_cpu_repack(model) -> None:
    """Keep bitsandbytes from repacking 4-bit weights for its AVX512 CPU kernel on the first forward."""
    import bitsandbytes as bnb

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False


def load_quantized(base: str, quant: str, compute_dtype=torch.float32, double_quant=True, dtype=torch.float32):
    """A checkpoint loaded on the CPU unquantized (``"none"``), in 8-bit, or in 4-bit of type ``quant``."""
    from transformers import BitsAndBytesConfig

    if quant == "none":
        return AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    if quant == "8bit":
        qc = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qc = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant,
            bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    return AutoModelForCausalLM.from_pretrained(base, quantization_config=qc, device_map="cpu", dtype=dtype)


def add_adapter_refusal() -> str | None:
    """Why transformers' own ``add_adapter`` refuses the installed PEFT (its own version check), or None."""
    from transformers.integrations.peft import MIN_PEFT_VERSION
    from transformers.utils import check_peft_version

    try:
        check_peft_version(min_version=MIN_PEFT_VERSION)
    except ValueError as e:
        return (
            f"transformers {version('transformers')} refuses PEFT {version('peft')} in its own add_adapter "
            f"integration (it asks for PEFT >= {MIN_PEFT_VERSION}): {e}"
        )
    return None


def add_adapter_or_skip(model, *args, **kwargs) -> None:
    """``model.add_adapter(*args, **kwargs)``, transformers' own; the test skips where transformers refuses PEFT."""
    reason = add_adapter_refusal()
    if reason is not None:
        pytest.skip(reason)
    model.add_adapter(*args, **kwargs)


#: the NF4 code book of the QLoRA paper (Dettmers et al. 2023, appendix E)
NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]
BLOCK = 64  # values per absmax
NESTED_BLOCK = 256  # absmax codes per nested float32 scale (double quant)


def nf4_by_hand(packed: torch.Tensor, state) -> torch.Tensor:
    """The NF4 definition: the weight quantized flat; value i = NF4[nibble i] * absmax[i // 64] (nibble 2j: the high
    half of byte j); with double quant (``state.nested``) absmax[b] = map8[code b] * nested[b // 256] + offset;
    all in float32."""
    flat = packed.reshape(-1).to(torch.int64)
    nibbles = torch.stack([flat // 16, flat % 16], dim=1).reshape(-1)
    n = state.shape.numel()
    if state.nested:
        codes = state.absmax.reshape(-1).to(torch.int64)
        map8 = state.state2.code.to(torch.float32)
        nested = state.state2.absmax.to(torch.float32)
        absmax = torch.stack([map8[codes[b]] * nested[b // NESTED_BLOCK] for b in range(codes.numel())])
        absmax = absmax + state.offset.to(torch.float32)
    else:
        absmax = state.absmax.reshape(-1).to(torch.float32)
    values = torch.tensor(NF4)[nibbles[:n]] * absmax[torch.arange(n) // BLOCK]
    return values.to(state.dtype).to(torch.float32).reshape(state.shape)


def tree(folder) -> dict[str, str]:
    """Every entry under ``folder`` without following links: files by SHA-256, links by target, folders."""
    out = {}
    folder = str(folder)
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                out[rel] = "link -> " + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = "folder"
            elif not os.path.isfile(path):  # a fifo or socket: opening it would block
                out[rel] = f"special {os.lstat(path).st_mode:o}"
            else:
                out[rel] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def tensor_bytes(folder, names=None) -> int:
    """The data bytes of a folder's safetensors files as safetensors reads them (of the tensors in ``names`` only)."""
    total = 0
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as st:
                for k in st.keys():
                    if names is None or k in names:
                        t = st.get_tensor(k)
                        total += t.numel() * t.element_size()
    return total


def shard_keys(folder) -> dict[str, list[str]]:
    """The tensor names of each safetensors file of ``folder``, as safetensors lists them."""
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as st:
                out[f] = list(st.keys())
    return out


def seven_shard_merge(tmp_path) -> tuple[str, str]:
    """A base and adapter under ``tmp_path`` (4 Llama layers, float32) whose bfloat16 merge into 1 MB shards fills
    7 of them: the inputs of :data:`KILL_AFTER_SHARDS`."""
    from peft_shardmerge.testing import build_adapter, build_base

    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8)
    base = build_base(str(tmp_path / "base"), "llama", num_key_value_heads=4, vocab_size=1024, **shape)
    return base, build_adapter(base, str(tmp_path / "adapter"), arch="llama")


#: ``python -c KILL_AFTER_SHARDS BASE ADAPTER OUT``: a bfloat16 merge into 1 MB shards, killed outright (exit 9) once
#: three shards are finished, its staging folder left as after SIGKILL
KILL_AFTER_SHARDS = """
import os, sys
from peft_shardmerge import merge_checkpoint
from peft_shardmerge.output import staging

record, count = staging.Staging.record, []


def record_then_die(self, *a, **k):
    record(self, *a, **k)
    count.append(1)
    if len(count) == 3:
        os._exit(9)


staging.Staging.record = record_then_die
base, adapter, out = sys.argv[1:]
merge_checkpoint(base, adapter, out, dtype="bfloat16", max_shard_size="1MB", model_checks="first", progress=False)
"""


def run_on_a_terminal(args: list[str], timeout: float = 300, env: dict | None = None) -> tuple[int, str]:
    """Run a command with its stdout and stderr on a pseudo-terminal (as in an interactive shell): its exit status
    and everything it wrote there."""
    import fcntl
    import pty
    import select
    import struct
    import subprocess
    import termios

    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new one is 0 columns wide
    proc = subprocess.Popen(args, stdout=secondary, stderr=secondary, env=env, close_fds=True)
    os.close(secondary)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 0.1)
        if ready:
            try:
                data = os.read(main, 65536)
            except OSError:  # the other end closed: the command ended
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(main)
    return proc.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")
