"""The dependency rules of docs/architecture.md: the maths never imports Flower; the
server side never imports the client side; the library API never imports fededge's app."""

import ast
import subprocess
import sys
from pathlib import Path

import fededge

PURE = [
    "fededge.compress", "fededge.topology", "fededge.netem", "fededge.data", "fededge.models",
    "fededge.config", "fededge.keys", "fededge.errors", "fededge.workload", "fededge.clients.train",
    "fededge.clients.device", "fededge.server.results", "fededge.netem.profiles",
    "fededge.netem.trace", "fededge.netem.clock", "fededge.netem.assign", "fededge.compress.bundle",
    "fededge.compress.update", "fededge.algorithms.dga", "fededge.algorithms.outer", "fededge.analysis.replay",
    "fededge.topology.graph", "fededge.topology.mixing", "fededge.topology.registry",
    "fededge.algorithms.gossip", "fededge.algorithms.asyncfl", "fededge.netem.runclock",
    "fededge.strategies.report",
]

ROOT = Path(fededge.__file__).parent

#: The client side the server may import: the pure-torch modules (no Flower, in PURE
#: above). The server evaluates the global model with the clients' own evaluate() on the
#: device choice they use: one evaluation, not two.
PURE_CLIENT = {"fededge.clients.train", "fededge.clients.device"}
#: run_inprocess runs fededge's own ClientApp when given none. It imports it inside the
#: function, so that importing the runtime (as a user's tests do, with their own
#: ClientApp) imports neither fededge's app nor its mods.
LAZY = {("server/inprocess.py", "fededge.clients.app")}


def _imports(path: Path):
    """(module imported, whether at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            yield name, id(node) in top


def test_pure_modules_do_not_import_flower():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in PURE)
        + "bad = sorted(m for m in sys.modules if m == 'flwr' or m.startswith('flwr.') or m == 'ray')\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"pure modules pulled in: {out.stdout.strip()}"


def test_server_and_strategies_do_not_import_the_client_side():
    found = {}
    for package in ("server", "strategies"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for name, top_level in _imports(path):
                if name == "fededge.clients" or name.startswith("fededge.clients."):
                    module = ".".join(name.split(".")[:3])
                    found.setdefault((rel, module), []).append(top_level)
    unexpected = sorted(k for k in found if k[1] not in PURE_CLIENT and k not in LAZY)
    assert not unexpected, (f"server/strategies import the client side: {unexpected}; shared record "
                            f"names and helpers belong in fededge.keys / fededge.protocol")
    eager = [k for k in LAZY if any(found.get(k, []))]
    assert not eager, f"{eager}: import fededge's ClientApp inside the function that needs it"


#: fededge's own app: its run-config parsing, its workload and its Flower entry points.
APP = {"fededge.config", "fededge.workload", "fededge.clients.app", "fededge.server.app",
       "fededge.server.experiment", "fededge.server.inprocess", "fededge.strategies.registry"}


def test_the_protocol_and_the_api_do_not_import_fededges_app():
    code = (
        "import sys\nimport fededge.protocol\nimport fededge.api\n"
        f"bad = sorted(m for m in sys.modules if m in {sorted(APP)})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"fededge.api pulled in: {out.stdout.strip()}"


def test_the_api_exports_what_it_names():
    import fededge.api as api

    assert len(api.__all__) == len(set(api.__all__))
    assert all(hasattr(api, name) for name in api.__all__)
    assert {"CompressionMod", "DGAMod", "GossipMod", "config_error_mod", "Compressed", "DGA", "Gossip",
            "FedAsync", "FedBuff", "SSP", "Experiment", "UpdateConfig", "DGAConfig", "ChocoConfig"} <= set(api.__all__)
