"""The peft-shardmerge command line: argument parsing, logging levels and exit codes."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys

from ..errors import ShardMergeError
from ..quant.names import NAMES
from ..support.combinations import COMBINATIONS, MAJORITY_SIGNS
from ..support.outtypes import OUTTYPES
from ..version import __version__
from .model_checks import ChecksBeside, checks_beside

#: the libraries whose log records under ERROR the command line leaves out (``-v`` shows them)
NOISY = ("transformers", "huggingface_hub", "bitsandbytes", "kernels", "torch", "accelerate", "DeepSpeed")
NOISY += ("httpx", "httpx2", "httpcore", "httpcore2")  # the Hub client's requests

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class Terminated(BaseException):
    """Raised in the main thread when SIGTERM arrives, so that the staging folder is cleaned up; in a distributed
    job the launcher sends it when a rank died or the scheduler stops the job, so the finished shards are kept for a
    rerun instead (``keep_partial``)."""

    keep_partial = False


def _on_sigterm(signum, frame):  # signal handler signature
    error = Terminated()
    error.keep_partial = _rank() is not None
    raise error


def _combination_arguments(m: argparse.ArgumentParser) -> None:
    """The options of a merge of several adapters: which, with what weights, combined how."""
    g = m.add_argument_group("several adapters (docs/variants-several-adapters.md)")
    g.add_argument(
        "--add-adapter",
        action="append",
        default=[],
        metavar="FOLDER",
        help="another adapter to merge with ADAPTER (repeatable); see --weights and --combination",
    )
    g.add_argument(
        "--weights",
        type=float,
        nargs="+",
        metavar="W",
        help="one weight per adapter, ADAPTER first (default 1.0 each)",
    )
    g.add_argument(
        "--combination",
        choices=COMBINATIONS,
        default="cat",
        help="how several adapters combine: cat = exactly sum of w_i * delta_i (default); linear = "
        "PEFT add_weighted_adapter's 'linear' (equal ranks, cross terms included); ties, dare_ties, dare_linear, "
        "magnitude_prune = MergeKit's task-vector methods on each tensor's full deltas (need --density; DARE's kept "
        "elements are divided by the density)",
    )
    g.add_argument(
        "--density",
        type=float,
        metavar="D",
        help="fraction of each adapter's delta kept by a task-vector method, in (0, 1]",
    )
    g.add_argument(
        "--majority-sign",
        choices=MAJORITY_SIGNS,
        default="total",
        help="how ties and dare_ties elect each element's sign: total = the sign of the weighted sum (default), "
        "frequency = the sign most adapters have",
    )
    g.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="divide by the weights of the deltas kept at each element (default: on for ties, off for the others)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of DARE's random draw (default 0)")


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser (``peft-shardmerge merge ...``).

    Returns:
        The parser.

    Example:
        >>> build_parser().parse_args(["merge", "base", "adapter", "out"]).dtype is None
        True
    """
    p = argparse.ArgumentParser(
        prog="peft-shardmerge",
        description="Merge LoRA adapters into 16-bit checkpoints with flat memory.",
    )
    p.add_argument("--version", action="version", version=f"peft-shardmerge {__version__}")
    sub = p.add_subparsers(dest="command")
    _merge_parser(sub)
    _push_parser(sub)
    _verify_parser(sub)
    return p


def _merge_parser(sub) -> None:
    """The ``merge`` command and its options."""
    m = sub.add_parser(
        "merge",
        usage="peft-shardmerge merge [-h] [options] [BASE] ADAPTER OUT",
        help="merge a base checkpoint and a LoRA adapter folder into a new checkpoint",
        description="Merge BASE + ADAPTER into OUT, one row block at a time. Under torchrun (torchrun "
        "--nproc_per_node N -m peft_shardmerge merge ...) the output shards are split over the ranks; "
        "rank 0 commits, and the bytes are those one process writes.",
    )
    _inputs(m)
    m.add_argument(
        "out",
        metavar="OUT",
        help="output folder (created; replaced only with --overwrite), or one GGUF file: a path ending in .gguf",
    )
    _merge_options(m)
    m.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT once the new one is complete")
    _verbosity(m)


def _push_parser(sub) -> None:
    """The ``push`` command: ``merge``'s options, the merge pushed to a Hub repository as it is made."""
    m = sub.add_parser(
        "push",
        usage="peft-shardmerge push [-h] [options] [BASE] ADAPTER REPO_ID",
        help="merge a base checkpoint and a LoRA adapter and push the result to a Hub repository, in one commit",
        description="Merge BASE + ADAPTER and push it to REPO_ID on the Hub: each shard is uploaded by content as "
        "soon as it is written and deleted here (at most two shards on the local disk), then one commit adds every "
        "file. The token comes from HF_TOKEN or `hf auth login`. Killed, a rerun neither merges nor uploads the "
        "shards already uploaded (docs/hub.md). With --outtype, one GGUF file is pushed.",
    )
    _inputs(m)
    m.add_argument("out", metavar="REPO_ID", help="the Hub repository: user/name, or name in the token owner's")
    _merge_options(m)
    g = m.add_argument_group("the Hub")
    g.add_argument(
        "--staging",
        metavar="DIR",
        default=None,
        help="where shards wait for their upload (default: the system's temporary folder)",
    )
    g.add_argument("--private", action="store_true", default=None, help="create the repository private")
    g.add_argument("--revision", metavar="R", default=None, help="the branch to push to (made if missing)")
    g.add_argument("--commit-message", metavar="M", default=None, help="the commit's title")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="delete, in the same commit, the repository's weight files this push does not write (an earlier "
        "push's other shards); without it such a repository is refused before anything is merged",
    )
    _verbosity(m)


def _inputs(m: argparse.ArgumentParser) -> None:
    """BASE and ADAPTER, as ``merge`` and ``push`` take them."""
    m.add_argument(
        "base",
        metavar="BASE",
        help="base checkpoint folder, or a Hub id in the local cache; left out (ADAPTER alone), the base the "
        "adapter names (base_model_name_or_path in its adapter_config.json)",
    )
    m.add_argument(
        "adapter", metavar="ADAPTER", nargs="?", help="PEFT LoRA adapter folder, or a Hub id in the local cache"
    )


def _verbosity(m: argparse.ArgumentParser) -> None:
    verbosity = m.add_mutually_exclusive_group()
    verbosity.add_argument("-q", "--quiet", action="store_true", help="errors and warnings only, no progress bar")
    verbosity.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _merge_options(m: argparse.ArgumentParser) -> None:
    """The options ``merge`` and ``push`` share: what is merged, how, and what is written."""
    _combination_arguments(m)
    m.add_argument(
        "--dtype",
        type=_dtype_arg,
        default=None,
        metavar="{bfloat16,float16,float32,auto}",
        help="dtype written (bf16, fp16, fp32 too; default or 'auto': the base's)",
    )
    m.add_argument("--max-shard-size", default="5GB", help="largest output shard, e.g. 5GB, 500MB (default 5GB)")
    m.add_argument(
        "--outtype",
        type=str.lower,
        choices=OUTTYPES,
        default=None,
        metavar="{auto,f16,bf16,q8_0,q4_k_m,...}",
        help=f"GGUF type of an OUT ending in .gguf: {', '.join(OUTTYPES)} (default auto: the base's 16-bit type; "
        "docs/gguf.md)",
    )
    m.add_argument(
        "--quantize",
        type=str.lower,
        default=None,
        metavar="{" + ",".join(NAMES) + "}",
        help="write the weights in a served format, quantized once from the float32 merge as its own tool does: "
        "fp8-block, ct-fp8-block, ct-w4a16 (vLLM), nf4, fp4, int8, base (the base's own); docs/quantized.md",
    )
    m.add_argument(
        "--split-max-size",
        default="0",
        help="split a GGUF OUT into files of at most this many bytes of tensors, e.g. 2G (K, M, G: powers of "
        "1000), named OUT-00001-of-0000N.gguf as llama.cpp splits them (default 0: one file)",
    )
    m.add_argument(
        "--base-precision",
        choices=["auto", "original", "nf4"],
        default="auto",
        help="auto (default): reproduce the trained model, i.e. nf4 where the adapter's files show a 4-bit "
        "base, else original; original: the checkpoint's weights; nf4: dequant(nf4(W)), the weights "
        "a QLoRA adapter was trained against",
    )
    m.add_argument(
        "--nf4-quant-type",
        choices=["nf4", "fp4"],
        default="nf4",
        help="4-bit type used in training (with --base-precision nf4)",
    )
    m.add_argument("--nf4-blocksize", type=int, default=64, help="4-bit block size used in training (default 64)")
    m.add_argument(
        "--no-nf4-double-quant",
        dest="nf4_double_quant",
        action="store_false",
        help="training did not use double quantization",
    )
    m.add_argument(
        "--device",
        choices=["cpu", "cuda", "auto"],
        default="auto",
        help="where the maths runs (under torchrun, cuda is each rank's own GPU: cuda:LOCAL_RANK)",
    )
    m.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="tensors merged at once, each on its own thread (default: one per CPU, at most 8; same bytes)",
    )
    m.add_argument(
        "--model-checks",
        choices=["auto", "first", "beside"],
        default="auto",
        help="build the model class and run PEFT's load check first, or in a second process beside the merge "
        "(compared before the commit); auto: beside on two CPUs or more, outside torchrun (same bytes)",
    )
    m.add_argument("--dry-run", action="store_true", help="print the plan and exit; read no tensor data")


def _verify_parser(sub) -> None:
    """The ``verify`` command and its options."""
    v = sub.add_parser(
        "verify",
        help="check a merged checkpoint (every byte against its merge record; with --base/--adapter, every tensor "
        "recomputed and the logits)",
        description="Check OUT: every byte against the SHA-256 digests in merge_manifest.json, headers, index, "
        "format metadata, no NaN/Inf, names and shapes, config consistency; with --base and --adapter, "
        "every tensor recomputed from base + adapter and the logits. Exit 0 OK, 1 FAILED, 3 UNCHECKED "
        "(no merge record and no --base/--adapter), 2 OUT is not a checkpoint.",
    )
    v.add_argument("out", metavar="OUT", help="the merged checkpoint folder, or a GGUF file a merge wrote")
    v.add_argument("--base", help="the base checkpoint the merge came from")
    v.add_argument(
        "--adapter",
        action="append",
        help="the adapter that was merged (repeat it, in order, for a combination of several)",
    )
    v.add_argument("--prompts", help="a text file, one prompt a line, to compare logits on (default: random ids)")
    v.add_argument("--tolerance", type=float, help="largest accepted relative logits error")


def main(argv: list[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        0 on success, 2 for a user error or a filesystem failure such as a full disk (message, no traceback),
        130 when interrupted (Ctrl-C), 143 on SIGTERM.

    Raises:
        SystemExit: from argparse, for ``--help``, ``--version`` or unparsable arguments (status 2).
        Exception: an unexpected failure (a bug) propagates with its traceback.
    """
    global _out
    parser = build_parser()
    args = parser.parse_args(argv)
    _out = getattr(args, "out", None) if args.command in ("merge", "push") else None
    if args.command == "push":
        _out = PUSH_PREFIX + args.out
    if args.command is None:  # bare `peft-shardmerge`: say what it does rather than fail on a missing argument
        parser.print_help()
        return 0
    if args.command == "verify":
        return _verify(args, parser)
    collecting = gc.isenabled()
    gc.disable()  # a merge makes no cyclic garbage per tensor: the collector would only walk the imports' objects
    try:
        return _merge(args)
    finally:
        if collecting and not _exiting:  # the command exits without collecting (a finalizer may meet a signal)
            gc.enable()


def _merge(args: argparse.Namespace) -> int:
    """The ``merge`` command: :func:`~peft_shardmerge.api.disk.merge_checkpoint` with the arguments, its summary
    printed; the status as :func:`main` returns it. The cyclic garbage collector is off meanwhile (for the whole
    process: :func:`main` called from Python turns it back on when it returns): importing torch (transformers and
    PEFT too where the checks come first) makes hundreds of thousands of objects, none of them garbage, which the
    collector's passes would walk again and again (docs/benchmarks.md, "Without the cyclic garbage collector"); a merge
    leaves a few hundred unreachable objects, however many tensors and shards it writes
    (``tests/unit/engine/test_pipeline.py``)."""
    rank = _rank()
    level = (
        logging.WARNING
        if args.quiet or (rank and not args.verbose)
        else logging.DEBUG
        if args.verbose
        else logging.INFO
    )
    _log_to_stderr(level, rank, args.verbose)
    if not args.verbose:
        for noisy in NOISY:
            logging.getLogger(noisy).setLevel(logging.ERROR)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        from ..output.files import held_signals

        if args.adapter is None:  # merge ADAPTER OUT: the base is the one the adapter names
            from ..checkpoint.trained_base import base_named_by

            args.adapter, args.base = args.base, base_named_by(args.base)
            logging.getLogger(__name__).info(
                "base: %s (base_model_name_or_path in the adapter's adapter_config.json)", args.base
            )
        adapters = [args.adapter, *args.add_adapter]

        options = dict(
            weights=args.weights,
            combination=args.combination,
            density=args.density,
            majority_sign=args.majority_sign,
            normalize=args.normalize,
            seed=args.seed,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            outtype=args.outtype,
            split_max_size=args.split_max_size,
            quantize=args.quantize,
            base_precision=args.base_precision,
            nf4_quant_type=args.nf4_quant_type,
            nf4_blocksize=args.nf4_blocksize,
            nf4_double_quant=args.nf4_double_quant,
            device=args.device,
            workers=args.workers,
            model_checks=args.model_checks,
            overwrite=getattr(args, "overwrite", False),
            progress=not args.quiet and not rank,
        )
        out, hub = args.out, {}
        if args.command == "push":
            out, hub = (
                None,
                dict(
                    push_to_hub=args.out,
                    private=args.private,
                    revision=args.revision,
                    commit_message=args.commit_message,
                    staging=args.staging,
                ),
            )
        if rank is None and checks_beside(args.model_checks, distributed=False, dry_run=args.dry_run, out_dir=out):
            ChecksBeside.start_early((args.base, adapters), options)  # while this process imports torch

        with held_signals():  # Ctrl-C while torch loads would break the import; it is delivered once loaded
            from .disk import merge_checkpoint

        adapter = adapters[0] if len(adapters) == 1 else adapters
        report = merge_checkpoint(args.base, adapter, out, dry_run=args.dry_run, distributed=True, **options, **hub)
    except ShardMergeError as e:
        if not getattr(e, "said_by_rank_0", False):  # in a job, rank 0 says what every rank found, once
            print(f"{_who(rank)}: error: {command_line_text(str(e))}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return _stopped("interrupted", EXIT_INTERRUPTED)
    except Terminated:  # in a job, also the launcher stopping the other ranks after one failed: rank 0 says it
        return _stopped("terminated", EXIT_TERMINATED)
    except OSError as e:
        if not getattr(e, "said_by_rank_0", False):
            print(
                f"{_who(rank)}: error: {e.strerror or e} ({e.filename or 'output'}); {_out_state(_out or args.out)}",
                file=sys.stderr,
            )
        return EXIT_USER_ERROR
    if (args.dry_run or not args.quiet) and not rank:  # a dry run's plan is its output; -q silences the summary
        _print(report.summary())
    return 0


class _CommandLineFormatter(logging.Formatter):
    """Log records as the command line says things: ``peft-shardmerge: warning: ...`` (a record of ours at INFO
    without a level), options named by their flags; with ``-v``, each record's level and logger too."""

    def __init__(self, rank: int | None, verbose: bool):
        super().__init__()
        self.who, self.verbose = _who(rank), verbose

    def format(self, record: logging.LogRecord) -> str:
        text = command_line_text(super().format(record))
        if self.verbose:
            return f"{record.levelname} {record.name}: {text}"
        level = "" if record.levelno == logging.INFO else record.levelname.lower()
        if not record.name.startswith("peft_shardmerge"):  # another library's record: say whose
            level = f"{level or 'info'} ({record.name})"
        return f"{self.who}: {level}: {text}" if level else f"{self.who}: {text}"


def _log_to_stderr(level: int, rank: int | None, verbose: bool) -> None:
    """Log records to stderr, formatted by :class:`_CommandLineFormatter`, at ``level``."""
    handler = logging.StreamHandler()
    handler.setFormatter(_CommandLineFormatter(rank, verbose))
    logging.basicConfig(level=level, handlers=[handler])


def run() -> None:
    """The ``peft-shardmerge`` command and ``python -m peft_shardmerge``: :func:`main`, then exit with its status.

    A process of a distributed job (``WORLD_SIZE`` above 1) leaves at once (``os._exit``) once its output is
    flushed: torch's process-group machinery can abort at interpreter shutdown ("terminate called without an
    active exception", seen in about 1 of 10 three-rank runs on a busy machine, after ``destroy_process_group``),
    which would turn a finished merge into a failed job.

    Returns:
        Never.

    Raises:
        SystemExit: with :func:`main`'s status.
    """
    global _exiting
    _exiting = True
    try:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # from here, Ctrl-C is a KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.default_int_handler)
        code = main()
        _ignore_signals()  # the outcome is known and said: a signal now could only print a traceback
    except KeyboardInterrupt:  # before or after the steps main answers itself (arguments, logging, exit)
        code = _stopped("interrupted", EXIT_INTERRUPTED)
    except Terminated:
        code = _stopped("terminated", EXIT_TERMINATED)
    if _rank() is None:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


#: OUT of the merge this process runs, once its arguments are parsed (what an interrupt then says became of it)
_out: str | None = None


#: set by :func:`run`: the process exits once :func:`main` returns (main leaves the garbage collector off)
_exiting = False


def _ignore_signals() -> None:
    """Ctrl-C and SIGTERM ignored from now on: the command is stopping, and says so once."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def _stopped(what: str, code: int) -> int:
    """A stop: one line (rank 0's alone in a distributed job, where the launcher's SIGTERM to the other ranks after
    one failed is no news), further signals ignored meanwhile, and ``code``."""
    _ignore_signals()
    if not _rank():
        state = _out_state(_out) if _out is not None else "nothing was written and OUT is unchanged"
        print(f"{_who(_rank())}: {what}; {state}", file=sys.stderr)
    return code


def _rank() -> int | None:
    """This process's rank in a job a launcher started (``RANK``, with ``WORLD_SIZE`` above 1); None outside one."""
    try:
        return int(os.environ.get("RANK", 0)) if int(os.environ.get("WORLD_SIZE", 1)) > 1 else None
    except ValueError:
        return None


def _who(rank: int | None) -> str:
    """The name messages start with: the program, and the rank in a distributed job."""
    return "peft-shardmerge" if rank is None else f"peft-shardmerge[rank {rank}]"


def _print(text: str) -> None:
    """Print to stdout; a reader that stopped early (``| head``) ends the output quietly, not with a traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit


#: how :data:`_out` names a push's repository
PUSH_PREFIX = "hf://"


def _out_state(out: str) -> str:
    """What became of OUT (``staging.outcome``); nothing was written when the staging module was never loaded; for a
    push, what became of the repository."""
    if out.startswith(PUSH_PREFIX):
        return (
            f"nothing was committed to {out[len(PUSH_PREFIX) :]}; the same command run again neither merges nor "
            "uploads the shards the Hub already has"
        )
    staging = sys.modules.get("peft_shardmerge.output.staging")
    return staging.outcome(out) if staging is not None else "nothing was written and OUT is unchanged"


def _dtype_arg(value: str) -> str | None:
    """``--dtype``: the names the Python API accepts (``bf16``, ``torch.bfloat16``, ...); ``auto`` is the default."""
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    name = aliases.get(value.lower().removeprefix("torch."), value.lower().removeprefix("torch."))
    if name == "auto":
        return None
    if name not in ("bfloat16", "float16", "float32"):
        raise argparse.ArgumentTypeError(
            f"invalid choice: {value!r} (choose from bfloat16, float16, float32, or bf16, fp16, fp32, auto)"
        )
    return name


def _verify(args, parser) -> int:
    _log_to_stderr(logging.WARNING, None, verbose=False)
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if (args.base is None) != (args.adapter is None):
        parser.error("--base and --adapter go together")
    from ..verify.report import verify_checkpoint

    prompts = None
    try:
        if args.prompts:
            with open(args.prompts, encoding="utf-8") as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()]
        if args.out.lower().endswith(".gguf"):
            from ..verify.gguf_check import verify_gguf

            report = verify_gguf(args.out, base=args.base, adapter=args.adapter)
        else:
            report = verify_checkpoint(
                args.out, base=args.base, adapter=args.adapter, prompts=prompts, tolerance=args.tolerance
            )
    except (ShardMergeError, OSError) as e:
        print(f"peft-shardmerge: error: {command_line_text(str(e))}", file=sys.stderr)
        return EXIT_USER_ERROR
    _print(report.summary())
    return report.exit_code  # 0 OK, 1 FAILED, 3 UNCHECKED (no merge record and no --base/--adapter)


#: the Python spellings of options in the library's messages, and the flags the command line takes instead
FLAGS = {
    "overwrite=True": "--overwrite",
    "device='cpu' or 'auto'": "--device cpu or auto",
    "normalize=False": "--no-normalize",
}


def command_line_text(message: str) -> str:
    """A library message as the command line says it: options named by their flags, not their Python keywords.

    Args:
        message: the error text.

    Returns:
        The text with each Python spelling of :data:`FLAGS` replaced by its flag.

    Example:
        >>> command_line_text("output folder m is not empty; pass overwrite=True to replace it")
        'output folder m is not empty; pass --overwrite to replace it'
    """
    for python, flag in FLAGS.items():
        message = message.replace(python, flag)
    return message


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
