"""The host buffers a loaded model's merge copies its row blocks into: reused, never handed out twice at once, and the
same bytes written as without them."""

from __future__ import annotations

import os

import pytest
import torch

from peft_shardmerge.model import host_slabs
from peft_shardmerge.model.host_slabs import HostSlabs


def test_a_buffer_given_back_is_reused_and_never_handed_out_twice():
    slabs = HostSlabs(64, pinned=False)
    a = slabs.take((4, 4), torch.float32)
    slabs.give(a)
    slabs.give(a)  # twice: still one free buffer
    b, c = slabs.take((16,), torch.float32), slabs.take((2, 2), torch.bfloat16)
    assert b.data_ptr() == a.data_ptr() and c.data_ptr() != b.data_ptr() and slabs.allocated == 2
    b.fill_(1.0)
    c.fill_(2.0)  # two buffers taken at once hold their own bytes
    assert torch.equal(b, torch.ones(16)) and torch.equal(c, torch.full((2, 2), 2.0, dtype=torch.bfloat16))


def test_a_block_larger_than_a_buffer_gets_its_own_and_strangers_are_not_kept():
    slabs = HostSlabs(64, pinned=False)
    big = slabs.take((17,), torch.float32)  # 68 bytes
    slabs.give(big)
    slabs.give(torch.empty(4))
    assert big.shape == (17,) and slabs.allocated == 0
    slabs.take((16,), torch.float32)
    assert slabs.allocated == 1


def test_a_loaded_models_blocks_go_through_reused_buffers_with_the_same_bytes(make_base, make_adapter, tmp_path):
    """merge_and_save with workers copies each merged module out block by block into the pool's buffers, which are
    reused across modules (far fewer made than blocks copied), and writes the same files as one thread."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import MergeOptions, merge_and_save

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(make_base("llama")), make_adapter("llama", "default")
    )
    taken, made = [], []
    real = HostSlabs.take

    def take(self, shape, dtype):
        out = real(self, shape, dtype)
        taken.append(out.numel() * out.element_size())
        made.append(self.allocated)
        return out

    outputs = {}
    for workers in (1, 3):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(host_slabs.HostSlabs, "take", take)
            out = tmp_path / f"w{workers}"
            merge_and_save(
                model,
                str(out),
                dtype="bfloat16",
                base_precision="dequantized",
                workers=workers,
                progress=False,
                options=MergeOptions(chunk_elems=4096),
            )
        outputs[workers] = {f: (out / f).read_bytes() for f in os.listdir(out) if f.endswith(".safetensors")}
    assert outputs[1] == outputs[3] and outputs[1]
    assert len(taken) > 50 and max(made) < len(taken) / 4, (len(taken), max(made))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blocks_from_a_gpu_go_into_page_locked_buffers():
    slabs = HostSlabs(1 << 20, pinned=True)
    rows = torch.randn(64, 256, device="cuda")
    part = slabs.take((64, 256), torch.bfloat16)
    part.copy_(rows)
    assert part.is_pinned() and torch.equal(part, rows.to(torch.bfloat16).cpu())
    slabs.give(part)
    slabs.release()
    assert slabs.allocated == 0


@pytest.mark.parametrize("workers", [1, 3])
def test_a_scalar_parameter_is_written_as_held(workers, make_base, make_adapter, tmp_path):
    """A 0-dim parameter (a learned temperature, say) is one row of one element: written with its value and its
    empty shape, by the calling thread or through the workers' buffers."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import merge_and_save

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(make_base("llama")), make_adapter("llama", "default")
    )
    model.base_model.model.model.register_parameter("logit_scale", torch.nn.Parameter(torch.tensor(2.5)))
    out = tmp_path / "out"
    merge_and_save(model, str(out), dtype="bfloat16", base_precision="dequantized", workers=workers, progress=False)
    written = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    scale = written["model.logit_scale"]
    assert scale.shape == () and scale.dtype == torch.bfloat16 and float(scale) == 2.5
