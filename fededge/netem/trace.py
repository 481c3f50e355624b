"""Mahimahi link traces: when a link can deliver bytes.

Format (Mahimahi's ``mm-link``): one line per delivery opportunity of one 1500-byte
packet, the line holding the millisecond at which it occurs (non-decreasing integers;
several equal lines are several packets in the same millisecond). The trace repeats with
a period equal to its last timestamp. Mahimahi's own traces are GPL-3+; fededge reads
the format but ships none (Debian's ``mahimahi-traces`` package has them).

A transfer of ``n`` bytes that starts at time ``t`` needs ``ceil(n / 1500)``
opportunities at or after ``t``; it has left the link at the last one. Pure: no I/O
beyond reading the file.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DeliveryTrace", "TraceError", "PACKET_BYTES"]

PACKET_BYTES = 1500


class TraceError(ValueError):
    """A trace file is malformed; the message names the file and the line."""


@dataclass(frozen=True)
class DeliveryTrace:
    """Delivery opportunities in ms within one period (sorted), and the period in ms."""

    opportunities_ms: tuple[int, ...]
    period_ms: int
    name: str = "trace"

    def __post_init__(self) -> None:
        if not self.opportunities_ms:
            raise TraceError(f"{self.name}: a trace needs at least one delivery opportunity")
        if self.period_ms <= 0:
            raise TraceError(f"{self.name}: the last timestamp (the period) must be > 0 ms")

    @classmethod
    def from_file(cls, path: str | Path) -> "DeliveryTrace":
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as err:
            raise TraceError(f"trace file {str(p)!r} cannot be read: {err}") from None
        return cls.parse(text, name=str(p))

    @classmethod
    def parse(cls, text: str, *, name: str = "trace") -> "DeliveryTrace":
        stamps: list[int] = []
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line:
                continue
            try:
                ms = int(line)
            except ValueError:
                raise TraceError(f"{name}:{lineno}: expected an integer millisecond, got {line!r}") from None
            if ms < 0:
                raise TraceError(f"{name}:{lineno}: timestamps must be >= 0, got {ms}")
            if stamps and ms < stamps[-1]:
                raise TraceError(f"{name}:{lineno}: timestamps must not decrease ({ms} after {stamps[-1]})")
            stamps.append(ms)
        if not stamps:
            raise TraceError(f"{name}: empty trace")
        return cls(tuple(stamps), stamps[-1], name)

    @property
    def mean_rate_bps(self) -> float:
        """Average capacity: packets per period."""
        return len(self.opportunities_ms) * PACKET_BYTES * 8 / (self.period_ms / 1000.0)

    def first_index_at_or_after(self, t_s: float) -> int:
        """Absolute index (over all repetitions) of the first opportunity at or after ``t_s``."""
        ops, period = self.opportunities_ms, self.period_ms
        t_ms = t_s * 1000.0
        cycle = math.floor(t_ms / period)
        i = bisect.bisect_left(ops, t_ms - cycle * period)
        return cycle * len(ops) + i  # i == len(ops) rolls over into the next cycle

    def time_of(self, index: int) -> float:
        """Time (s) of the opportunity with absolute index ``index``."""
        cycle, i = divmod(index, len(self.opportunities_ms))
        return (cycle * self.period_ms + self.opportunities_ms[i]) / 1000.0

    def nth_opportunity_s(self, start_s: float, n: int) -> float:
        """Time (s) of the ``n``-th opportunity (1-based) at or after ``start_s``."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return self.time_of(self.first_index_at_or_after(start_s) + n - 1)

    def departure_s(self, start_s: float, nbytes: int) -> float:
        """When the last byte of ``nbytes`` sent at ``start_s`` has left an idle link."""
        if nbytes <= 0:
            return start_s
        return self.nth_opportunity_s(start_s, math.ceil(nbytes / PACKET_BYTES))
