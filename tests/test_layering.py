"""The dependency rules of docs/architecture.md, read from the source.

Every ``import`` in fededge/ is parsed (ast; nothing is imported or run), at module level
and inside functions alike: an import inside a function is a dependency all the same, it
only runs later. Imports under ``if TYPE_CHECKING:`` never run and are left out. The
modules are found in the source tree, so a new or moved module falls under the table
without editing it.

One table (``RULES``) says which modules never import what, the exceptions and why: the
pure cores import no Flower and no app code, the server side no client code, the
strategies no server code, the library API nothing of fededge's own app (transitively),
and only ``_flwr_internals.py`` imports Flower's internals. A second test finds import
cycles. Patterns: ``"a.b"`` is that module (or package) alone, ``"a.b.*"`` it and
everything below it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fededge"

#: The pure cores: no Flower, no Ray, and of fededge only other pure modules, so the maths
#: is tested in milliseconds without a runtime (and, the set being closed, nothing they
#: import pulls Flower in either). The packages above a pure module are pure too: they
#: run whenever it is imported.
PURE = {
    "fededge.compress.*": "codecs, error feedback, wire format: pure torch",
    "fededge.topology.*": "graphs and mixing matrices: pure numpy",
    "fededge.tracking.*": "metric sinks (TensorBoard, MLflow, W&B): each tool imported when its sink opens",
    "fededge.sweep": "a grid of runs x seeds: plans and checks them, runs each as a fededge run process",
    "fededge.netem.*": "link profiles, the clock, the proxy, the kernel (tc) backend",
    "fededge.data.*": "data sets and partitioners",
    "fededge.models.*": "plain-torch models",
    "fededge.algorithms.*": "the arithmetic of DGA, outer SGD, gossip and the async rules",
    "fededge.analysis.*": "tools over finished runs (plots, replay)",
    "fededge.config": "the run config, parsed once, testable without a runtime",
    "fededge.results_config": "what a run writes and where (ResultsConfig), read by the run config",
    "fededge.settings": "one rule for settings given as one object or as keywords",
    "fededge.machine": "the cores a run may use and how many runs share the machine",
    "fededge.wrapping": "how a wrapper is followed to what it wraps (inner), one protocol",
    "fededge.catalog": "the selectable strategies, one record each, read by the run config",
    "fededge.keys": "record and config names, readable by pure code and other languages",
    "fededge.errors": "ConfigError, which config_error_mod catches without the run config",
    "fededge.workload": "run config -> data set, partition, initial model",
    "fededge.nodecache": "a node's data split on local disk",
    "fededge.safefile": "the checksummed, atomically written file of checkpoints and client states",
    "fededge.runconfig_text": "the --run-config text format",
    "fededge.clients.train": "local SGD and evaluation, shared by the server's evaluation",
    "fededge.clients.device": "the device choice, shared by the server's evaluation",
    "fededge.clients.cohort": "a round's local SGD as one batched program, which the in-process grid runs",
    "fededge.server.results": "metrics.jsonl / summary.json, read back by the analysis tools",
    "fededge.strategies.report": "how a strategy reports its round, without Flower",
    "fededge.deploy.certs": "certificates for a deployment, made on any machine",
    "fededge.deploy.procs": "Flower's programs as processes, never its Python modules",
    "fededge.deploy.testbed.*": "the testbed's plan is data, tested without root or Flower",
}
#: (pure module, import): deliberate exceptions, each inside the function that needs it.
PURE_EXCEPTIONS = {
    # config.json records the Flower version when Flower is installed (and says so when not).
    ("fededge.server.results", "flwr"),
}

#: fededge's own app: its run-config parsing, its workload and its Flower entry points.
APP = ["fededge.config", "fededge.workload", "fededge.clients.app", "fededge.server.app",
       "fededge.server.runner", "fededge.server.inprocess", "fededge.strategies.registry"]

#: Flower's public API; everything else of Flower is imported in fededge._flwr_internals
#: only, whose check() a test runs, so that an upgrade that moves one fails loudly.
FLOWER_PUBLIC = ["flwr", "flwr.app", "flwr.clientapp", "flwr.serverapp", "flwr.serverapp.strategy",
                 "flwr.common"]


def _and_parents(patterns) -> tuple[str, ...]:
    """The patterns and the packages above them (which run whenever a module below is imported)."""
    out = set(patterns)
    for p in patterns:
        parts = p.removesuffix(".*").split(".")
        out |= {".".join(parts[:i]) for i in range(1, len(parts))}
    return tuple(sorted(out))


@dataclass(frozen=True)
class Rule:
    """The modules ``who`` never import ``never``, unless what they import is ``allowed``, or
    is an ``allowed_lazy`` (importer, imported) import made inside a function. With
    ``transitive``, the fededge modules they import are held to it too, and theirs."""

    who: tuple[str, ...]
    never: tuple[str, ...]
    why: str
    allowed: tuple[str, ...] = ()
    allowed_lazy: frozenset[tuple[str, str]] = frozenset()
    transitive: bool = False
    exempt: tuple[str, ...] = ()


PURE_ALL = _and_parents(PURE)

#: The table: who never imports what, the exceptions, and why.
RULES = [
    Rule(who=PURE_ALL, never=("flwr.*", "ray.*", "fededge.*"), allowed=PURE_ALL,
         allowed_lazy=frozenset(PURE_EXCEPTIONS),
         why="the pure cores import no Flower, no Ray and no fededge module outside the pure cores"),
    Rule(who=("fededge.server.*", "fededge.strategies.*"), never=("fededge.clients.*",),
         allowed=("fededge.clients.train", "fededge.clients.device", "fededge.clients.cohort"),
         # run_inprocess runs fededge's own ClientApp when given none; it imports it in the
         # function, so that the server side imports no client code at module level.
         allowed_lazy=frozenset({("fededge.server.inprocess", "fededge.clients.app")}),
         why="the server side never imports the client side (shared names are in fededge.keys, "
             "record formats in fededge.protocol); it evaluates with the clients' own pure "
             "train.py on their device choice: one evaluation, not two; the in-process grid "
             "runs a round's messages through the pure cohort.py, which trains their local SGD together"),
    Rule(who=("fededge.strategies.*",), never=("fededge.server.*",), allowed=("fededge.server.results",),
         why="the server drives the strategies, never the other way; a strategy tells the "
             "measurement what its round did through strategies/report.py"),
    Rule(who=("fededge.config", "fededge.catalog", "fededge.results_config"),
         never=("fededge.clients.*", "fededge.server.*", "fededge.strategies.*"),
         why="the run config sits below the pieces it configures: it reads their config objects "
             "and the strategy catalog, never a client, server or strategy module"),
    Rule(who=("fededge.api", "fededge.protocol"), never=tuple(APP), transitive=True,
         why="the library (any Flower app's pieces) never imports fededge's own app"),
    Rule(who=("fededge.*",), exempt=("fededge._flwr_internals",), never=("flwr.*",),
         allowed=tuple(FLOWER_PUBLIC),
         why="Flower's internals are imported in fededge/_flwr_internals.py only"),
]

#: (importer, imported) lazy imports that may close an import cycle, each with its reason.
#: None today: no fededge module imports, even inside a function, one that imports it back.
CYCLE_EXCEPTIONS: set[tuple[str, str]] = set()


def _matches(name: str, patterns) -> bool:
    for p in patterns:
        if p.endswith(".*"):
            if name == p[:-2] or name.startswith(p[:-1]):
                return True
        elif name == p:
            return True
    return False


@cache
def _modules() -> dict[str, Path]:
    """Every fededge module (packages by their __init__.py), found in the source tree."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@dataclass(frozen=True)
class Import:
    target: str  # the fededge module imported (longest known prefix), else the dotted name
    lazy: bool  # inside a function: runs when the function does
    line: int


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _resolve(name: str) -> str:
    """A fededge name -> the module it is in (``fededge.x.y.Name`` -> ``fededge.x.y``)."""
    parts = name.split(".")
    if parts[0] != "fededge":
        return name
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in _modules():
            return ".".join(parts[:i])
    return name


@cache
def _imports(module: str) -> tuple[Import, ...]:
    path = _modules()[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):  # its body never runs; an else branch does
                visit(ast.Module(body=child.orelse, type_ignores=[]), lazy)
                continue
            if isinstance(child, ast.Import):
                found.extend(Import(_resolve(a.name), lazy, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[:len(package) - child.level + 1] + ([base] if base else []))
                for alias in child.names:  # a submodule (from pkg import mod) or a name in base
                    full = f"{base}.{alias.name}"
                    found.append(Import(full if full in _modules() else _resolve(base), lazy, child.lineno))
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return tuple(found)


def _violations(rule: Rule) -> list[str]:
    out = []
    for module in (m for m in _modules() if _matches(m, rule.who) and not _matches(m, rule.exempt)):
        reached, todo = {module}, [(module, (module,))]
        while todo:
            importer, chain = todo.pop()
            for imp in _imports(importer):
                if _matches(imp.target, rule.never) and not _matches(imp.target, rule.allowed) and not (
                        imp.lazy and any(importer == w and _matches(imp.target, [n]) for w, n in rule.allowed_lazy)):
                    where = f"{_modules()[importer].relative_to(ROOT.parent)}:{imp.line}"
                    out.append(f"{' -> '.join(chain)} imports {imp.target} ({where}"
                               f"{', in a function' if imp.lazy else ''}): {rule.why}")
                elif rule.transitive and imp.target in _modules() and imp.target not in reached:
                    reached.add(imp.target)
                    todo.append((imp.target, chain + (imp.target,)))
    return out


def test_imports_follow_the_table():
    found = [v for rule in RULES for v in _violations(rule)]
    assert not found, "imports against docs/architecture.md:\n  " + "\n  ".join(found)
    # Each exception is a lazy import that exists: one made eager, or gone, leaves the table.
    for rule in RULES:
        for importer, name in rule.allowed_lazy:
            imps = [i for i in _imports(importer) if _matches(i.target, [name])]
            assert imps and all(i.lazy for i in imps), (
                f"{importer} -> {name} is listed as an import inside a function, but "
                f"{'it is made at module level' if imps else 'there is no such import'}")


def _cycle() -> list[str] | None:
    """An import cycle among fededge modules (lazy imports count), or None."""
    graph = {m: sorted({i.target for i in _imports(m) if i.target in _modules() and i.target != m
                        and (m, i.target) not in CYCLE_EXCEPTIONS}) for m in _modules()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := walk(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in graph:
        if m not in state and (found := walk(m)):
            return found
    return None


def test_no_import_cycles():
    cycle = _cycle()
    assert cycle is None, (
        "import cycle (imports inside functions count): " + " -> ".join(cycle)
        + "; move what both need to a module both may import (names: fededge.keys, records: "
        "fededge.protocol), or list a deliberate lazy import in CYCLE_EXCEPTIONS with its reason")


def test_the_api_exports_what_it_names():
    import fededge.api as api

    assert len(api.__all__) == len(set(api.__all__))
    assert all(hasattr(api, name) for name in api.__all__)
    assert {"CompressionMod", "DGAMod", "GossipMod", "config_error_mod", "Compressed", "DGA", "Gossip",
            "FedAsync", "FedBuff", "SSP", "Experiment", "UpdateConfig", "DGAConfig", "ChocoConfig"} <= set(api.__all__)
