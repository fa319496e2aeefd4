"""Our own output only: what transformers, PEFT, bitsandbytes (and its kernels), accelerate, huggingface_hub and
DeepSpeed print while a merge imports or calls them (warnings, log records under ERROR, progress bars) is held back for
that call, and the user's settings are put back after it. With debug logging on (the command line's ``-v``) nothing is
held back."""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress

#: the libraries whose messages a merge holds back (their loggers, and the modules their warnings come from)
LIBRARIES = ("transformers", "peft", "bitsandbytes", "kernels", "accelerate", "huggingface_hub", "deepspeed", "gguf")
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
        held = _Held.open()
        try:
            if transformers or "transformers.utils.logging" in sys.modules:
                held.hold_transformers()
        except BaseException:
            held.close()
            raise
    try:
        yield
    finally:
        with _LOCK:
            try:
                if "transformers.utils.logging" in sys.modules:  # imported in the block: held back until the end
                    held.hold_transformers()
            finally:
                held.close()


_LOCK = threading.RLock()


class _Held:
    """The libraries held back while blocks are open, and what the last block to close puts back."""

    #: the one instance while a block is open
    current: "_Held | None" = None

    def __init__(self) -> None:
        self.blocks = 0
        self.levels: dict[str, int] = {}
        self.had_transformers = "transformers.utils.logging" in sys.modules
        self.bars: bool | None = None  # transformers' progress bars as they were, once it is held back
        self.restore = ExitStack()
        try:
            self.restore.enter_context(_warnings_ignored())
            self.restore.enter_context(_hub_bars_off())
            self.restore.callback(self._put_back)
            for name in LIBRARIES:
                logger = logging.getLogger(name)
                self.levels[name] = logger.level
                logger.setLevel(max(logger.getEffectiveLevel(), logging.ERROR))
            deepspeed, drop = logging.getLogger(DEEPSPEED_LOGGER), _DropBelowError()
            deepspeed.addFilter(drop)
            self.restore.callback(deepspeed.removeFilter, drop)
        except BaseException:
            self.restore.close()
            raise

    @classmethod
    def open(cls) -> "_Held":
        """One more block: the libraries held back by the first."""
        if cls.current is None:
            cls.current = cls()
        cls.current.blocks += 1
        return cls.current

    def close(self) -> None:
        """One block fewer: the last puts every setting back."""
        self.blocks -= 1
        if self.blocks == 0:
            _Held.current = None
            self.restore.close()

    def hold_transformers(self) -> None:
        """transformers' logger to errors and its progress bars off, once. Its first import sets its logger's level:
        imported since the first block opened, that level is the one put back."""
        if self.bars is not None:
            return
        hf_logging = importlib.import_module("transformers.utils.logging")
        logger = logging.getLogger("transformers")
        if not self.had_transformers:
            self.levels["transformers"] = logger.level
        logger.setLevel(max(logger.getEffectiveLevel(), logging.ERROR))
        self.bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()

    def _put_back(self) -> None:
        """The loggers' levels, and transformers' progress bars, as they were."""
        for name, level in self.levels.items():
            logging.getLogger(name).setLevel(level)
        if self.bars:
            sys.modules["transformers.utils.logging"].enable_progress_bar()


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
