"""The command's first instant: Ctrl-C and SIGTERM answered with one line until the command line has loaded.

The ``peft-shardmerge`` script and ``python -m peft_shardmerge`` import this module, nothing else.
"""

import os
import signal
import sys

EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


def _before_the_command(signum, frame):  # signal handler signature
    """Until the command line takes over: nothing was started, so one line and the status, with no traceback."""
    what = b"interrupted" if signum == signal.SIGINT else b"terminated"
    os.write(2, b"peft-shardmerge: " + what + b"; nothing was written and OUT is unchanged\n")
    os._exit(EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_TERMINATED)


def run() -> None:
    """The ``peft-shardmerge`` command: :func:`peft_shardmerge.api.cli.run`, loaded once this module answers
    Ctrl-C and SIGTERM itself (an interrupt while Python imports the command would print a traceback).

    Returns:
        Never.

    Raises:
        SystemExit: with the command's status.
    """
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # a signal the shell ignores for us (nohup) stays so
            signal.signal(signum, _before_the_command)
    from .cli import run as command

    command()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
