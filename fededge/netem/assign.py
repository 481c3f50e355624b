"""Which client gets which link profile and compute speed.

Run-config keys (read by the server):

- ``netem``: ``""`` (an ideal network: ``sim_s`` is compute time only); a profile name
  for every client (``"4g"``); a seeded mix by fractions (``"wifi:0.5,4g:0.3,3g:0.2"``,
  exact counts by largest remainder, then a seeded shuffle over partition ids); or
  ``"file"`` to take the ``[assign]`` table of ``netem-file``.
- ``netem-file``: a TOML file with extra profiles (``[name]`` tables as in the built-in
  ``profiles.toml``), an optional ``[assign]`` table mapping partition ids to profile
  names (``0 = "4g"``, ``default = "wifi"``) and an optional ``[speed]`` table mapping
  partition ids to compute-speed factors (``default`` too).
- ``compute-speed``: ``"1.0"`` (all the same), ``"lognormal:0.5"`` (``exp(N(0, 0.5^2))``
  per client, seeded: heterogeneous devices), or ``"file"`` (the ``[speed]`` table).

A speed factor of 2 is a device twice as fast as the machine that measured the compute.
A profile may carry its own ``compute-speed`` (slow phones behind ``4g``); a client's
factor is the profile's times the run config's.

Pure: no Flower.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from fededge.netem.clock import ClientLink
from fededge.netem.profiles import LinkProfile, ProfileError, get_profile, load_profiles

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["assign_links", "check_netem_spec", "check_speed_spec", "dropped_partitions"]

_MIX_ITEM = re.compile(r"^([a-z0-9][a-z0-9._-]*):([0-9.]+(?:e-?[0-9]+)?)$")


def check_netem_spec(spec: str) -> None:
    """Syntax only (profile names are checked when the server resolves them)."""
    if spec in ("", "file") or ":" not in spec:
        if spec and not re.match(r"^[a-z0-9][a-z0-9._-]*$", spec):
            raise ProfileError(f"{spec!r} is not a profile name, a mix 'a:0.5,b:0.5' or 'file'")
        return
    total = 0.0
    for item in spec.split(","):
        m = _MIX_ITEM.match(item.strip())
        if not m:
            raise ProfileError(f"mix item {item!r} must be 'profile:fraction', e.g. 'wifi:0.5'")
        total += float(m.group(2))
    if abs(total - 1.0) > 1e-6:
        raise ProfileError(f"mix fractions must sum to 1, got {total:g} in {spec!r}")


def check_speed_spec(spec: str) -> None:
    if spec == "file":
        return
    if spec.startswith("lognormal:"):
        try:
            sigma = float(spec.split(":", 1)[1])
        except ValueError:
            sigma = -1.0
        if not sigma >= 0:
            raise ProfileError(f"'lognormal:SIGMA' needs SIGMA >= 0, got {spec!r}")
        return
    try:
        value = float(spec)
    except ValueError:
        raise ProfileError(f"must be a number, 'lognormal:SIGMA' or 'file', got {spec!r}") from None
    if not value > 0:
        raise ProfileError(f"must be > 0, got {spec!r}")


def _read_file_tables(path: str) -> dict[str, Any]:
    if not path:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"netem-file {path!r} not found")
    return tomllib.loads(p.read_text(encoding="utf-8"))


def _per_client(table: Mapping[str, Any], num_clients: int, *, what: str) -> list[Any]:
    out = []
    for i in range(num_clients):
        if str(i) in table:
            out.append(table[str(i)])
        elif "default" in table:
            out.append(table["default"])
        else:
            raise ProfileError(f"netem-file [{what}] has no entry for partition {i} and no 'default'")
    return out


def _mix(spec: str, num_clients: int, rng: np.random.Generator) -> list[str]:
    items = [(m.group(1), float(m.group(2))) for m in (_MIX_ITEM.match(s.strip()) for s in spec.split(",")) if m]
    quotas = [f * num_clients for _, f in items]
    counts = [math.floor(q) for q in quotas]
    order = sorted(range(len(items)), key=lambda i: quotas[i] - counts[i], reverse=True)
    for i in order[: num_clients - sum(counts)]:
        counts[i] += 1
    names = [name for (name, _), c in zip(items, counts) for _ in range(c)]
    return [names[i] for i in rng.permutation(num_clients)]


def assign_links(
    spec: str, num_clients: int, *, seed: int = 0, netem_file: str = "", speed: str = "1.0",
    message_overhead_s: float = 0.0, pulls: bool = False,
) -> list[ClientLink]:
    """The :class:`ClientLink` of every partition id ``0 .. num_clients-1``.

    ``message_overhead_s``: every device's fixed seconds per message beyond its measured
    compute (:class:`~fededge.netem.clock.ClientLink`; measured by
    ``benchmarks/bench_deploy_overhead.py``, cold or warm). ``pulls``: every device pulls
    its next message only after it has sent its reply, as a Flower SuperNode does.
    """
    check_netem_spec(spec)
    check_speed_spec(speed)
    profiles: dict[str, LinkProfile] = load_profiles(netem_file or None)
    tables = _read_file_tables(netem_file)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x6E65]))  # "ne"
    if spec == "":
        names: list[str | None] = [None] * num_clients
    elif spec == "file":
        if "assign" not in tables:
            raise ProfileError("netem='file' needs an [assign] table in netem-file")
        names = [str(v) for v in _per_client(tables["assign"], num_clients, what="assign")]
    elif ":" in spec:
        names = list(_mix(spec, num_clients, rng))
    else:
        names = [spec] * num_clients
    links = [None if n is None else get_profile(n, profiles) for n in names]

    if speed == "file":
        if "speed" not in tables:
            raise ProfileError("compute-speed='file' needs a [speed] table in netem-file")
        speeds = [float(v) for v in _per_client(tables["speed"], num_clients, what="speed")]
    elif speed.startswith("lognormal:"):
        sigma = float(speed.split(":", 1)[1])
        srng = np.random.default_rng(np.random.SeedSequence([seed, 0x7370]))  # "sp"
        speeds = [float(v) for v in np.exp(srng.normal(0.0, sigma, num_clients))]
    else:
        speeds = [float(speed)] * num_clients
    return [ClientLink(profile=p, speed=s * (p.compute_speed if p is not None else 1.0),
                       message_overhead_s=message_overhead_s, pulls=pulls)
            for p, s in zip(links, speeds)]


def dropped_partitions(num_clients: int, fraction: float, *, seed: int = 0) -> frozenset[int]:
    """The partition ids that never answer under ``dropout = fraction`` (seeded).

    ``round(fraction * num_clients)`` of them, drawn by a seeded permutation: the same
    set on the server and on every client, whatever the runtime.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"dropout must be in [0, 1), got {fraction}")
    if num_clients < 1 or fraction == 0:
        return frozenset()
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x6470]))  # "dp"
    k = int(round(fraction * num_clients))
    return frozenset(int(i) for i in rng.permutation(num_clients)[:k])
