"""One rank of a distributed test job, started by torchrun: ``dist_worker.py SCENARIO ARGS...``.

Scenarios:
    cli ARGS                      the command line, as ``-m peft_shardmerge`` runs it
    kill-after-shard R ARGS       the command line; rank R kills itself (SIGKILL) once it finished its first shard
    killall-after-record R ARGS   the command line; once rank R recorded its first finished shard, the whole job
                                  (torchrun and every rank, pids in $DIST_TEST_PIDS) is killed at once (SIGKILL)
    interrupt-after-shard R ARGS  the command line; rank R presses Ctrl-C (SIGINT to torchrun) once it finished its
                                  first shard
    fail-finish R ARGS            the command line; rank R's disk fills up while it writes the config, after the shards
    fail R ARGS                   the command line; rank R's disk is full (ENOSPC) on its first tensor
    api-differ dtype|out OUT BASE AD  merge_checkpoint(distributed=True) with a dtype or an OUT that differs by rank
    fsdp2 OUT RESULT [dora] [bf16] [mp] [qlora=BASE [eval]] [twice] [big=N rss] [fail]  merge_and_save of a tiny
                                  Llama + LoRA sharded by fully_shard (mp: a MixedPrecisionPolicy; qlora: BASE
                                  loaded in 4-bit; eval: its forwards in eval mode; twice: merged once before; big:
                                  N bigger layers, rss: the peak memory measured); rank 0 writes RESULT, rank N
                                  RESULT.N (fail: rank 0's disk fills up mid-merge)
    fsdp1 OUT RESULT [dora] [flat] [rootonly] [fail|gatherfail]  the same under FullyShardedDataParallel (flat:
                                  use_orig_params=False; rootonly: no auto-wrap; gatherfail: rank 0 fails before
                                  its third gather)
    zero3 OUT RESULT [dora] [engine] [bert] [train] [fail|gatherfail]  the same under DeepSpeed ZeRO-3
                                  (deepspeed.initialize; engine: merge_and_save given the engine rather than the
                                  PeftModel; bert: a BERT masked LM whose tied head has LoRA; train: bf16 mode and
                                  three SGD steps, rank 0 merging the trained weights unsharded into OUT.ref)
    ddp RESULT                    merge_and_save given the DDP wrapper on every rank (refused: merge its .module)
    tp RESULT [fsdp]              merge_and_save of a model whose MLPs are tensor-parallel (fsdp: and sharded by
                                  fully_shard too); refused on every rank
    unload-fsdp2 RESULT           merge_and_unload of the FSDP2 model (refused, model untouched)
    refused-8bit BASE OUT RESULT  merge_and_save of an 8-bit base sharded by fully_shard (refused on every rank)
    rank0-only OUT                an unsharded model in a distributed job, merged by rank 0 alone
    rank0-only-disk OUT BASE AD   merge_checkpoint called by rank 0 alone in a distributed job
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys

import torch

torch.set_num_threads(1)
RANK = int(os.environ.get("RANK", 0))


def tiny_peft(dora: bool = False, dtype: torch.dtype = torch.float32, bert: bool = False, **overrides):
    """The same tiny Llama + LoRA (adapter factors moved off their initial values) on every rank (``overrides``:
    config fields, for a bigger one). bert: a BERT masked LM instead, with LoRA on its head's decoder too, whose
    weight is tied to the word embeddings and whose bias to the head's own (in eval mode: no dropout)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    from peft_shardmerge.testing import perturb_trainable, tiny_config

    torch.manual_seed(0)
    auto = AutoModelForMaskedLM if bert else AutoModelForCausalLM
    model = auto.from_config(tiny_config("bert" if bert else "llama", **overrides), dtype=dtype)
    targets = ["query", "value", "decoder"] if bert else ["q_proj", "v_proj", "gate_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_dora=dora))
    torch.manual_seed(1)
    perturb_trainable(model)
    return model.eval() if bert else model


def tiny_qlora(base: str, dora: bool = False):
    """The QLoRA recipe for FSDP (as accelerate and TRL document it): the base loaded in 4-bit with its packed bytes
    stored as bf16 and every other tensor bf16, so FSDP can flatten a unit; the same adapter on every rank."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from peft_shardmerge.testing import perturb_trainable

    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=qc, dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], use_dora=dora),
        autocast_adapter_dtype=False,
    )
    torch.manual_seed(1)
    perturb_trainable(model)
    return model


#: a model big enough for its memory to show (each decoder layer 26 MB in fp32), still quick to build; big=N: N layers
BIG = {"hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 4, "vocab_size": 2048}


def big(args: list[str]) -> dict:
    """The config overrides of ``big=N`` among the arguments (N decoder layers), or none."""
    n = next((int(a.split("=", 1)[1]) for a in args if a.startswith("big=")), None)
    return {**BIG, "num_hidden_layers": n} if n else {}


def reset_peak_rss() -> int:
    """Give freed memory back to the system and restart the kernel's count of this process's peak resident memory
    (``/proc/self/clear_refs``); returns the resident bytes now."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """The peak resident bytes since :func:`reset_peak_rss`."""
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def qlora_base(args: list[str]) -> str | None:
    """The base of a QLoRA scenario (``qlora=PATH`` among the arguments), or None."""
    return next((a.split("=", 1)[1] for a in args if a.startswith("qlora=")), None)


def fully_shard_model(model, param_dtype: torch.dtype | None = None):
    """Each decoder layer and the root sharded by ``fully_shard`` (param_dtype: a ``MixedPrecisionPolicy`` that
    gathers the weights in that dtype, as accelerate's mixed precision sets it up)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def zero3_engine(model, train_in_bf16: bool = False):
    """``deepspeed.initialize`` with ZeRO-3 over the process group already set up: every parameter partitioned
    (persistence threshold 0, so that even a tiny model's are), no optimizer (none is needed to merge).
    train_in_bf16: DeepSpeed's bf16 mode (the module holds bf16 copies, the optimizer fp32 masters) and three SGD
    steps, so that the masters and their copies differ."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if not train_in_bf16:
        return deepspeed.initialize(model=model, config=config)[0]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    engine = deepspeed.initialize(model=model, optimizer=optimizer, config={**config, "bf16": {"enabled": True}})[0]
    ids = torch.arange(12).reshape(2, 6)
    for _ in range(3):
        engine.backward(engine(input_ids=ids).logits.float().pow(2).mean())
        engine.step()
    return engine


def zero3_reference(engine, out: str) -> None:
    """The trained weights as DeepSpeed gives them (each frozen one gathered, each trainable one its fp32 master:
    collectives, on every rank) loaded into an unsharded copy of the model, which rank 0 merges into ``out``."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from peft_shardmerge import merge_and_save

    weights = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            weights[name] = p.detach().float().clone()
        if p.requires_grad:
            weights[name] = safe_get_full_fp32_param(p).float().view(weights[name].shape)
    if RANK == 0:
        model = tiny_peft()
        model.load_state_dict(weights, strict=True)
        merge_and_save(model, out, dtype="float32", progress=False)


def cli(argv: list[str]) -> int:
    from peft_shardmerge.api.cli import main

    return main(argv)


def signal_after_shard(rank: int, argv: list[str], pid: int, sig: int) -> int:
    """The command line; once rank ``rank`` finished its first shard, it sends ``sig`` to ``pid``."""
    from peft_shardmerge.output import writer

    close = writer.ShardWriter.close
    sent = []

    def close_then_signal(self):
        close(self)
        if RANK == rank and not sent:  # once: a second Ctrl-C makes torchrun terminate the ranks instead
            sent.append(sig)
            os.kill(pid, sig)

    writer.ShardWriter.close = close_then_signal
    return cli(argv)


def killall_after_record(rank: int, argv: list[str]) -> int:
    from peft_shardmerge.output import staging

    record = staging.write_manifest

    pids = os.environ["DIST_TEST_PIDS"]  # each rank writes its pid there first
    with open(os.path.join(pids, str(RANK)), "w") as f:
        f.write(str(os.getpid()))

    def record_then_die(path, data):
        record(path, data)
        if RANK == rank:
            os.kill(os.getppid(), signal.SIGKILL)  # torchrun, then every rank, this one last
            for name in sorted(os.listdir(pids), key=lambda n: n == str(RANK)):
                os.kill(int(open(os.path.join(pids, name)).read()), signal.SIGKILL)

    staging.write_manifest = record_then_die
    return cli(argv)


def fail_finish(rank: int, argv: list[str]) -> int:
    from peft_shardmerge.output import shard_sink as sinks

    def full_disk(self, finish):
        if RANK == rank:
            raise OSError(errno.ENOSPC, "No space left on device", "config.json")

    sinks.FolderOutput.finish = full_disk  # every rank patches it; only rank 0 calls it
    return cli(argv)


def fail(rank: int, argv: list[str]) -> int:
    from peft_shardmerge.checkpoint import reader as merger

    write = merger.CheckpointReader.write_tensor

    def full_disk(self, t, w):
        if RANK == rank:
            raise OSError(errno.ENOSPC, "No space left on device", "shard")
        return write(self, t, w)

    merger.CheckpointReader.write_tensor = full_disk
    return cli(argv)


def kept(named) -> list[tuple[str, int]]:
    """Each parameter's name and identity, but for the 4-bit weights bitsandbytes registers anew at each forward
    and FSDP1 (use_orig_params=False) removes again whenever it gathers (both libraries' own doing)."""
    return [(n, id(p)) for n, p in named if type(p).__name__ != "Params4bit"]


def fsdp(out: str, result: str, version: int, dora: bool) -> int:
    import torch.distributed as dist

    from peft_shardmerge import merge_and_save
    from peft_shardmerge.errors import ShardMergeError

    dist.init_process_group("gloo")
    qbase = qlora_base(sys.argv)
    model = (
        tiny_qlora(qbase, dora)
        if qbase
        else tiny_peft(
            dora, torch.bfloat16 if "bf16" in sys.argv else torch.float32, "bert" in sys.argv, **big(sys.argv)
        )
    )
    if qbase and "eval" not in sys.argv:  # an eval-mode forward on a CPU with AVX512-BF16 repacks a 4-bit weight
        model.train()
    elif qbase:  # eval: let bitsandbytes repack (its CPU kernel), as it does on such a CPU
        for m in model.modules():
            if hasattr(m, "support_avx512bf16_for_cpu"):
                m.support_avx512bf16_for_cpu = True
    if version == 2:  # mp: gathered in bf16 (a QLoRA base's bf16-stored bytes in fp16), stored as they are
        fully_shard_model(model, (torch.float16 if qbase else torch.bfloat16) if "mp" in sys.argv else None)
    elif version == 3:
        engine = zero3_engine(model, "train" in sys.argv)
        model = engine if "engine" in sys.argv else model
        if "train" in sys.argv:  # what an unsharded copy holding DeepSpeed's trained weights merges into
            zero3_reference(engine, out + ".ref")
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        flat = "flat" in sys.argv
        if flat:  # FSDP1 flattens a unit's parameters together: trainable and frozen may not mix
            model.requires_grad_(False)
        policy = None if "rootonly" in sys.argv else ModuleWrapPolicy({LlamaDecoderLayer})
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=not flat
        )
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    if version == 2:  # as a training step ends (after backward): the root too back to its shards
        model.reshard()
    if "fail" in sys.argv and RANK == 0:  # rank 0's disk fills up at its fifth tensor, units half gathered
        from peft_shardmerge.model import reader as live_merger

        produce, calls = live_merger.LiveMerger.produce, []

        def full_disk(self, entry):
            calls.append(entry)
            if len(calls) == 5:
                raise OSError(errno.ENOSPC, "No space left on device", "shard")
            return produce(self, entry)

        live_merger.LiveMerger.produce = full_disk
    if "gatherfail" in sys.argv and RANK == 0:  # rank 0 fails just before its third gather (the others wait in it)
        from peft_shardmerge.distributed import fsdp1 as fsdp1_view
        from peft_shardmerge.distributed import sharding as fsdp_gather
        from peft_shardmerge.distributed import zero3 as zero3_view

        units = {1: fsdp1_view.Fsdp1Units, 2: fsdp_gather.Fsdp2Units, 3: zero3_view.Zero3Units}[version]
        gather, gathers = units.gather, []

        def failing_gather(self, i):
            gathers.append(i)
            if len(gathers) == 3:
                raise OSError(errno.EIO, "Input/output error", "unit")
            return gather(self, i)

        units.gather = failing_gather
    params = list(model.named_parameters())
    try:
        if "twice" in sys.argv or "rss" in sys.argv:  # a first merge (rss: what it imports and caches is not counted)
            merge_and_save(model, out + ".first", progress=False)
        start = reset_peak_rss()
        report = merge_and_save(model, out, progress=False, dtype="float32" if "train" in sys.argv else None)
        outcome = {
            "ok": True,
            "notes": report.notes,
            "merged": report.lora_modules_merged,
            "rss_growth": peak_rss() - start,
        }
    except ShardMergeError as e:
        outcome = {"ok": False, "error": type(e).__name__, "message": str(e)}
    outcome["parameters_unchanged"] = kept(params) == kept(model.named_parameters())  # and in their order
    with torch.no_grad():  # the sharded model still works, and computes exactly what it did
        outcome["forward_unchanged"] = torch.equal(model(input_ids=ids).logits, before)
    with open(result if RANK == 0 else f"{result}.{RANK}", "w") as f:
        json.dump(outcome, f)
    dist.destroy_process_group()
    return 0


def unload_fsdp2(result: str) -> int:
    import torch.distributed as dist

    from peft_shardmerge import merge_and_unload
    from peft_shardmerge.errors import InputError

    dist.init_process_group("gloo")
    model = fully_shard_model(tiny_peft())
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    try:
        merge_and_unload(model)
        outcome = {"refused": False}
    except InputError as e:
        after = dict(model.named_parameters())
        outcome = {
            "refused": True,
            "message": str(e),
            "untouched": set(after) == set(before)
            and all(torch.equal(after[n].to_local(), v) for n, v in before.items()),
        }
    if RANK == 0:
        with open(result, "w") as f:
            json.dump(outcome, f)
    dist.destroy_process_group()
    return 0


def try_merge(model, out: str, result: str) -> int:
    """merge_and_save of ``model`` on this rank; its outcome (ok, or the error's class and message) into RESULT
    (rank 0) or RESULT.N; the process group left."""
    import torch.distributed as dist

    from peft_shardmerge import merge_and_save
    from peft_shardmerge.errors import ShardMergeError

    try:
        merge_and_save(model, out, progress=False)
        outcome = {"ok": True}
    except ShardMergeError as e:
        outcome = {"ok": False, "error": type(e).__name__, "message": str(e)}
    with open(result if RANK == 0 else f"{result}.{RANK}", "w") as f:
        json.dump(outcome, f)
    dist.destroy_process_group()
    return 0


def refused_8bit(base: str, out: str, result: str) -> int:
    """merge_and_save of an 8-bit base sharded by fully_shard: refused on every rank, before writing."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=BitsAndBytesConfig(load_in_8bit=True), dtype=torch.bfloat16
    )
    model = fully_shard_model(
        get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]), autocast_adapter_dtype=False)
    )
    return try_merge(model, out, result)


def tensor_parallel(result: str, with_fsdp: bool) -> int:
    """merge_and_save of a tiny Llama whose MLPs ``parallelize_module`` split over the ranks (with_fsdp: and every
    layer sharded by fully_shard over the other mesh dim, 2-D parallelism): refused by name."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    model = tiny_peft()
    mesh = init_device_mesh("cpu", (1, int(os.environ["WORLD_SIZE"])), mesh_dim_names=("dp", "tp"))
    for layer in model.base_model.model.model.layers:
        parallelize_module(layer.mlp, mesh["tp"], {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
        if with_fsdp:
            fully_shard(layer, mesh=mesh["dp"])
    if with_fsdp:
        fully_shard(model, mesh=mesh["dp"])
    return try_merge(model, os.path.join(os.path.dirname(result), "out"), result)


def ddp_wrapped(result: str) -> int:
    """merge_and_save given the DistributedDataParallel wrapper on every rank: refused, pointing to its .module."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(tiny_peft())
    return try_merge(model, os.path.join(os.path.dirname(result), "out"), result)


def rank0_only(out: str) -> int:
    import torch.distributed as dist

    from peft_shardmerge import merge_and_save

    dist.init_process_group("gloo")
    model = tiny_peft()
    if RANK == 0:
        merge_and_save(model, out, progress=False)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def rank0_only_disk(out: str, base: str, adapter: str) -> int:
    import torch.distributed as dist

    from peft_shardmerge import merge_checkpoint

    dist.init_process_group("gloo")
    if RANK == 0:
        merge_checkpoint(base, adapter, out, progress=False)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def api_differ(what: str, out: str, base: str, adapter: str) -> int:
    from peft_shardmerge import merge_checkpoint
    from peft_shardmerge.errors import ShardMergeError

    dtype = "bfloat16" if RANK == 0 or what != "dtype" else "float16"
    out = out + (str(RANK) if what == "out" else "")
    try:
        merge_checkpoint(base, adapter, out, dtype=dtype, progress=False, distributed=True)
    except ShardMergeError as e:
        print(f"rank {RANK} refused: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    scenario, args = sys.argv[1], sys.argv[2:]
    if scenario == "cli":
        code = cli(args)
    elif scenario == "command":  # the peft-shardmerge command itself, exit included
        from peft_shardmerge.api.entry import run

        sys.argv = ["peft-shardmerge", *args]
        run()
    elif scenario == "kill-after-shard":  # this rank dies
        code = signal_after_shard(int(args[0]), args[1:], os.getpid(), signal.SIGKILL)
    elif scenario == "killall-after-record":
        code = killall_after_record(int(args[0]), args[1:])
    elif scenario == "interrupt-after-shard":  # Ctrl-C reaches torchrun, which passes it on to every rank
        code = signal_after_shard(int(args[0]), args[1:], os.getppid(), signal.SIGINT)
    elif scenario == "fail-finish":
        code = fail_finish(int(args[0]), args[1:])
    elif scenario == "fail":
        code = fail(int(args[0]), args[1:])
    elif scenario == "api-differ":
        code = api_differ(*args)
    elif scenario in ("fsdp2", "fsdp1", "zero3"):
        code = fsdp(args[0], args[1], int(scenario[-1]), "dora" in args[2:])
    elif scenario == "unload-fsdp2":
        code = unload_fsdp2(args[0])
    elif scenario == "ddp":
        code = ddp_wrapped(args[0])
    elif scenario == "tp":
        code = tensor_parallel(args[0], "fsdp" in args[1:])
    elif scenario == "refused-8bit":
        code = refused_8bit(*args)
    elif scenario == "rank0-only-disk":
        code = rank0_only_disk(*args)
    elif scenario == "rank0-only":
        code = rank0_only(args[0])
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    sys.stdout.flush()
    sys.stderr.flush()
    # as peft_shardmerge.api.cli.run does: no interpreter shutdown for torch's process group to abort in
    os._exit(code)
