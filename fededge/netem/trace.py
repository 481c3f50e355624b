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

__all__ = ["DeliveryTrace", "TraceError", "PACKET_BYTES", "first_slot_at_or_after"]

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
        return first_slot_at_or_after(self.opportunities_ms, self.period_ms, t_s * 1000.0)

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


def first_slot_at_or_after(ops: tuple[int, ...], period: int, t_ms: float) -> int:
    """Absolute index (over the trace's repetitions) of the first opportunity at or after
    ``t_ms`` of the trace's own time, ``ops`` its sorted millisecond stamps, ``period``
    its last one.

    Opportunities are whole milliseconds, so ``t_ms`` is first taken to its millisecond:
    the next transfer starts at the time of the last slot the previous one used, which
    comes back from seconds a hair above its millisecond (``2.007 * 1000`` is
    ``2007.0000000000002``) and skipped the rest of that millisecond's slots. A time on
    a period's boundary ``k * period`` is the last slot of cycle ``k - 1``.

    >>> first_slot_at_or_after((2007, 2007, 2007, 2007, 4000), 4000, 2.007 * 1000)
    0
    >>> first_slot_at_or_after((2, 5, 10), 10, 10.0)  # cycle 0's slot at 10 ms
    2
    """
    target = max(0, math.ceil(t_ms - 1e-6))
    cycle = max(0, (target - 1) // period)
    return cycle * len(ops) + bisect.bisect_left(ops, target - cycle * period)
