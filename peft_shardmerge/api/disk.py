"""The public disk-to-disk API: merge_checkpoint and plan_checkpoint_merge, thin wrappers over MergeOptions."""

from __future__ import annotations

import functools
import logging
import os
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Callable, Sequence

import torch

from ..checkpoint.planner import BeforeChecks, base_dtype, plan_from_folders
from ..checkpoint.reader import CheckpointReader
from ..distributed.coordinators import SpreadShards
from ..distributed.ranks import STEPS
from ..distributed.world import JobSteps, World, joined_world
from ..engine.execute import resolve_device
from ..engine.pipeline import default_workers
from ..engine.plan import Plan
from ..engine.report import MergeReport
from ..engine.sink import Layout
from ..engine.source import Alone, Coordinator
from ..errors import FileSystemError, InputError, PlanChanged, ShardMergeError
from ..options import DEFAULT_CHUNK_ELEMS, MergeOptions
from ..output.hub_push import HubTarget
from ..output.hub_staging import staged_push
from ..output.out_dir import check_out_dir, is_gguf, path_argument
from ..output.staging import NOTHING_WRITTEN
from .hub import Push, prepare_repo, push_gguf_folder
from .job import ONE_PROCESS, MergeJob
from .model_checks import ChecksBeside, KnownChecks, checks_beside, outline
from .quiet import quiet_libraries

log = logging.getLogger(__name__)


def plan_checkpoint_merge(
    base: str | os.PathLike,
    adapter: str | os.PathLike | Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    weights: Sequence[float] | None = None,
    combination: str = "cat",
    density: float | None = None,
    majority_sign: str = "total",
    normalize: bool | None = None,
    seed: int = 0,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    base_precision: str = "auto",
    nf4_quant_type: str = "nf4",
    nf4_blocksize: int = 64,
    nf4_double_quant: bool = True,
    device: str = "auto",
    overwrite: bool = False,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    options: MergeOptions | None = None,
) -> Plan:
    """Check every input and decide the whole merge without reading tensor data (what ``--dry-run`` prints).

    Args:
        base: base checkpoint folder, or a Hub id in the local cache.
        adapter: PEFT LoRA adapter folder, or a Hub id in the local cache; or a list of them, merged as the
            weighted combination ``weights``/``combination`` describe.
        out_dir: the output folder.
        weights: one weight per adapter (default 1.0 each).
        combination: ``"cat"`` (exactly ``sum_i w_i * dW_i``, any ranks), ``"linear"`` (PEFT's
            ``add_weighted_adapter`` linear factors, equal ranks), or a task-vector method on each tensor's full
            deltas, as MergeKit defines it: ``"ties"``, ``"dare_ties"``, ``"dare_linear"``, ``"magnitude_prune"``;
            see :func:`~peft_shardmerge.checkpoint.combine.combine_adapters`.
        density: the fraction of each adapter's delta a task-vector method keeps, in (0, 1] (required by them).
        majority_sign: how ``ties``/``dare_ties`` elect each element's sign: ``"total"`` (the sign of the weighted
            sum) or ``"frequency"`` (the sign most adapters have).
        normalize: divide by the weights of the deltas kept at each element; None: the method's default (on for
            ``ties`` only).
        seed: the seed of DARE's random draw; the same seed gives the same bytes, whatever the row blocks, the
            ranks or a resume.
        dtype: output dtype (``"bfloat16"``, ``"float16"``, ``"float32"`` or a torch dtype); None keeps the base's.
        max_shard_size: largest output shard (``"5GB"``, ``"500MB"`` or bytes).
        base_precision: ``"auto"`` (the default) reproduces the trained model: ``"nf4"`` where the adapter's
            files show it was trained on a 4-bit base (with the 4-bit settings they record), else ``"original"``;
            ``"original"`` merges into the checkpoint's weights; ``"nf4"`` merges into dequant(quantize_4bit(W)),
            the weights a QLoRA adapter was trained against. The plan's ``reproduces`` says which model results.
        nf4_quant_type: ``"nf4"`` or ``"fp4"`` for ``base_precision="nf4"``.
        nf4_blocksize: 4-bit block size used during training.
        nf4_double_quant: whether training used double quantization.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        overwrite: allow replacing a non-empty ``out_dir``.
        chunk_elems: elements per row block (bounds peak memory).
        options: the same knobs as one :class:`~peft_shardmerge.options.MergeOptions`; a keyword left at its
            default defers to it, a keyword set to another value wins over a field left at its default, and a
            keyword and a field set to different values are refused.

    Returns:
        The :class:`~peft_shardmerge.engine.plan.Plan`; ``print(plan.describe())`` shows it.

    Raises:
        InputError: every problem with the options (conflicts between keywords and ``options`` too), the output
            folder and the adapter/base pairing, at once.
        NotFoundError: the base or adapter cannot be found.
        UnsupportedError: the adapter type or an adapter option cannot be merged.
        CorruptFileError: a checkpoint or adapter file is malformed.

    Example:
        >>> import os, tempfile
        >>> from peft_shardmerge import plan_checkpoint_merge
        >>> from peft_shardmerge.testing import build_adapter, build_base
        >>> tmp = tempfile.mkdtemp()
        >>> base = build_base(os.path.join(tmp, "base"))
        >>> adapter = build_adapter(base, os.path.join(tmp, "adapter"), target_modules=["q_proj"])
        >>> plan = plan_checkpoint_merge(base, adapter, os.path.join(tmp, "merged"), dtype="bfloat16")
        >>> [(t.name, t.op) for t in plan.tensors if t.recipe.loras]   # doctest: +NORMALIZE_WHITESPACE
        [('model.layers.0.self_attn.q_proj.weight', <Op.MERGE: 'merge'>),
         ('model.layers.1.self_attn.q_proj.weight', <Op.MERGE: 'merge'>)]
        >>> os.path.exists(os.path.join(tmp, "merged"))   # a plan writes nothing
        False
    """
    opts, problems = MergeOptions.from_call(locals())
    return plan_with_options(base, adapter, out_dir, opts, problems)


def plan_with_options(
    base: str | os.PathLike,
    adapter: str | os.PathLike | Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    opts: MergeOptions,
    problems: list[str] | None = None,
) -> Plan:
    """:func:`plan_checkpoint_merge` with its knobs as one :class:`~peft_shardmerge.options.MergeOptions`.

    Args:
        base: base checkpoint folder, or a cached Hub id.
        adapter: an adapter folder or cached Hub id, or a list of them.
        out_dir: the output folder.
        opts: the options (their problems are reported with the rest).
        problems: problems found already (conflicts between keywords and ``options``), reported with the rest.

    Returns:
        The :class:`~peft_shardmerge.engine.plan.Plan`.

    Raises:
        InputError, NotFoundError, UnsupportedError, CorruptFileError: as :func:`plan_checkpoint_merge`.

    """
    return _plan(base, adapter, out_dir, opts, problems)[0]


def _plan(
    base,
    adapter,
    out_dir,
    opts: MergeOptions,
    problems: list[str] | None,
    *,
    beside: bool = False,
    check_out: bool = True,
    before_checks: BeforeChecks | None = None,
) -> tuple[Plan, ChecksBeside | None]:
    """:func:`plan_with_options`; with ``beside``, the plan from the files alone and the second process checking it
    (the whole plan, made here, where that plan has problems); without ``check_out``, ``out_dir`` is not checked (the
    second process's whole plan: the merge checked it); ``before_checks`` as
    :func:`~peft_shardmerge.checkpoint.planner.plan_from_folders` takes it."""
    problems = list(problems if problems is not None else opts.problems())
    opts = opts.for_path("disk")
    base, bad_base = path_argument(base, "base")
    locations, bad = _adapter_locations(adapter)
    if bad_base or bad:  # unreadable path arguments: nothing else can be checked
        raise InputError(bad_base + bad + problems + check_out_dir(out_dir, inputs={}, overwrite=opts.overwrite))
    out_dir = os.fspath(out_dir) if isinstance(out_dir, os.PathLike) else out_dir
    try:
        resolve_device(opts.device)
    except InputError as e:
        problems += [p for p in e.problems if p not in problems]
    planned = functools.partial(
        plan_from_folders,
        base,
        locations,
        opts,
        problems,
        out_dir=out_dir,
        check_out=check_out,
        before_checks=before_checks,
    )
    checks = ChecksBeside.take((base, locations), opts) if beside and not problems else None
    if checks is None:
        ChecksBeside.drop_early()  # started for a merge that makes its checks first
    else:
        try:
            with quiet_libraries(transformers=False):  # the files may need it (PEFT-rebuilt layers): held back then
                return planned(model_checks=False), checks
        except BaseException as e:
            checks.stop()
            if not isinstance(e, ShardMergeError):
                raise
            # a problem of the plan from the files alone: said again, with every problem at once, by the whole plan
    with quiet_libraries():  # transformers and PEFT may be imported here for the first time
        return planned(), None


def whole_plan(
    base, adapter, opts: MergeOptions, problems: list[str], before_checks: BeforeChecks | None = None
) -> Plan:
    """The plan a merge's model-class checks make beside it (:mod:`~peft_shardmerge.api.model_checks`): every check
    but those of the output folder, which the merge made.

    Args:
        base: the base argument, as the merge was given it.
        adapter: the adapter argument (one or a list).
        opts: the options.
        problems: problems found already.
        before_checks: see :func:`~peft_shardmerge.checkpoint.planner.plan_from_folders`.

    Returns:
        The :class:`~peft_shardmerge.engine.plan.Plan`.

    Raises:
        InputError, NotFoundError, UnsupportedError, CorruptFileError: as :func:`plan_checkpoint_merge`.
    """
    return _plan(base, adapter, None, opts, problems, check_out=False, before_checks=before_checks)[0]


def _adapter_locations(adapter) -> tuple[list, list[str]]:
    """The adapter path arguments (one or a list), with the problems of unreadable ones."""
    many = not isinstance(adapter, (str, bytes, os.PathLike)) and isinstance(adapter, Sequence)
    locations, problems = [], []
    for i, a in enumerate(adapter if many else [adapter]):
        a, bad = path_argument(a, f"adapter {i + 1}" if many else "adapter")
        locations.append(a)
        problems += bad
    if not locations:
        problems.append("adapter is an empty list; pass at least one adapter folder")
    return locations, problems


def merge_checkpoint(
    base: str | os.PathLike,
    adapter: str | os.PathLike | Sequence[str | os.PathLike],
    out_dir: str | os.PathLike | None = None,
    *,
    # the adapters and how they combine
    weights: Sequence[float] | None = None,
    combination: str = "cat",
    density: float | None = None,
    majority_sign: str = "total",
    normalize: bool | None = None,
    seed: int = 0,
    # what is written
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    base_precision: str = "auto",
    nf4_quant_type: str = "nf4",
    nf4_blocksize: int = 64,
    nf4_double_quant: bool = True,
    outtype: str | None = None,
    split_max_size: int | str = 0,
    quantize: str | None = None,
    # how it runs
    device: str = "auto",
    overwrite: bool = False,
    dry_run: bool = False,
    progress: bool = True,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    before_commit: Callable[[str], None] | None = None,
    resume: bool = True,
    workers: int | None = None,
    model_checks: str = "auto",
    options: MergeOptions | None = None,
    distributed: bool = False,
    # pushed to the Hub instead of written to out_dir
    push_to_hub: str | None = None,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    staging: str | os.PathLike | None = None,
) -> MergeReport:
    """Merge a LoRA adapter into a base checkpoint on disk, streaming one row block at a time.

    The output is a transformers checkpoint (``model.safetensors`` or shards with an index, ``config.json``
    without ``quantization_config`` unless ``quantize`` names a format, generation and tokenizer files) that
    ``from_pretrained`` loads as is.
    Peak memory is one row block, whatever the model or shard size. The folder appears only when complete.

    With ``distributed=True``, in a job a launcher started (``torchrun``: ``WORLD_SIZE`` above 1, or a process group
    already initialized), every rank calls this with the same arguments: the output shards are split over the ranks,
    which write them into one staging folder (on a filesystem every node shares); rank 0 writes the rest and commits.
    The result is the same bytes as one process writes. See ``docs/distributed.md``.

    With ``push_to_hub``, the merge goes to a Hub repository instead of ``out_dir``: each shard is uploaded by
    content as soon as it is written and deleted here, and one commit adds every file at the end (``docs/hub.md``);
    the local disk holds at most two shards and the files beside them. With ``outtype``, one GGUF file is pushed so.

    Args:
        base: base checkpoint folder, or a Hub id already in the local Hugging Face cache.
        adapter: PEFT LoRA adapter folder, or a cached Hub id; or a list of them (a weighted combination).
        out_dir: the output folder (None with ``push_to_hub``).
        weights: one weight per adapter (default 1.0 each).
        combination: ``"cat"``, ``"linear"``, ``"ties"``, ``"dare_ties"``, ``"dare_linear"`` or
            ``"magnitude_prune"`` (see :func:`plan_checkpoint_merge`).
        density: the fraction of each delta a task-vector method keeps.
        majority_sign: ``"total"`` or ``"frequency"`` (``ties``, ``dare_ties``).
        normalize: None for the method's default.
        seed: DARE's seed.
        dtype: output dtype; None keeps the base's.
        max_shard_size: largest output shard (decimal units: ``"5GB"`` is 5e9 bytes).
        base_precision: ``"auto"`` (reproduce the trained model), ``"original"`` or ``"nf4"`` (see
            :func:`plan_checkpoint_merge`).
        nf4_quant_type: ``"nf4"`` or ``"fp4"``.
        nf4_blocksize: 4-bit block size used in training.
        nf4_double_quant: whether training used double quantization.
        outtype: the GGUF type where ``out_dir`` ends in ``.gguf`` (one GGUF file, as llama.cpp's converter and
            quantizer write it, see ``docs/gguf.md``): ``"auto"`` (None; the base's 16-bit type), ``"f32"``,
            ``"f16"``, ``"bf16"``, ``"q8_0"``, ``"q4_0"``, ``"q4_1"``, ``"q5_0"``, ``"q5_1"``, ``"q4_k_s"``,
            ``"q4_k_m"``, ``"q5_k_s"``, ``"q5_k_m"``, ``"q6_k"``.
        split_max_size: a GGUF output split into files of at most this many bytes of tensors, named and laid out
            as llama.cpp's converter splits them (``"2G"``; K, M, G are powers of 1000); 0 writes one file.
        quantize: write the merged weights in a served format, each quantized once from its float32 merge as the
            format's own tool quantizes it (``docs/quantized.md``): ``"fp8-block"`` (transformers' fine-grained
            FP8), ``"ct-fp8-block"`` / ``"ct-w4a16"`` (compressed-tensors, for vLLM), ``"nf4"`` / ``"fp4"`` /
            ``"int8"`` (bitsandbytes), or ``"base"`` (the base checkpoint's own quantized format); None writes
            ``dtype``.
        device: where the maths runs: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        overwrite: allow replacing a non-empty ``out_dir`` (replaced only after the new one is complete); with
            ``push_to_hub``, delete in the push's commit the repository's weight files it does not write.
        dry_run: plan and check only; nothing is read beyond headers and nothing is written.
        progress: show a progress bar.
        chunk_elems: elements per row block.
        before_commit: called with the temporary output folder before it is checked and moved into place
            (to add files, e.g. ``tokenizer.save_pretrained``).
        resume: when an earlier run of the same merge (same inputs and options) was killed, keep its
            finished and verified shards (``.<OUT>.partial/manifest.json``) and redo the rest.
        workers: tensors merged at once, each on its own thread; None (the default) is one per CPU, at most 8.
            The bytes written do not depend on it.
        model_checks: when the model class is built on the meta device and PEFT asked which adapter tensors it
            loads: ``"first"``, before anything is read; ``"beside"``, in a second process while the merge streams
            the plan made from the files (compared before the commit: the merge is made again where the two differ,
            and their error is raised with nothing committed); ``"auto"``: beside where PEFT is not imported yet and
            two CPUs or more are free (a command line's start-up), else first. The bytes do not depend on it.
        options: the knobs above as one :class:`~peft_shardmerge.options.MergeOptions` (all but ``dry_run``,
            ``before_commit`` and ``distributed``); the precedence of :func:`plan_checkpoint_merge` applies.
        distributed: split the merge over the ranks of the job this process belongs to; every rank must call this
            (the command line does under ``torchrun``). False (the default) merges in this process alone, inside a
            job too (``if rank == 0: merge_checkpoint(...)``).
        push_to_hub: a Hub repository (``"user/name"``, or ``"name"`` in the token owner's namespace) to push the
            merge to, in one commit; the access is checked before anything is merged.
        token: the Hub token (None: ``HF_TOKEN`` or the login cache); never printed.
        private: create the repository private.
        revision: the branch to push to (made at the commit where it does not exist).
        commit_message: the commit's title.
        staging: where shards wait for their upload (None: the system's temporary folder); a rerun after a kill
            finds there the journal of the shards already uploaded, and neither merges nor sends them again.

    Returns:
        A :class:`~peft_shardmerge.engine.report.MergeReport` (``report.summary()`` for a one-screen summary).

    Raises:
        InputError: problems with inputs or options, all reported at once, before anything is written.
        NotFoundError: the base or adapter cannot be found.
        UnsupportedError: the adapter cannot be merged by this version.
        CorruptFileError: a file is malformed.
        MergeCheckError: a consistency check failed after writing; nothing was committed.
        OutputLockedError: another merge is writing ``out_dir``.
        OutputChangedError: ``out_dir`` changed while the merge ran; it was left as it is and the new output
            kept in ``.<OUT>.partial`` (the message says so).
        FileSystemError: the filesystem failed (disk full, I/O error); an ``OSError`` too, whose message says
            what became of ``out_dir``.
        PeerFailedError: (distributed) another rank failed; its message, and what became of ``out_dir``.

    Example:
        >>> import os, tempfile
        >>> from peft_shardmerge import merge_checkpoint
        >>> from peft_shardmerge.testing import build_adapter, build_base
        >>> tmp = tempfile.mkdtemp()
        >>> base = build_base(os.path.join(tmp, "base"))
        >>> adapter = build_adapter(base, os.path.join(tmp, "adapter"))
        >>> report = merge_checkpoint(base, adapter, os.path.join(tmp, "merged"), dtype="bfloat16", progress=False)
        >>> report.lora_modules_merged, report.dtype, report.shards
        (14, 'bfloat16', ['model.safetensors'])
    """
    opts, problems = MergeOptions.from_call(locals())
    if push_to_hub is not None:
        hub = {"token": token, "private": private, "revision": revision, "commit_message": commit_message}
        return _merge_and_push(base, adapter, out_dir, opts, problems, push_to_hub, hub, staging, dry_run, distributed)
    joined = joined_world(opts.device) if distributed else nullcontext(World())
    with quiet_libraries(transformers=False), joined as world:  # each step that may import transformers: quiet itself
        steps = JobSteps(world, ("plan",) if dry_run else STEPS)
        return CheckpointJob(base, adapter, out_dir, opts, problems, steps, dry_run, before_commit).run()


def _merge_and_push(
    base, adapter, out_dir, opts: MergeOptions, problems: list[str], repo_id, hub: dict, staging, dry_run, distributed
) -> MergeReport:
    """:func:`merge_checkpoint` with ``push_to_hub``: the Hub's access checked first, then the merge streamed to it
    (a GGUF file, with ``outtype``, staged whole and pushed)."""
    if out_dir is not None:
        problems.append(
            f"out_dir={os.fspath(out_dir)!r} and push_to_hub={repo_id!r}: a merge is written to a folder or pushed "
            "to the Hub, not both; merge to the folder first and push it with `hf upload` to keep a local copy"
        )
    if distributed and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        problems.append(ONE_PROCESS)
    if problems:
        raise InputError(problems)
    steps = JobSteps(World(), ("plan",) if dry_run else STEPS)
    with quiet_libraries(transformers=False):
        if dry_run:
            return CheckpointJob(base, adapter, None, opts, problems, steps, dry_run=True).run()

        def prepare() -> str:
            return prepare_repo(repo_id, token=hub["token"], private=hub["private"], revision=hub["revision"])

        target = HubTarget(
            repo_id.strip("/"),
            token=hub["token"],
            revision=hub["revision"],
            private=hub["private"],
            commit_message=hub["commit_message"] or "Upload merged model",
            progress=opts.progress,
        )
        staging = None if staging is None else os.fspath(staging)
        push = Push(target, staging, prepare=prepare, replace=opts.overwrite)
        if opts.outtype is None:  # the repository made once the plan and the staging folder are found right
            report = CheckpointJob(base, adapter, None, opts, problems, steps, push=push).run()
        else:  # a GGUF is merged whole before its push: the repository first
            target.repo_id = prepare()
            report = _push_gguf(base, adapter, opts, problems, steps, push)
    report.out_dir = target.url
    return report


def _push_gguf(base, adapter, opts: MergeOptions, problems: list[str], steps: JobSteps, push: Push) -> MergeReport:
    """One GGUF file merged into the push's staging folder, then pushed with its record and model card."""
    name = push.target.repo_id.split("/")[-1]
    with staged_push(push.folder()) as folder:
        file = f"{name}.{opts.outtype.upper()}.gguf" if opts.outtype != "auto" else f"{name}.gguf"
        job = CheckpointJob(base, adapter, os.path.join(folder, file), opts, problems, steps)
        job.gguf_name = name
        report = job.run()
        push.save_method, push.tags = "gguf", ["gguf", "llama.cpp"]
        push.url = push_gguf_folder(folder, push, report, *job.card_base(job.carried))
    report.notes = [*report.notes, f"pushed: {push.url}"]
    return report


class CheckpointJob(MergeJob):
    """A merge from disk (:func:`merge_checkpoint`, the command line) as one
    :class:`~peft_shardmerge.api.job.MergeJob`: planned from the folders' files, its model-class checks run first
    or beside the merge, read by a :class:`~peft_shardmerge.checkpoint.reader.CheckpointReader`, spread over the
    ranks of a distributed job.

    Args:
        base, adapter: as :func:`merge_checkpoint` takes them.
        out_dir: the output folder.
        opts: the options.
        problems: the options' problems.
        steps: the job's steps (one process: a world of one).
        dry_run: plan and describe only: nothing is settled or written.
        before_commit: the caller's hook, called with the folder being written after its side files.
        push: where the merge is pushed on the Hub instead (``out_dir`` None).
    """

    def __init__(
        self,
        base,
        adapter,
        out_dir,
        opts: MergeOptions,
        problems: list[str],
        steps: JobSteps,
        dry_run: bool = False,
        before_commit: Callable[[str], None] | None = None,
        push: Push | None = None,
    ):
        if out_dir is not None and is_gguf(out_dir) and steps.world.distributed:
            problems.append(
                "a GGUF output is one file that one process writes: run the command without torchrun (its one "
                "pass is as fast as the merge on one machine), or merge to a folder over the ranks"
            )
        super().__init__(out_dir, opts, problems, steps, push)
        self.base, self.adapter, self.dry_run, self.hook = base, adapter, dry_run, before_commit
        self.writes = not dry_run
        # a quantized output's weights are chosen by the model class: its checks come first
        self.beside = opts.quantize is None and checks_beside(
            opts.model_checks, distributed=steps.world.distributed, dry_run=dry_run, out_dir=out_dir
        )
        self.checks: ChecksBeside | None = None
        self.confirm: _Confirmed | None = None

    @property
    def checks_out(self) -> bool:
        """Whether the plan checks ``out_dir`` (a push of a folder's files has none)."""
        return self.push is None or self.out_dir is not None

    def inputs(self) -> dict:
        return _inputs(self.base, self.adapter)

    def plan(self) -> Plan:
        plan, self.checks = _planned(
            self.base,
            self.adapter,
            self.out_dir,
            self.opts,
            self.problems,
            beside=self.beside,
            check_out=self.checks_out,
        )
        return plan

    def carry_out(self, plan: Plan) -> MergeReport:
        """The plan described (a dry run) or merged; where the model-class checks run beside it and made another
        plan, merged again with theirs."""
        for note in plan.notes if self.steps.world.rank == 0 else ():
            log.debug("%s", note)  # the report's summary (the CLI prints it) shows each note once
        if self.dry_run:
            report = _described(plan, self.out_dir)  # as merged; then what the format makes of it
            encoding = self.encode(plan)  # a format the plan's shapes cannot take: said by the dry run too
            if encoding is not None:
                report.plan_text += "\n" + encoding.summary(plan)
            if is_gguf(self.out_dir):
                layout = Layout(plan.shard_entries())
                report.plan_text += "\n" + self.sink(plan, CheckpointReader(plan)).describe(layout)
            return report
        if self.checks is None:
            return super().carry_out(plan)
        self.confirm = _Confirmed(plan, self.checks)
        try:
            return super().carry_out(plan)
        except PlanChanged as e:
            log.info("%s; merging again with it", e)
        finally:
            self.confirm.checks.stop()
        self.confirm = None
        plan, _ = _planned(self.base, self.adapter, self.out_dir, self.opts, self.problems, check_out=self.checks_out)
        return super().carry_out(plan)

    def source(self, plan: Plan) -> CheckpointReader:
        return CheckpointReader(
            plan,
            self.steps.world.device(resolve_device(self.opts.device)),
            resume=self.opts.resume,
            workers=self.opts.workers or default_workers(self.steps.world.local_size),
        )

    def coordinator(self, plan: Plan) -> Coordinator | None:
        """The ranks' shares of a distributed job; one process whose checks run beside it: their verdict."""
        return SpreadShards(plan, self.steps) if self.steps.world.distributed else self.confirm

    def before_commit(self) -> Callable[[str], None] | None:
        return self.confirm.then(self.hook) if self.confirm is not None else self.hook

    def base_dtype(self, plan: Plan) -> str:
        return str(base_dtype(plan.inputs.base))

    def saves_beside(self) -> bool:
        return self.hook is not None

    def card_base(self, plan: Plan) -> tuple[str | None, object]:
        """The base the adapter names (``base_model_name_or_path``) and its config, as the plan read them."""
        spec = plan.inputs.adapter
        cfg = spec.config
        config = SimpleNamespace(
            r=cfg.get("r", ""),
            lora_alpha=cfg.get("lora_alpha", ""),
            target_modules=cfg.get("target_modules"),
            peft_type=SimpleNamespace(value=spec.peft_type),
        )
        return cfg.get("base_model_name_or_path"), config


def _described(plan: Plan, out_dir) -> MergeReport:
    """The report of a dry run: the plan, nothing written."""
    return MergeReport(
        out_dir=out_dir,
        base=plan.inputs.base.folder,
        adapter=", ".join(plan.inputs.adapter.folders),
        dtype=str(plan.dtype).removeprefix("torch."),
        base_precision=plan.base_precision,
        tensors_written=0,
        lora_modules_total=plan.layer_count,
        shards=list(plan.shard_names),
        notes=list(plan.notes),
        dry_run=True,
        plan_text=plan.describe(),
        reproduces=plan.reproduces,
    )


def _inputs(base, adapter) -> dict:
    """The input folders by role, as given (for the output folder's checks before they are resolved)."""
    adapters = [adapter] if isinstance(adapter, (str, os.PathLike)) else adapter
    adapters = adapters if isinstance(adapters, (list, tuple)) else []  # a wrong type: the checks name it
    given = {"base": base, **{f"adapter {i + 1}": a for i, a in enumerate(adapters)}}
    return {role: os.fspath(p) for role, p in given.items() if isinstance(p, (str, os.PathLike))}


def _planned(
    base, adapter, out_dir, opts: MergeOptions, problems: list[str], **how
) -> tuple[Plan, ChecksBeside | None]:
    """:func:`_plan`, a failure of the filesystem said as one (``OUT`` untouched)."""
    try:
        return _plan(base, adapter, out_dir, opts, problems, **how)
    except OSError as e:
        if isinstance(e, ShardMergeError):
            raise
        raise FileSystemError(e, NOTHING_WRITTEN) from e


#: how an error found by the checks beside a merge begins
BESIDE_FOUND = "by the model-class checks run beside the merge; its output was discarded and OUT is unchanged"


class _Confirmed(Alone):
    """A merge by one process whose model-class checks run beside it: their plan must be the one merged. Between
    tensors their verdict is taken as soon as they have one; before the commit it is waited for. A different plan
    raises :class:`PlanChanged`; checks that did not plan are made here, raising their problems."""

    def __init__(self, plan: Plan, checks: ChecksBeside):
        self.plan, self.checks, self.confirmed = plan, checks, False

    def before(self, t) -> None:
        """Between tensors: the checks' verdict, once they have one."""
        if not self.confirmed and self.checks.done():
            self.confirm()

    def confirm(self) -> None:
        """Take the checks' verdict (waiting for it); raise when the plan they made is not this one."""
        if self.confirmed:
            return
        checks = self.checks
        made = checks.join()
        if isinstance(checks, KnownChecks) and made != outline(self.plan):  # kept for a plan this is not: check now
            log.debug("model-class checks beside the merge: the kept verdict is for another plan; checking")
            checks = ChecksBeside.start(checks.given, checks.options, checks.known) or checks
            self.checks, made = checks, checks.join() if not isinstance(checks, KnownChecks) else None
        if made is None:  # the second process did not plan: plan here, raising its problems with their own type
            try:
                with quiet_libraries():
                    made = outline(whole_plan(*checks.given, checks.opts, []))
            except InputError as e:
                raise InputError(e.problems, when=BESIDE_FOUND) from e
        if made != outline(self.plan):
            raise PlanChanged("the plan made with the model class differs from the one made from the files alone")
        checks.remember(made)
        self.confirmed = True

    def then(self, before_commit) -> Callable[[str], None]:
        """The hook before the commit: the verdict, then the caller's ``before_commit``."""

        def hook(staging: str) -> None:
            self.confirm()
            if before_commit is not None:
                before_commit(staging)

        return hook
