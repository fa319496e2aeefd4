"""One merge from call to commit: the output settled once, the plan agreed on by every rank, then carried out."""

from __future__ import annotations

import dataclasses
import json
import os
from abc import ABC, abstractmethod
from typing import Callable

from ..distributed.ranks import agree_on_plan, failed
from ..distributed.world import JobSteps
from ..engine.execute import run
from ..engine.plan import Plan
from ..engine.report import MergeReport
from ..engine.sink import Sink
from ..engine.source import Coordinator, Source
from ..options import MergeOptions
from ..output import gguf_sink
from ..output.gguf_sink import GGUFSink, record_path
from ..output.gguf_types import OutType
from ..output.hub_sink import HubSink
from ..output.out_dir import is_gguf, settle_out_dir
from ..output.quant_sink import Encoding, QuantSink, base_quantization, encode_plan
from ..output.shard_sink import FolderSink
from ..quant.encode import encoder_for
from ..support.outtypes import split_bytes
from .hub import Push
from .quiet import quiet_libraries

#: room in a push's staging bound for a tokenizer saved beside the model (the largest in use are near 35 MB)
TOKENIZER_ROOM = 64 * 10**6
#: room in a push's staging bound for the files the merge makes beside the shards (config, index, card, record)
MADE_ROOM = 10**6
#: a push under a launcher of several processes
ONE_PROCESS = (
    "a push to the Hub is made by one process: run it without torchrun, or merge to a folder over the ranks and push "
    "that folder"
)


class MergeJob(ABC):
    """One merge, from the call to the commit, the way every entry that writes a merged folder runs it. What differs
    between entries (where the plan comes from, what produces its tensors, which ranks take part) is a method a
    subclass gives; the order of the steps is here, once:

    1. the output settled: a commit a killed merge left half done is finished or undone (the one write before the
       plan; planning itself writes nothing);
    2. the plan made (:meth:`plan`), and agreed on by every rank of a distributed job;
    3. carried out (:meth:`carry_out`): the one executor streams the plan's tensors from :meth:`source` into
       :meth:`sink`, with :meth:`coordinator`'s hooks for the job's ranks;
    4. the plan's resources released; in a distributed job, a failure said once, with what became of ``out_dir``.

    Args:
        out_dir: the output folder, as given (the output checks name a wrong one); None for a push of a folder's
            files to the Hub (``push``), which writes no output folder.
        opts: the merge's options.
        problems: problems found in the options, reported with the plan's.
        steps: the steps of a distributed job's ranks (None: this process alone).
        push: where the merge is pushed on the Hub (:class:`~peft_shardmerge.api.hub.Push`), or None.

    Example:
        >>> import os, tempfile
        >>> from peft_shardmerge.api.disk import CheckpointJob
        >>> from peft_shardmerge.distributed.world import JobSteps, World
        >>> from peft_shardmerge.distributed.ranks import STEPS
        >>> from peft_shardmerge.options import MergeOptions
        >>> from peft_shardmerge.testing import build_adapter, build_base
        >>> tmp = tempfile.mkdtemp()
        >>> base = build_base(os.path.join(tmp, "base"))
        >>> adapter = build_adapter(base, os.path.join(tmp, "adapter"))
        >>> job = CheckpointJob(base, adapter, os.path.join(tmp, "merged"), MergeOptions(progress=False), [],
        ...                     JobSteps(World(), STEPS))
        >>> job.run().lora_modules_merged
        14
    """

    #: whether the job writes (a dry run only plans: nothing is settled)
    writes = True
    #: with ``overwrite``, what forbids replacing a non-empty ``out_dir`` (None: anything but an earlier output)
    replace_check: Callable[[str], list[str]] | None = None

    def __init__(
        self, out_dir, opts: MergeOptions, problems: list[str], steps: JobSteps | None = None, push: Push | None = None
    ):
        self.push = push
        if push is not None and steps is not None and steps.world.distributed:
            problems.append(ONE_PROCESS)
        if out_dir is not None and is_gguf(out_dir):
            problems += gguf_problems(opts)
            # one rounding, the GGUF type's, from the 32-bit merge; parts of PART_BYTES: what a killed merge keeps
            opts = dataclasses.replace(opts, dtype="float32", max_shard_size=gguf_sink.PART_BYTES)
            if opts.quantize is not None:
                problems.append(
                    f"quantize={opts.quantize!r} applies to a safetensors output; a GGUF file's quantization is its "
                    "outtype (q8_0, q4_k_m, ...)"
                )
        else:
            for name in ("outtype", "split_max_size"):
                if getattr(opts, name) not in (None, 0, "0"):
                    problems.append(
                        f"{name}={getattr(opts, name)!r} applies to a GGUF output: name an output file ending in "
                        f".gguf (e.g. {os.path.join(os.fspath(out_dir or '.'), 'model.gguf')})"
                    )
        self.out_dir, self.opts, self.problems, self.steps = out_dir, opts, problems, steps
        self.outtype: OutType | None = None  # a GGUF output's type, resolved when its sink is made
        self.gguf_name: str | None = None  # a GGUF output's general.name (None: its file's name)
        self.carried: Plan | None = None  # the plan carried out (a re-planned merge's last)
        self.encoding: Encoding | None = None  # the served format the merged weights are written in, if any

    def run(self) -> MergeReport:
        """Settle the output, plan, agree on the plan, carry it out; release the plan's resources.

        Returns:
            The :class:`~peft_shardmerge.engine.report.MergeReport`.
        """
        try:
            if self.writes and self.push is None:  # a push writes no output folder
                settle_out_dir(self.out_dir, inputs=self.inputs(), overwrite=self.opts.overwrite)
            plan = self.plan()  # checks out_dir too: from here on it is a path, resolved once
            if self.out_dir is not None:
                self.out_dir = os.path.abspath(os.fspath(self.out_dir))
            if self.steps is not None:
                agree_on_plan(self.steps, plan, self.out_dir)
            try:
                return self.carry_out(plan)
            finally:
                for folder in plan.resources:
                    folder.cleanup()
        except BaseException as e:
            if self.steps is None or not self.steps.world.distributed:
                raise
            raise failed(self.steps, e, self.out_dir)

    def carry_out(self, plan: Plan) -> MergeReport:
        """The one executor, from :meth:`source` into :meth:`sink`."""
        self.carried = plan
        self.encoding = self.encode(plan)
        source = self.source(plan)
        sink = self.sink(plan, source)
        pushed = isinstance(sink, HubSink)
        if self.encoding is not None:
            sink = QuantSink(sink, self.encoding)
        hook = self.before_commit()
        if pushed:  # the model card, written with the other files before the record
            if self.encoding is not None:
                self.push.save_method = f"merged, quantized as {self.encoding.encoder.name}"
                self.push.tags = [*self.push.tags, self.encoding.encoder.name, "quantized"]
            hook = self.push.card_hook(hook, plan, source, self.card_base(plan))
        report = run(
            plan,
            source,
            sink,
            progress=self.opts.progress,
            before_commit=hook,
            coordinator=self.coordinator(plan),
        )
        if self.encoding is not None:
            report.bytes_written = self.encoding.size(plan)
            report.notes = [*report.notes, self.encoding.describe()]
        if pushed:
            report.notes = [*report.notes, f"pushed: {sink.commit_url}"]
            self.push.url = sink.commit_url
            return report
        if is_gguf(self.out_dir) and os.path.isfile(record_path(self.out_dir)):  # the files, in their GGUF type
            with open(record_path(self.out_dir), encoding="utf-8") as f:
                files = json.load(f)["files"]
            report.shards, report.bytes_written = list(files), sum(f["size"] for f in files.values())
            report.dtype = self.outtype.name if self.outtype is not None else report.dtype
        return report

    @abstractmethod
    def inputs(self) -> dict:
        """The input folders by role, which the output may not be."""
        ...  # pragma: no cover - each job says

    @abstractmethod
    def plan(self) -> Plan:
        """The plan (raising every problem found, those of the options included)."""
        ...  # pragma: no cover - each job says

    @abstractmethod
    def source(self, plan: Plan) -> Source:
        """What produces the plan's tensors."""
        ...  # pragma: no cover - each job says

    def coordinator(self, plan: Plan) -> Coordinator | None:
        """The hooks of the job's ranks (None: this process alone)."""
        return None

    def sink(self, plan: Plan, source: Source) -> Sink:
        """Where the merge goes: the Hub (a folder's files pushed as they are written), the GGUF file ``out_dir`` (a
        path ending in ``.gguf``), else the safetensors folder ``out_dir``."""
        if self.out_dir is None and self.push is not None:
            return HubSink(
                self.push.target,
                self.push.staging_dir(),
                in_flight=self.push.in_flight,
                side_bytes=self.side_bytes(plan),
                prepare=self.push.prepare,
                replace=self.push.replace,
            )
        if is_gguf(self.out_dir):
            outtype = self.outtype = OutType.parse(self.opts.outtype or "auto", self.base_dtype(plan))
            return GGUFSink(
                [(self.out_dir, outtype)],
                plan.config,
                source.side_files,
                self.before_commit(),
                self.opts.overwrite,
                self.gguf_name,
                split_max_size=split_bytes(self.opts.split_max_size),
                quiet=quiet_libraries,
            )
        return FolderSink(self.out_dir, overwrite=self.opts.overwrite, replace_check=self.replace_check)

    def encode(self, plan: Plan) -> Encoding | None:
        """The served format the plan's weights are written in (``quantize``), None for the merge's own dtype. The
        weights it encodes are merged to float32 and quantized once from it.

        Raises:
            InputError: the format cannot take a weight's shape, or the base's format cannot be written back.
        """
        if self.opts.quantize is None:
            return None
        qc = base_quantization(plan)
        encoder = encoder_for(self.opts.quantize, qc)
        return encode_plan(plan, encoder, qc if str(self.opts.quantize).strip().lower() == "base" else None)

    def base_dtype(self, plan: Plan) -> str:
        """The base's dtype, whose 16-bit type a GGUF output of type ``auto`` keeps."""
        return "bfloat16"

    def side_bytes(self, plan: Plan) -> int:
        """The most the files beside the shards take (a push's staging bound): the base's files the merge carries,
        the files it makes (config, index, model card, record), and room for what a hook saves beside them (a
        tokenizer)."""
        base = getattr(plan.inputs, "base", None)  # a loaded model's plan has none: nothing carried
        carried = base.extra_bytes if base is not None else 0
        adapter = getattr(plan.inputs, "adapter", None)
        for f in getattr(adapter, "tokenizer_files", None) or []:  # they replace the base's: counted besides
            path = os.path.join(getattr(adapter, "folder", "") or "", f)
            carried += os.path.getsize(path) if os.path.isfile(path) else 0
        return carried + MADE_ROOM + (TOKENIZER_ROOM if self.saves_beside() else 0)

    def saves_beside(self) -> bool:
        """Whether the caller's hook saves files beside the model (a tokenizer)."""
        return False

    def card_base(self, plan: Plan) -> tuple[str | None, object]:
        """The base model's name and the adapter's PEFT config, for a pushed model's card."""
        return None, None

    def before_commit(self) -> Callable[[str], None] | None:
        """Called with the folder being written, after its side files."""
        return None


def gguf_problems(opts: MergeOptions) -> list[str]:
    """What a GGUF output refuses among the options: the 16-bit dtype and the shard size of a folder's output."""
    problems = []
    if opts.dtype is not None:
        problems.append(
            f"dtype={opts.dtype!r} applies to a folder's output; a GGUF file is written from the 32-bit merge in its "
            "outtype (f16, bf16, q8_0, q4_k_m, ...): pass outtype instead"
        )
    if opts.shard_bytes != MergeOptions().shard_bytes:
        problems.append(
            f"max_shard_size={opts.max_shard_size!r} applies to a folder's shards; a GGUF output is one file"
        )
    return problems
