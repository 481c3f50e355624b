"""The dependency rule of docs/architecture.md: the maths never imports Flower."""

import subprocess
import sys

PURE = [
    "fededge.compress", "fededge.topology", "fededge.netem", "fededge.data", "fededge.models",
    "fededge.config", "fededge.keys", "fededge.workload", "fededge.clients.train",
    "fededge.clients.device", "fededge.server.results", "fededge.netem.profiles",
    "fededge.netem.trace", "fededge.netem.clock", "fededge.netem.assign", "fededge.compress.bundle",
    "fededge.compress.update", "fededge.algorithms.dga", "fededge.algorithms.outer", "fededge.server.replay",
    "fededge.topology.graph", "fededge.topology.mixing", "fededge.topology.registry",
    "fededge.algorithms.gossip", "fededge.algorithms.asyncfl",
]


def test_pure_modules_do_not_import_flower():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in PURE)
        + "bad = sorted(m for m in sys.modules if m == 'flwr' or m.startswith('flwr.') or m == 'ray')\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"pure modules pulled in: {out.stdout.strip()}"
