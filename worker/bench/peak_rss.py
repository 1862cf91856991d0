"""Peak resident memory of a process tree, sampled in a thread: what a bench reports beside its rates."""

from __future__ import annotations

import threading

import psutil

MB = 1024 * 1024


class PeakRSS:
    """Samples the RSS of a process and its children in a thread; keeps the peak of their sum."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.process = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                tree = [self.process, *self.process.children(recursive=True)]
                self.peak_bytes = max(self.peak_bytes, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                return

    def peak_mb(self) -> float:
        self.stop.set()
        self.thread.join(5)
        return round(self.peak_bytes / MB, 1)
