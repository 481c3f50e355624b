"""A ClientApp (for tests/server/test_scale.py) that imports here but not in an
in-process worker: a worker that cannot start."""

import os

from tests.server.dying_app import app  # noqa: F401

if os.environ.get("FEDEDGE_INPROCESS_WORKER"):
    raise RuntimeError("this ClientApp cannot start in a worker")
