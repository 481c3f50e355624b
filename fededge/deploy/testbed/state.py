"""The state file ``STATE_DIR/testbed.json``: what ``up`` made, for ``run``, ``status`` and ``down``.

``up`` writes it (its plan, :meth:`~fededge.deploy.testbed.plan.TestbedPlan.to_state`)
before it creates anything and adds every process as it starts; ``down`` removes exactly
what it names. Only a file of the user's own is trusted, since ``down`` kills and
deletes what it lists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fededge.deploy.testbed.plan import PREFIX, STATE_FILE, STATE_VERSION, PreflightError, TestbedError

__all__ = ["prepare_state_dir", "read_state", "state_path", "write_state"]

def state_path(state_dir: str | os.PathLike[str]) -> Path:
    """``STATE_DIR/testbed.json``."""
    return Path(state_dir).resolve() / STATE_FILE


def read_state(state_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The state file's content, or None when there is none."""
    path = state_path(state_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    owner = path.stat().st_uid
    if owner != os.geteuid():  # `down` kills and deletes what it lists: trust only our own
        raise TestbedError(f"{path} belongs to uid {owner}, not to you (uid {os.geteuid()}): refusing to "
                           "act on a state file somebody else wrote")
    try:
        state = json.loads(text)
    except json.JSONDecodeError as err:
        raise TestbedError(f"{path} is not valid JSON ({err}): check it, remove what it lists by hand "
                           f"(ip netns del {PREFIX}..., ip link del {PREFIX}...), then delete it") from None
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise TestbedError(f"{path} is not a fededge testbed state file (version {STATE_VERSION})")
    return state


def write_state(state: Mapping[str, Any], *, create: bool = False) -> None:
    """Replace the state file atomically; with ``create``, make it, failing if it exists."""
    path = state_path(state["state_dir"])
    text = json.dumps(state, indent=2) + "\n"
    if create:  # claim the directory atomically: a second `up` fails here
        with open(path, "x") as f:
            f.write(text)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare_state_dir(state_dir: Path) -> None:
    """Make the state directory (0700); refuse one that belongs to another user."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = state_dir.stat()
    if st.st_uid != os.geteuid():
        raise PreflightError(f"state directory {state_dir} belongs to uid {st.st_uid}, not to you "
                           f"(uid {os.geteuid()}): `down` would trust its state file; pick another --state-dir")
