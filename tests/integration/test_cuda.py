"""On a CUDA GPU: the memory budget against the caching allocator, real out-of-memory fallbacks, both engines."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
from typing import Callable

import pytest
import torch

from peft_shardmerge.testing import build_adapter, build_base, default_targets, token_ids
from tests.helpers import folder_tensors

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HIDDEN, INTER, LAYERS = 1024, 4096, 2
#: the budget's working set of one projection (fp32 weight and one copy), as LiveMerger reckons it
ATTN_NEED, MLP_NEED = HIDDEN * HIDDEN * 8, HIDDEN * INTER * 8
DEV = torch.device("cuda:0")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A bf16 Llama whose projections are large next to the allocator's 2 MiB blocks (MLP weights 16 MiB in fp32)."""
    folder = str(tmp_path_factory.mktemp("cuda") / "base")
    return build_base(
        folder,
        "llama",
        dtype=torch.bfloat16,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
    )


def qlora_on_cuda(base: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=qc, device_map="cuda:0", dtype=torch.bfloat16
    )
    torch.manual_seed(0)
    return get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=default_targets("llama"), init_lora_weights=False)
    ).eval()


def assert_same(a: str, b: str, exact: bool) -> None:
    ga, gb = folder_tensors(a), folder_tensors(b)
    assert ga.keys() == gb.keys() and len(gb) > 0
    for k in gb:
        if exact:
            assert torch.equal(ga[k], gb[k]), k
        else:
            torch.testing.assert_close(ga[k], gb[k], rtol=1e-5, atol=1e-6, msg=k)


def sent_to_cpu(caplog) -> list[str]:
    """Modules the budget merged on the CPU, from the merge's log."""
    return [r.getMessage().split(":")[0] for r in caplog.records if "over the memory budget" in r.getMessage()]


def used_now() -> int:
    gc.collect()  # models of earlier tests (reference cycles) must not be freed in the middle of a measured merge
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(DEV)
    return total - free


def free_blocks(at_least: int = 1 << 20) -> list[int]:
    """Sizes of the free blocks inside the segments torch's allocator holds (what a capped allocation may still
    use), each as the request that takes it: the small pool serves requests of at most 1 MiB, so a free block of a
    small segment is taken 1 MiB at a time."""
    return [
        min(b["size"], 1 << 20) if seg.get("segment_type") == "small" else b["size"]
        for seg in torch.cuda.memory_snapshot()
        if seg.get("device", DEV.index) == DEV.index
        for b in seg["blocks"]
        if b["state"] == "inactive" and b["size"] >= at_least
    ]


@contextlib.contextmanager
def capped(extra: int | Callable[[], int]):
    """Cap this process's CUDA allocator at what it holds now plus ``extra`` bytes (mem_get_info does not see it).

    Whatever this GPU's allocator kept from earlier work (free blocks inside held segments, whose sizes differ from
    card to card) is taken first, so that every allocation past ``extra`` needs a new segment and fails. ``extra``
    may be a function, called once those blocks are taken, that measures it."""
    total = torch.cuda.mem_get_info(DEV)[1]
    gc.collect()  # a model of an earlier test freed under the cap would leave room the cap did not mean to give
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    plugs = []
    for _ in range(1000):
        sizes = free_blocks()
        if not sizes:
            break
        plugs.append(torch.empty(max(sizes), dtype=torch.uint8, device=DEV))
    assert not free_blocks(), "the allocator's free blocks could not be taken"
    try:
        if callable(extra):
            extra = extra()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            for _ in range(1000):  # what the measuring left in segments it still holds is taken too
                sizes = free_blocks()
                if not sizes:
                    break
                plugs.append(torch.empty(max(sizes), dtype=torch.uint8, device=DEV))
            assert not free_blocks(), "the allocator's free blocks could not be taken"
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(DEV) + extra) / total, DEV)
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, DEV)
        del plugs
        torch.cuda.empty_cache()


def module_needs(model, out: str) -> dict[str, int]:
    """The device memory each module's merge (dequantize, merge, self-check) reserves afresh from an empty cache, by
    weight name: its working set as torch's allocator rounds it into segments (whose sizes depend on the allocator
    and the request, not on the budget's arithmetic)."""
    from peft_shardmerge import merge_and_save
    from peft_shardmerge.model.reader import LiveMerger

    needs, real = {}, LiveMerger.produce

    def produce(self, entry):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(DEV)
        before = torch.cuda.memory_reserved(DEV)
        data = real(self, entry)
        torch.cuda.synchronize()
        needs[entry.name] = torch.cuda.max_memory_reserved(DEV) - before
        return data

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LiveMerger, "produce", produce)
        merge_and_save(model, out, dtype="float32", base_precision="dequantized", progress=False, workers=2)
    return needs


def test_budget_hands_back_cached_blocks_before_refusing():
    from peft_shardmerge.engine.budget import MemoryBudget

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    x = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    del x  # 256 MiB now sits in torch's cache, counted as used by mem_get_info
    free, total = torch.cuda.mem_get_info(DEV)
    assert torch.cuda.memory_reserved(DEV) - torch.cuda.memory_allocated(DEV) >= 256 << 20
    budget = MemoryBudget(((total - free) - (256 << 20) + (200 << 20)) / total)
    assert budget.fits(128 << 20, DEV)
    assert torch.cuda.memory_reserved(DEV) - torch.cuda.memory_allocated(DEV) < 256 << 20
    assert not budget.fits(512 << 20, DEV)


def test_tight_budget_keeps_same_sized_modules_on_the_gpu(base, tmp_path, caplog):
    """A budget with room for one MLP projection's working set merges every MLP projection on the GPU (the
    blocks the previous one left in torch's cache are reused), and one with room only for attention
    projections sends exactly the MLP projections to the CPU; all results equal the unconstrained merge."""
    from peft_shardmerge import merge_and_save

    model = qlora_on_cuda(base)
    ref = str(tmp_path / "ref")
    merge_and_save(model, ref, dtype="float32", base_precision="dequantized", progress=False)  # warms cuBLAS too
    total = torch.cuda.mem_get_info(DEV)[1]
    caplog.set_level(logging.INFO, logger="peft_shardmerge")

    roomy = str(tmp_path / "roomy")
    merge_and_save(
        model,
        roomy,
        dtype="float32",
        base_precision="dequantized",
        progress=False,
        maximum_memory_usage=(used_now() + 1.5 * MLP_NEED) / total,
    )
    assert sent_to_cpu(caplog) == []
    assert_same(roomy, ref, exact=True)

    caplog.clear()
    tight = str(tmp_path / "tight")
    report = merge_and_save(
        model,
        tight,
        dtype="float32",
        base_precision="dequantized",
        progress=False,
        maximum_memory_usage=(used_now() + 1.5 * ATTN_NEED) / total,
    )
    cpu = sent_to_cpu(caplog)
    assert sorted(cpu) == sorted(
        f"model.layers.{i}.mlp.{p}.weight" for i in range(LAYERS) for p in ("gate_proj", "up_proj", "down_proj")
    )
    assert report.cpu_fallbacks == 0 and report.lora_modules_merged == report.lora_modules_total == 7 * LAYERS
    assert_same(tight, ref, exact=False)


def test_real_out_of_memory_is_retried_on_the_cpu(base, tmp_path, caplog):
    """With the allocator capped between what merging an attention projection and an MLP projection reserves (each
    measured under the same cap's conditions), torch raises real OutOfMemoryErrors on the MLP projections; each is
    merged on the CPU instead, the attention projections stay on the GPU, and the output equals the unconstrained
    merge."""
    from peft_shardmerge import merge_and_save

    model = qlora_on_cuda(base)
    ref = str(tmp_path / "ref")
    merge_and_save(model, ref, dtype="float32", base_precision="dequantized", progress=False)
    needs: dict[str, int] = {}

    def between() -> int:
        needs.update(module_needs(model, str(tmp_path / "measured")))
        attention = max(v for k, v in needs.items() if ".self_attn." in k)
        mlp = min(v for k, v in needs.items() if ".mlp." in k)
        assert 0 < attention < mlp, needs
        return (attention + mlp) // 2

    caplog.set_level(logging.INFO, logger="peft_shardmerge")
    out = str(tmp_path / "capped")
    with capped(between):
        report = merge_and_save(
            model,
            out,
            dtype="float32",
            base_precision="dequantized",
            progress=False,
            maximum_memory_usage=0.95,
            workers=2,
        )
    # one warning per tensor (or row block) redone on the CPU: "out of memory on cuda:0 for <weight>[ rows a-b];
    # redoing it on the CPU"
    oom = [r.getMessage() for r in caplog.records if r.getMessage().startswith("out of memory on ")]
    modules = {m.split(" for ")[1].split(";")[0].split(" rows ")[0] for m in oom}
    assert report.cpu_fallbacks == len(oom) and modules == {
        f"model.layers.{i}.mlp.{p}.weight" for i in range(LAYERS) for p in ("gate_proj", "up_proj", "down_proj")
    }, (oom, needs)
    assert sent_to_cpu(caplog) == []
    assert_same(out, ref, exact=False)


def test_disk_engine_on_cuda_redoes_out_of_memory_blocks_on_the_cpu(base, tmp_path):
    from peft_shardmerge import merge_checkpoint

    adapter = build_adapter(base, str(tmp_path / "adapter"), arch="llama")
    cpu, gpu, oom = (str(tmp_path / n) for n in ("cpu", "gpu", "oom"))
    merge_checkpoint(base, adapter, cpu, dtype="float32", device="cpu", progress=False)
    report = merge_checkpoint(base, adapter, gpu, dtype="float32", device="cuda", progress=False)
    assert report.device.startswith("cuda") and report.cpu_fallbacks == 0
    assert_same(gpu, cpu, exact=False)

    with capped(1 << 20):
        report = merge_checkpoint(base, adapter, oom, dtype="float32", device="cuda", progress=False)
    assert report.cpu_fallbacks > 0
    assert_same(oom, cpu, exact=True)  # every block that ran out of memory was computed on the CPU


def test_disk_engine_on_cuda_checks_and_casts_on_the_gpu(base, tmp_path):
    """With ``device="cuda"`` only the output's bytes leave the GPU: the rows reach the shard writer cast to bf16 on
    the GPU, with the same bytes as the float32 merge's rows cast on the host; DoRA's norms, taken on the GPU too,
    agree with the CPU's merge."""
    from peft_shardmerge import merge_checkpoint
    from peft_shardmerge.output.writer import ShardWriter, TensorAt

    for dora in (False, True):
        adapter = build_adapter(base, str(tmp_path / f"adapter{dora}"), arch="llama", use_dora=dora)
        wide, narrow, cpu = (str(tmp_path / f"{n}{dora}") for n in ("fp32", "bf16", "cpu"))
        seen = []

        def spy(self, real, tensor):
            seen.append((tensor.device.type, tensor.dtype))
            return real(self, tensor)

        with pytest.MonkeyPatch.context() as mp:
            for sink in (ShardWriter, TensorAt):  # one writer thread, or a tensor written where it goes by several
                mp.setattr(sink, "write", functools.partialmethod(spy, getattr(sink, "write")))
            merge_checkpoint(base, adapter, wide, dtype="float32", device="cuda", progress=False)
            seen.clear()
            report = merge_checkpoint(base, adapter, narrow, dtype="bfloat16", device="cuda", progress=False)
        assert report.cpu_fallbacks == 0 and ("cuda", torch.bfloat16) in seen, seen
        assert all(dtype == torch.bfloat16 for _, dtype in seen)
        a, b = folder_tensors(wide), folder_tensors(narrow)
        assert a.keys() == b.keys() and len(a) > 0
        for k in a:
            assert torch.equal(a[k].bfloat16().view(torch.int16), b[k].view(torch.int16)), k
        merge_checkpoint(base, adapter, cpu, dtype="float32", device="cpu", progress=False)
        assert_same(wide, cpu, exact=False)


def test_dora_on_cuda_does_not_follow_the_row_block(base, tmp_path):
    """DoRA's row norms taken on the GPU: the same bytes whatever the row block, blocks of a few rows included (whose
    plain norms the GPU lays out otherwise: the premise is checked first), since each norm is taken in a padded tile
    of a grid fixed by the tensor's shape."""
    from peft_shardmerge import MergeOptions, merge_checkpoint

    x = torch.randn(HIDDEN, HIDDEN, device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    whole = torch.linalg.norm(x, dim=1)
    few = [n for n in (1, 2, 4, 8) if not torch.equal(torch.linalg.norm(x[:n], dim=1), whole[:n])]
    assert few, "on this GPU the norms of a few rows are those of the whole: the test would prove nothing"
    adapter = build_adapter(base, str(tmp_path / "adapter"), arch="llama", use_dora=True)
    outs = []
    for chunk in (1 << 22, 8 * HIDDEN):  # whole tensors; blocks of 8 rows of 1024 and 2 rows of 4096
        out = str(tmp_path / f"out-{chunk}")
        options = MergeOptions(dtype="float32", device="cuda", chunk_elems=chunk, progress=False)
        merge_checkpoint(base, adapter, out, options=options)
        outs.append(folder_tensors(out))
    assert [k for k in outs[0] if not torch.equal(outs[0][k], outs[1][k])] == []


def test_blocks_of_one_tensor_on_the_gpu_and_the_cpu_meet(tmp_path, monkeypatch):
    """Blocks of one tensor merged some on the GPU, some on the CPU after a (forced) out-of-memory in the LoRA step
    or in the steps after it: DoRA on Conv1D (column norms summed block by block, across devices), the precision
    report's counts and the cast meet across devices, and the output is the CPU's merge to bf16's rounding."""
    import threading

    from peft_shardmerge import MergeOptions, merge_checkpoint
    from peft_shardmerge.engine import row_merge
    from peft_shardmerge.engine.row_merge import RowMerger

    # 1024 rows of 3072 and 4096 columns: several blocks of 64 rows per tensor in each pass
    gpt2 = build_base(str(tmp_path / "gpt2"), "gpt2", dtype=torch.bfloat16, n_embd=1024)
    adapter = build_adapter(gpt2, str(tmp_path / "adapter"), use_dora=True, fan_in_fan_out=True)
    monkeypatch.setattr(row_merge, "WHOLE_NORM_ELEMS", 0)  # every DoRA tensor takes the norms summed by block
    calls, lock = {"lora": 0, "finish": 0}, threading.Lock()
    lora_rows, finish = RowMerger._lora_rows, RowMerger._finish

    def flaky(kind, real, on_gpu, *args):
        if on_gpu(args):  # every third try on the GPU runs out of memory; the CPU's retry never does
            with lock:
                calls[kind] += 1
                fail = calls[kind] % 3 == 0
            if fail:
                raise torch.OutOfMemoryError("CUDA out of memory (forced for this test)")
        return real(*args)

    lora = functools.partial(flaky, "lora", lora_rows, lambda args: args[4].type == "cuda")  # device
    after = functools.partial(flaky, "finish", finish, lambda args: args[1].is_cuda)  # the merged rows
    monkeypatch.setattr(RowMerger, "_lora_rows", staticmethod(lora))
    monkeypatch.setattr(RowMerger, "_finish", staticmethod(after))
    options = dict(dtype="bfloat16", chunk_elems=1 << 14, progress=False)
    report = merge_checkpoint(gpt2, adapter, str(tmp_path / "mixed"), options=MergeOptions(device="cuda", **options))
    assert report.cpu_fallbacks > 0 and calls["lora"] > 3 and calls["finish"] > 3
    monkeypatch.undo()
    monkeypatch.setattr(row_merge, "WHOLE_NORM_ELEMS", 0)
    cpu = merge_checkpoint(gpt2, adapter, str(tmp_path / "cpu"), options=MergeOptions(device="cpu", **options))
    assert report.swallowed.keys() == cpu.swallowed.keys()
    a, b = folder_tensors(str(tmp_path / "mixed")), folder_tensors(str(tmp_path / "cpu"))
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k)


def test_auto_from_a_cuda_model_merges_the_original_on_the_gpu(base, tmp_path):
    from peft_shardmerge import merge_and_save, merge_checkpoint

    model = qlora_on_cuda(base)
    adapter = str(tmp_path / "adapter")
    model.save_pretrained(adapter)
    out, cpu = str(tmp_path / "auto"), str(tmp_path / "cpu")
    report = merge_and_save(model, out, dtype="float32", base_precision="original", progress=False)
    assert report.base_precision == "original" and report.device.startswith("cuda")
    merge_checkpoint(base, adapter, cpu, dtype="float32", device="cpu", progress=False)
    assert_same(out, cpu, exact=False)


def test_merge_and_unload_on_cuda_returns_a_16bit_model_that_generates(base, tmp_path):
    import bitsandbytes as bnb

    from peft_shardmerge import merge_and_save, merge_and_unload

    model = qlora_on_cuda(base)
    saved = str(tmp_path / "saved")
    merge_and_save(model, saved, dtype="bfloat16", base_precision="dequantized", progress=False)
    ids = token_ids(model.config.vocab_size).to(DEV)
    with torch.no_grad():
        before = model(input_ids=ids).logits.float()
    plain = merge_and_unload(model)
    assert not any(isinstance(m, (bnb.nn.Linear4bit,)) or "lora" in type(m).__name__.lower() for m in plain.modules())
    params = dict(plain.named_parameters())
    assert all(p.device == DEV and p.dtype == torch.bfloat16 for p in params.values())
    state = plain.state_dict()
    for k, v in folder_tensors(saved).items():  # the same merged weights as merge_and_save wrote
        assert torch.equal(state[k].cpu(), v), k
    with torch.no_grad():
        after = plain(input_ids=ids).logits.float()
        gen = plain.generate(input_ids=ids[:1, :4], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.isfinite(after).all() and gen.shape == (1, 12)
    assert float((after - before).abs().max() / before.abs().max()) < 0.05


def test_merged_rows_are_narrowed_on_the_gpu_with_the_hosts_rounding(base, tmp_path):
    """A bf16 output of a merge on the GPU is cast there before it crosses to the host: the same bytes as the float32
    output of the same merge cast on the host, every tensor (round to nearest even on both)."""
    from peft_shardmerge import merge_and_save
    from peft_shardmerge.model.reader import ModelReader

    x = torch.randn(4096, 1024, device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    x[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130], device=DEV)  # ties, a subnormal
    on_gpu = x.to(torch.bfloat16)  # what ModelReader._narrowed does with a float32 block on the GPU
    assert torch.equal(on_gpu.cpu().view(torch.int16), x.cpu().bfloat16().view(torch.int16))

    model = qlora_on_cuda(base)
    wide, narrow = str(tmp_path / "fp32"), str(tmp_path / "bf16")
    narrowed, real = [], ModelReader._narrowed

    def spy(self, rows, target):
        out = real(self, rows, target)
        narrowed.append(out.device.type == "cuda" and out.dtype == target != rows.dtype)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelReader, "_narrowed", spy)
        for out, dtype in ((wide, "float32"), (narrow, "bfloat16")):
            merge_and_save(model, out, dtype=dtype, base_precision="dequantized", progress=False, workers=2)
    assert any(narrowed)  # the bf16 merge's float32 blocks were narrowed on the GPU
    a, b = folder_tensors(wide), folder_tensors(narrow)
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k].bfloat16().view(torch.int16), b[k].view(torch.int16)), k
