"""Memory of this process from ``/proc/self/status``: now, the resident peak, and sampled peaks of anonymous memory
(what a process allocates) over a stretch of code."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path


def status_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_rss_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


class Peaks:
    """Peaks of anonymous memory (``RssAnon``: what the process allocates) and of resident memory including mapped
    file pages (``RssAnon + RssFile``; file pages are the page cache, shared by every rank reading the same file),
    sampled every 2 ms while active, above what the process held before."""

    def __enter__(self) -> Peaks:
        import threading

        self._base = self._now()
        self.anon = self.resident = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _now() -> tuple[int, int]:
        anon = status_bytes("RssAnon")
        return anon, anon + status_bytes("RssFile")

    def held(self) -> int:
        """Anonymous memory now, above what the process held on entry."""
        return status_bytes("RssAnon") - self._base[0]

    def _sample(self) -> None:
        anon, resident = self._now()
        self.anon = max(self.anon, anon - self._base[0])
        self.resident = max(self.resident, resident - self._base[1])

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
