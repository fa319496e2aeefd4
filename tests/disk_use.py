"""The most disk a folder takes while something runs: its files' allocated bytes, sampled on a thread (the push's
tests and its benchmark)."""

from __future__ import annotations

import os
import threading
import time


class DiskSampler:
    """The bytes allocated to the files under a folder (``st_blocks``: a preallocated file counts whole), sampled every
    ``interval`` seconds while the block runs; ``peak`` is the largest sample, ``samples`` how many were taken.

    Args:
        folder: the folder (it may appear and go while sampled).
        interval: seconds between samples.
    """

    def __init__(self, folder: str, interval: float = 0.002):
        self.folder, self.interval, self.peak, self.samples = folder, interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for root, _, files in os.walk(self.folder):
                for name in files:
                    try:
                        total += os.lstat(os.path.join(root, name)).st_blocks * 512
                    except FileNotFoundError:  # uploaded and deleted meanwhile
                        pass
            self.peak, self.samples = max(self.peak, total), self.samples + 1
            time.sleep(self.interval)

    def __enter__(self) -> "DiskSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
