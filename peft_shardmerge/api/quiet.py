"""Our own output only: what transformers, PEFT, bitsandbytes, accelerate, huggingface_hub and DeepSpeed print while
a merge imports or calls them (warnings, log records under ERROR, progress bars) is held back for that call, and the
user's settings are put back after it. With debug logging on (the command line's ``-v``) nothing is held back."""

from __future__ import annotations

import importlib
import logging
import sys
import threading
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
def quiet_libraries(transformers: bool = True) -> Iterator[None]:
    """Hold back the libraries' own messages for the duration of a merge, then restore every setting as it was.

    Warnings raised in the libraries' modules are ignored; their loggers pass only errors (DeepSpeed's too: its
    "Setting accelerator to CPU" when transformers' ``save_pretrained`` imports it); transformers' and
    huggingface_hub's progress bars ("Loading weights") are off. Our own log records, warnings and progress bar are
    untouched. When the ``peft_shardmerge`` logger is enabled for DEBUG (``peft-shardmerge -v``), nothing is held
    back.

    Blocks nest, and blocks of several threads overlap: the first to open holds the libraries back, the last to
    close puts every setting back. transformers, whose first import sets its logger's level, is held back when a
    block opens or closes after that import (the level its import set is then the one put back).

    Args:
        transformers: import transformers (half a second) and hold it back; False leaves it unimported, for a merge
            from disk whose model-class checks run beside it (the steps that may import it open a block inside).

    Returns:
        A context manager.

    Example:
        >>> with quiet_libraries():
        ...     pass
    """
    if logging.getLogger("peft_shardmerge").isEnabledFor(logging.DEBUG):
        yield
        return
    with _LOCK:
        if not _OPEN:
            _OPEN.append(_held_back())
        _OPEN.append(None)  # one entry per open block, after the settings of the first
        try:
            if transformers or "transformers.utils.logging" in sys.modules:
                _hold_back_transformers(_OPEN[0])
        except BaseException:
            _close()
            raise
    try:
        yield
    finally:
        with _LOCK:
            try:
                if "transformers.utils.logging" in sys.modules:  # imported in the block: held back until the end
                    _hold_back_transformers(_OPEN[0])
            finally:
                _close()


#: while a block is open: the settings the last to close puts back, then one entry per open block
_OPEN: list = []
_LOCK = threading.RLock()


def _held_back() -> dict:
    """Hold the libraries back; return what puts every setting back (``restore``) and transformers' own state."""
    stack = ExitStack()
    saved: dict = {"restore": stack, "levels": {}, "had_transformers": "transformers.utils.logging" in sys.modules}
    try:
        stack.enter_context(_warnings_ignored())
        stack.enter_context(_hub_bars_off())
        stack.callback(_restore_levels, saved)
        for name in LIBRARIES:
            logger = logging.getLogger(name)
            saved["levels"][name] = logger.level
            logger.setLevel(max(logger.getEffectiveLevel(), logging.ERROR))
        deepspeed, drop = logging.getLogger(DEEPSPEED_LOGGER), _DropBelowError()
        deepspeed.addFilter(drop)
        stack.callback(deepspeed.removeFilter, drop)
    except BaseException:
        stack.close()
        raise
    return saved


def _close() -> None:
    """One block closed; the last one puts every setting back."""
    _OPEN.pop()
    if len(_OPEN) == 1:
        _OPEN.pop()["restore"].close()


def _restore_levels(saved: dict) -> None:
    """The loggers' levels, and transformers' progress bars, as they were."""
    for name, level in saved["levels"].items():
        logging.getLogger(name).setLevel(level)
    if saved.get("bars"):
        sys.modules["transformers.utils.logging"].enable_progress_bar()


def _hold_back_transformers(saved: dict) -> None:
    """transformers' logger to errors and its progress bars off, once per outermost block. Its first import sets its
    logger's level: imported since the block began, that level is the one put back."""
    if "bars" in saved:
        return
    hf_logging = importlib.import_module("transformers.utils.logging")
    logger = logging.getLogger("transformers")
    if not saved["had_transformers"]:
        saved["levels"]["transformers"] = logger.level
    logger.setLevel(max(logger.getEffectiveLevel(), logging.ERROR))
    saved["bars"] = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()


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
def _hub_bars_off() -> Iterator[None]:
    """huggingface_hub's progress bars off, put back as they were."""
    hub_states = importlib.import_module("huggingface_hub.utils.tqdm").progress_bar_states  # the module, not the class
    saved = dict(hub_states)
    try:
        yield
    finally:
        hub_states.clear()
        hub_states.update(saved)
