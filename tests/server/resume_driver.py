"""Runs one in-process fededge run and SIGKILLs itself at a chosen point (for test_resume.py).

    python -m tests.server.resume_driver RESULTS_DIR WHEN ROUND JSON_OVERRIDES

WHEN is ``between`` (right after round ROUND's checkpoint, before the next round starts),
``mid-round`` (while a client trains round ROUND: its first message of a round or
version ROUND or later), ``mid-checkpoint`` (round ROUND's
checkpoint fully written to its temporary file but not yet renamed) or ``never``. The
kill is a real SIGKILL of this process: nothing is flushed or closed on the way out.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from fededge import keys


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    results, when, at, overrides = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    num_clients = int(overrides.pop("__num_clients", 4))
    keep = bool(overrides.pop("__keep_client_states", True))
    from fededge.clients.app import app as fededge_app
    from fededge import safefile
    from fededge.server import experiment as measure_mod
    from fededge.server.inprocess import run_inprocess

    client_app = fededge_app
    if when == "mid-round":
        def client_app(msg, ctx):  # noqa: ANN001,ANN202 - any callable (msg, ctx) is a ClientApp here
            conf = msg.content[keys.CONFIG] if keys.CONFIG in msg.content else {}
            if int(conf.get(keys.SERVER_ROUND, 0)) >= at and int(ctx.node_config[keys.PARTITION_ID]) == 1:
                _die()
            return fededge_app(msg, ctx)
    elif when == "between":
        real_write = measure_mod.write_checkpoint

        def write(run_dir, server_round, payload):  # noqa: ANN001,ANN202
            out = real_write(run_dir, server_round, payload)
            if server_round == at:
                _die()
            return out
        measure_mod.write_checkpoint = write
    elif when == "mid-checkpoint":
        real_replace = safefile.os.replace

        class _Os:  # safefile's ``os``, but its rename of round ``at`` never happens
            def __getattr__(self, name):  # noqa: ANN001,ANN204
                return getattr(os, name)

            @staticmethod
            def replace(src, dst):  # noqa: ANN001,ANN205
                if str(dst).endswith(f"round-{at:06d}.ckpt"):
                    _die()
                return real_replace(src, dst)
        safefile.os = _Os()
    elif when != "never":
        raise SystemExit(f"unknown WHEN {when!r}")
    run_inprocess({**overrides, "results-dir": results}, num_clients=num_clients, client_app=client_app,
                  keep_client_states=keep)


if __name__ == "__main__":
    main()
