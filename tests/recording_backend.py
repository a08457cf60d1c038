"""A backend wrapper the read tests share: it says whether every range is in memory
(``resident``: which read path a load takes) and records every read (key, offset, bytes)."""

from __future__ import annotations

import threading

from bcp.backends.wrappers import FaultInjectingBackend


class Recording(FaultInjectingBackend):
    """Says whether every range is in memory; records every ``read_exact``."""

    def __init__(self, inner, resident: bool = True, latency: float = 0.0):
        super().__init__(inner, latency=latency)
        self.resident = resident
        self.reads: list[tuple[str, int, int]] = []
        self._reads_lock = threading.Lock()

    @property
    def data_reads(self) -> list[tuple[str, int, int]]:
        """The reads of data files (``*.bin``)."""
        return [r for r in self.reads if r[0].endswith(".bin")]

    def in_memory(self, key, offset, nbytes):
        return self.resident

    def read_exact(self, key, offset, buffer):
        with self._reads_lock:
            self.reads.append((key, offset, len(buffer)))
        return super().read_exact(key, offset, buffer)
