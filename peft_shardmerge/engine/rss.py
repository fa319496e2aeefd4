"""A merge's own peak resident memory, sampled while it runs (the process's lifetime high-water mark is left alone)."""

from __future__ import annotations

import os
import resource
import sys
import threading
import weakref

#: seconds between two readings of the resident memory
SAMPLE_INTERVAL = 0.05

#: how each way of measuring is named in the report
SAMPLED = f"sampling the resident memory every {SAMPLE_INTERVAL * 1000:.0f} ms during the merge"
LIFETIME = "the process's lifetime high-water mark (ru_maxrss): it includes what the process held before the merge"


def current_rss_bytes() -> int:
    """The process's resident set size now, in bytes (from ``/proc/self/statm``; 0 where unavailable).

    Returns:
        Bytes.

    Example:
        >>> current_rss_bytes() >= 0
        True
    """
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def lifetime_peak_rss_bytes() -> int:
    """The process's peak resident set size since it started.

    Returns:
        Bytes (``ru_maxrss`` is KiB on Linux, bytes on macOS).

    Example:
        >>> lifetime_peak_rss_bytes() > 0
        True
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _sample(meter: weakref.ref[PeakRss], done: threading.Event, interval: float) -> None:
    """Keep the highest resident memory read every ``interval`` seconds, until stopped or the meter is dropped (a merge
    that failed never stops it)."""
    while not done.wait(interval):
        m = meter()
        if m is None:
            return
        m.peak = max(m.peak, current_rss_bytes())
        del m


class PeakRss:
    """The peak resident memory of this process between :meth:`start` and :meth:`stop`, and how it was measured.

    A thread reads the resident memory every :data:`SAMPLE_INTERVAL` seconds (and once more at :meth:`stop`). The
    kernel's high-water mark could be reset instead (``/proc/self/clear_refs``), but that would also reset the
    process's ``ru_maxrss``, which a caller (or ``/usr/bin/time``) may be reading: a library leaves it alone.

    Attributes:
        baseline: the resident bytes when measuring started.
        peak: the peak resident bytes (set by :meth:`stop`).
        method: how ``peak`` was measured (:data:`SAMPLED`, or :data:`LIFETIME` without ``/proc``).

    Example:
        >>> import time
        >>> meter = PeakRss(interval=0.01).start()
        >>> block = bytearray(64 << 20)   # 64 MiB of zeros, every page written
        >>> time.sleep(0.2)
        >>> del block
        >>> meter.stop() - meter.baseline >= 60 << 20
        True
    """

    def __init__(self, interval: float = SAMPLE_INTERVAL) -> None:
        self.interval = interval
        self.baseline = 0
        self.peak = 0
        self.method = ""
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeakRss:
        """Begin measuring: start the sampling thread.

        Returns:
            ``self``.

        Example:
            >>> PeakRss().start().stop() > 0
            True
        """
        self.baseline = current_rss_bytes()
        self.peak = self.baseline
        if self.baseline:
            self.method = SAMPLED
            self._thread = threading.Thread(
                target=_sample,
                args=(weakref.ref(self), self._done, self.interval),
                name="peft-shardmerge-rss",
                daemon=True,
            )
            self._thread.start()
        else:  # no /proc: the lifetime mark is all there is
            self.method = LIFETIME
        return self

    def stop(self) -> int:
        """End measuring.

        Returns:
            The peak resident bytes since :meth:`start` (also kept in ``peak``).

        Example:
            >>> meter = PeakRss().start(); meter.stop() >= meter.baseline > 0
            True
        """
        if self.method == SAMPLED:
            self._done.set()
            if self._thread is not None:
                self._thread.join()
            self.peak = max(self.peak, current_rss_bytes())
        else:
            self.peak = lifetime_peak_rss_bytes()
        return self.peak
