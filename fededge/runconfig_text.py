"""The ``key=value`` text of ``flwr run --run-config`` and ``--node-config``, both ways.

:func:`parse_run_config` reads what a user types (``fededge run|simulate --run-config``,
``fededge testbed up --node-config``, the benchmarks' ``--run-config``);
:func:`format_run_config` writes what fededge hands Flower's programs
(``flwr run --run-config``, ``flower-supernode --node-config``). One small module that
imports neither Flower nor torch, so that the command line, the deployment tools and the
namespace testbed share it without importing each other.

Example
-------
>>> parse_run_config('num-rounds=3 dataset="digits" save-model=false')
{'num-rounds': 3, 'dataset': 'digits', 'save-model': False}
>>> format_run_config({"num-rounds": 3, "dataset": "digits"})
'num-rounds=3 dataset="digits"'
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["format_run_config", "parse_run_config"]

_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")


def parse_run_config(text: str | None) -> dict[str, Any]:
    """Parse ``"k=v k2=v2"`` as ``flwr run --run-config`` does, or a ``.toml`` file.

    Values are TOML (``3``, ``0.1``, ``true``, ``"text"``); a bare word that is not
    valid TOML (``dataset=digits``) is taken as a string, a convenience Flower lacks.
    """
    if not text:
        return {}
    if text.endswith(".toml"):
        with open(text, "rb") as f:
            return tomllib.load(f)
    out: dict[str, Any] = {}
    consumed = _PAIR.sub("", text).strip()
    if consumed:
        raise ValueError(f"could not parse {consumed!r} in --run-config; write key=value pairs")
    for key, raw in _PAIR.findall(text):
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = raw.strip("'\"")
    return out


def format_run_config(cfg: Mapping[str, Any]) -> str:
    """``{"num-rounds": 3, "dataset": "digits"}`` -> ``num-rounds=3 dataset="digits"``."""
    parts = []
    for key, value in cfg.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = json.dumps(str(value))
        parts.append(f"{key}={text}")
    return " ".join(parts)
