"""Link profiles: one model of a network link for all three netem backends.

A :class:`LinkProfile` has two :class:`Direction` s, ``up`` (client -> server) and
``down`` (server -> client). Each has a one-way delay, a jitter, a packet loss rate
(with an optional mean burst length, for Gilbert–Elliott losses), a rate, and
optionally a Mahimahi delivery trace that replaces the rate. The simulated clock
(:mod:`fededge.netem.clock`), the userspace proxy (:mod:`fededge.netem.proxy`) and the
kernel backend (:mod:`fededge.netem.kernel`) all read this one definition.

Built-in profiles are in ``profiles.toml`` beside this module, each with its ``source``.
Users add their own with a TOML file of the same form (:func:`load_profiles`).

Pure: no Flower, no sockets, no root.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = [
    "Direction", "LinkProfile", "ProfileError", "builtin_profiles", "load_profiles",
    "get_profile", "parse_direction",
]


class ProfileError(ValueError):
    """A profile is malformed or unknown; the message names the profile and the field."""


_DIR_KEYS = {"rate-kbit", "delay-ms", "jitter-ms", "loss", "loss-burst", "trace"}
_PROFILE_KEYS = {"up", "down", "source", "description", "compute-speed"}
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


@dataclass(frozen=True, kw_only=True)
class Direction:
    """One direction of a link.

    Parameters
    ----------
    rate_bps : float or None
        Bottleneck rate in bit/s; ``None`` is unshaped.
    delay_s : float
        One-way propagation delay, seconds.
    jitter_s : float
        Standard deviation of the extra per-message (clock) or per-packet (kernel)
        delay, seconds. Packets are never reordered by it.
    loss : float
        Packet loss probability in [0, 1).
    loss_burst : float
        Mean number of consecutive packets lost, >= 1. 1 means independent losses;
        more means Gilbert–Elliott bursts with the same average ``loss``.
    trace : Path or None
        A Mahimahi delivery trace; when set it decides when bytes leave, and
        ``rate_bps`` only describes it.
    """

    rate_bps: float | None = None
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    loss_burst: float = 1.0
    trace: Path | None = None

    def __post_init__(self) -> None:
        if self.rate_bps is not None and not (self.rate_bps > 0 and math.isfinite(self.rate_bps)):
            raise ProfileError(f"rate must be > 0 (or absent for unshaped), got {self.rate_bps} bit/s")
        if not (self.delay_s >= 0 and math.isfinite(self.delay_s)):
            raise ProfileError(f"delay must be >= 0 ms, got {self.delay_s * 1000} ms")
        if not (self.jitter_s >= 0 and math.isfinite(self.jitter_s)):
            raise ProfileError(f"jitter must be >= 0 ms and finite, got {self.jitter_s * 1000} ms")
        if not 0 <= self.loss < 1:
            raise ProfileError(f"loss must be a fraction in [0, 1), got {self.loss}")
        if not (self.loss_burst >= 1 and math.isfinite(self.loss_burst)):
            raise ProfileError(f"loss-burst is a mean burst length in packets, >= 1; got {self.loss_burst}")
        most = self.loss_burst / (1.0 + self.loss_burst)
        if self.loss > most:
            # the Gilbert-Elliott chain's good -> bad probability would pass 1: the packet
            # that enters the bad state is never lost, so bursts of this mean length lose at most this
            raise ProfileError(f"loss {self.loss} cannot be had in bursts of {self.loss_burst:g} packets on average "
                               f"(at most loss-burst / (1 + loss-burst) = {most:.3g}); lower loss or raise loss-burst")

    @property
    def gilbert_elliott(self) -> tuple[float, float]:
        """(p, r): P(good -> bad) and P(bad -> good) per packet, all packets lost in bad.

        The stationary loss is p / (p + r) = ``loss`` and the mean burst is 1 / r =
        ``loss_burst``; ``loss_burst = 1`` gives independent (Bernoulli) losses.
        """
        if self.loss == 0:
            return 0.0, 1.0
        r = 1.0 / self.loss_burst
        p = self.loss * r / (1.0 - self.loss)
        return p, r


@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    """A named link: ``up`` is client -> server, ``down`` server -> client."""

    name: str
    up: Direction
    down: Direction
    source: str
    description: str = ""
    #: Compute-speed factor of the devices behind this link (a "phone-4g" profile can
    #: say 0.25); multiplied with the run config's ``compute-speed``. Simulated clock only.
    compute_speed: float = 1.0

    def __post_init__(self) -> None:
        if not self.compute_speed > 0:
            raise ProfileError(f"profile '{self.name}': compute-speed must be > 0, got {self.compute_speed}")

    @property
    def rtt_s(self) -> float:
        """Base round-trip time: one-way delay up plus down."""
        return self.up.delay_s + self.down.delay_s

    def to_row(self) -> dict[str, Any]:
        """Human figures, as ``fededge netem profiles`` shows them."""
        def rate(d: Direction) -> str:
            if d.trace is not None:
                return f"trace {d.trace.name}"
            return "unshaped" if d.rate_bps is None else _human_rate(d.rate_bps)

        return {
            "name": self.name, "down": rate(self.down), "up": rate(self.up),
            "rtt_ms": round(self.rtt_s * 1000, 2),
            "jitter_ms": round(max(self.up.jitter_s, self.down.jitter_s) * 1000, 2),
            "loss": max(self.up.loss, self.down.loss),
            "source": self.source,
        }


def _human_rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def parse_direction(raw: Mapping[str, Any], *, where: str, base_dir: Path | None = None) -> Direction:
    """A direction table (``rate-kbit``, ``delay-ms``, ...) -> :class:`Direction`."""
    unknown = set(raw) - _DIR_KEYS
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_DIR_KEYS)}")
    try:
        trace = raw.get("trace")
        trace_path = None
        if trace is not None:
            trace_path = Path(str(trace))
            if not trace_path.is_absolute() and base_dir is not None:
                trace_path = base_dir / trace_path
        rate = raw.get("rate-kbit")
        return Direction(
            rate_bps=None if rate is None else float(rate) * 1000.0,
            delay_s=float(raw.get("delay-ms", 0.0)) / 1000.0,
            jitter_s=float(raw.get("jitter-ms", 0.0)) / 1000.0,
            loss=float(raw.get("loss", 0.0)),
            loss_burst=float(raw.get("loss-burst", 1.0)),
            trace=trace_path,
        )
    except ProfileError as err:
        raise ProfileError(f"{where}: {err}") from None
    except (TypeError, ValueError) as err:
        raise ProfileError(f"{where}: {err}") from None


def _parse_profiles(doc: Mapping[str, Any], *, origin: str, base_dir: Path | None) -> dict[str, LinkProfile]:
    out: dict[str, LinkProfile] = {}
    for name, raw in doc.items():
        where = f"{origin}: profile '{name}'"
        if not isinstance(raw, Mapping):
            raise ProfileError(f"{where} must be a table with 'up', 'down' and 'source'")
        if not _NAME.match(name):
            raise ProfileError(f"{where}: names are lower-case letters, digits, '.', '_' and '-'")
        unknown = set(raw) - _PROFILE_KEYS
        if unknown:
            raise ProfileError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_PROFILE_KEYS)}")
        missing = [k for k in ("up", "down", "source") if k not in raw]
        if missing:
            raise ProfileError(f"{where} lacks {', '.join(missing)} (every profile must say where its numbers come from)")
        out[name] = LinkProfile(
            name=name,
            up=parse_direction(raw["up"], where=f"{where}.up", base_dir=base_dir),
            down=parse_direction(raw["down"], where=f"{where}.down", base_dir=base_dir),
            source=str(raw["source"]),
            description=str(raw.get("description", "")),
            compute_speed=float(raw.get("compute-speed", 1.0)),
        )
    return out


@lru_cache(maxsize=1)
def builtin_profiles() -> dict[str, LinkProfile]:
    """The built-in table (``profiles.toml`` in this package)."""
    text = resources.files("fededge.netem").joinpath("profiles.toml").read_text(encoding="utf-8")
    return _parse_profiles(tomllib.loads(text), origin="built-in profiles.toml", base_dir=None)


def load_profiles(path: str | Path | None = None) -> dict[str, LinkProfile]:
    """Built-in profiles, plus (and overridden by) those of a user TOML file.

    The file has the form of the built-in ``profiles.toml``: one ``[name]`` table per
    profile with ``up``, ``down`` and ``source``. Tables named ``assign`` and ``speed``
    belong to client assignment (:mod:`fededge.netem.assign`) and are skipped here.
    Relative trace paths are relative to the file.
    """
    profiles = dict(builtin_profiles())
    if path:
        p = Path(path)
        if not p.is_file():
            raise ProfileError(f"profiles file {str(p)!r} not found")
        try:
            doc = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ProfileError(f"profiles file {str(p)!r} is not valid TOML: {err}") from None
        doc = {k: v for k, v in doc.items() if k not in ("assign", "speed")}
        profiles.update(_parse_profiles(doc, origin=str(p), base_dir=p.parent))
    return profiles


def get_profile(name: str, profiles: Mapping[str, LinkProfile] | None = None) -> LinkProfile:
    """A profile by name, with the list of names when it is unknown."""
    table = builtin_profiles() if profiles is None else profiles
    if name not in table:
        raise ProfileError(f"unknown link profile {name!r}; known: {', '.join(sorted(table))}")
    return table[name]
