"""Our own output only: what transformers, PEFT, bitsandbytes, accelerate, huggingface_hub and DeepSpeed print while
a merge imports or calls them (warnings, log records under ERROR, progress bars) is held back for that call, and the
user's settings are put back after it. With debug logging on (the command line's ``-v``) nothing is held back."""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress

#: the libraries whose messages a merge holds back (their loggers, and the modules their warnings come from)
LIBRARIES = ("transformers", "peft", "bitsandbytes", "accelerate", "huggingface_hub", "deepspeed")
#: DeepSpeed's logger, which sets its own level when DeepSpeed is imported (a filter holds it back instead)
DEEPSPEED_LOGGER = "DeepSpeed"


class _DropBelowError(logging.Filter):
    """Drop the records under ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Hold back the libraries' own messages for the duration of a merge, then restore every setting as it was.

    Warnings raised in the libraries' modules are ignored; their loggers pass only errors (DeepSpeed's too: its
    "Setting accelerator to CPU" when transformers' ``save_pretrained`` imports it); transformers' and
    huggingface_hub's progress bars ("Loading weights") are off. Our own log records, warnings and progress bar are
    untouched. When the ``peft_shardmerge`` logger is enabled for DEBUG (``peft-shardmerge -v``), nothing is held
    back.

    Returns:
        A context manager.

    Example:
        >>> with quiet_libraries():
        ...     pass
    """
    if logging.getLogger("peft_shardmerge").isEnabledFor(logging.DEBUG):
        yield
        return
    with ExitStack() as stack:
        stack.enter_context(_warnings_ignored())
        stack.enter_context(_progress_bars_off())
        loggers = [logging.getLogger(name) for name in LIBRARIES]
        levels = [logger.level for logger in loggers]
        deepspeed, drop = logging.getLogger(DEEPSPEED_LOGGER), _DropBelowError()
        for logger in loggers:
            logger.setLevel(max(logger.getEffectiveLevel(), logging.ERROR))
        deepspeed.addFilter(drop)
        try:
            yield
        finally:
            deepspeed.removeFilter(drop)
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


@contextmanager
def _warnings_ignored() -> Iterator[None]:
    """The libraries' warnings ignored; the filters others add meanwhile (imports of numpy, scipy, torch do) kept."""
    warnings.filterwarnings("ignore", module=rf"({'|'.join(LIBRARIES)})(\.|$)")
    ours = warnings.filters[0]
    try:
        yield
    finally:
        with suppress(ValueError):
            warnings.filters.remove(ours)


@contextmanager
def _progress_bars_off() -> Iterator[None]:
    """transformers' and huggingface_hub's progress bars off, each put back as it was."""
    from transformers.utils import logging as hf_logging  # configured here, so that its logger keeps our level

    hub_states = importlib.import_module("huggingface_hub.utils.tqdm").progress_bar_states  # the module, not the class
    bars, saved = hf_logging.is_progress_bar_enabled(), dict(hub_states)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        hub_states.clear()
        hub_states.update(saved)
