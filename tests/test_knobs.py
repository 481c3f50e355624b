"""Every knob is declared once: the run config, pyproject.toml and the library objects
that take the same knob agree on its default and on which values it accepts.

:data:`fededge.config.OWNED` names, for each run-config key a library piece also takes,
the config object that declares it. These tests hold every place the knob can be set to
that declaration: RunConfig's field default, pyproject.toml's ``[tool.flwr.app.config]``,
the default of each library constructor that takes it, and the set of values each of
them accepts (probed with values on both sides of every boundary).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest

from fededge.algorithms.asyncfl import AsyncConfig, LoopConfig, StalenessFunction
from fededge.algorithms.dga import DGAConfig
from fededge.algorithms.gossip import ChocoConfig, GossipConfig
from fededge.algorithms.outer import OuterSGD
from fededge.clients.mods import GossipMod
from fededge.compress.update import DownlinkConfig, UpdateConfig
from fededge.config import OWNED, ConfigError, RunConfig
from fededge.netem.runclock import ClockConfig, RunClock
from fededge.server.experiment import Experiment
from fededge.server.results import ResultsConfig
from fededge.strategies.asyncloop import AsyncFL, AsyncLoop
from fededge.strategies.backup import BackupWorkers
from fededge.strategies.compressed import Compressed
from fededge.strategies.dga import DGA
from fededge.strategies.fedasync import FedAsync
from fededge.strategies.fedbuff import FedBuff
from fededge.strategies.gossip import Gossip
from fededge.strategies.outer import FedAvgOuter
from fededge.strategies.ssp import SSP

ROOT = Path(__file__).resolve().parents[1]


def _evaluate(server_round, arrays):  # Experiment needs one; never called here
    raise AssertionError


def _inner():
    from flwr.serverapp.strategy import FedAvg

    return FedAvg()


#: Library entry points that take an owned knob: (name, build(value), parameter, key).
#: ``build`` calls the entry point with that one argument set.
LIBRARY = [
    ("DGA", lambda **kw: DGA(**kw), "delay", "dga-delay"),
    ("DGA", lambda **kw: DGA(**kw), "correction", "dga-correction"),
    ("DGA", lambda **kw: DGA(**kw), "warmup_rounds", "dga-warmup-rounds"),
    ("DGA", lambda **kw: DGA(**kw), "pipeline", "dga-pipeline"),
    ("DGA", lambda **kw: DGA(**kw), "compute_ahead", "dga-compute-ahead"),
    ("DGA", lambda **kw: DGA(**kw), "downlink", "downlink-compressor"),
    ("Compressed", lambda **kw: Compressed(_inner(), **kw), "downlink", "downlink-compressor"),
    ("Gossip", lambda **kw: Gossip(**kw), "topology", "topology"),
    ("Gossip", lambda **kw: Gossip(**kw), "mixing", "mixing"),
    ("Gossip", lambda **kw: Gossip(**kw), "algorithm", "gossip-algorithm"),
    ("Gossip", lambda **kw: Gossip(**kw), "gamma", "gossip-gamma"),
    ("GossipMod", lambda **kw: GossipMod(**kw), "choco_scale", "choco-scale"),
    ("FedAsync", lambda **kw: FedAsync(**kw), "alpha", "async-alpha"),
    ("FedBuff", lambda **kw: FedBuff(**kw), "buffer_size", "buffer-size"),
    ("SSP", lambda **kw: SSP(**kw), "bound", "ssp-bound"),
    ("FedAsync", lambda **kw: FedAsync(**kw), "concurrency", "async-concurrency"),
    ("AsyncLoop", lambda **kw: AsyncLoop(**kw), "order", "async-order"),
    ("BackupWorkers", lambda **kw: BackupWorkers(**kw), "backup", "backup-workers"),
    *[("RunClock", lambda **kw: RunClock(**kw), p, k) for k, p in (
        ("netem", "netem"), ("netem-file", "netem_file"), ("compute-speed", "compute_speed"),
        ("sim-step-s", "sim_step_s"), ("message-overhead-s", "message_overhead_s"), ("nodes-pull", "nodes_pull"))],
    *[("Experiment", lambda **kw: Experiment(evaluate_fn=_evaluate, **kw), p, k) for k, p in (
        ("netem", "netem"), ("netem-file", "netem_file"), ("compute-speed", "compute_speed"),
        ("sim-step-s", "sim_step_s"), ("message-overhead-s", "message_overhead_s"), ("nodes-pull", "nodes_pull"),
        ("results-dir", "results_dir"), ("run-name", "run_name"), ("target-accuracy", "target_accuracy"),
        ("progress", "progress"), ("save-model", "save_model"))],
]
#: Where a constructor's default lives when it is not a plain keyword default.
SIGNATURE = {"FedAsync": {"concurrency": None}}  # None: "every participant", AsyncConfig's 0

_STRINGS = ["", "none", "auto", "on", "off", "ring", "torus", "complete", "file", "k-regular", "choco", "dpsgd",
            "4g", "wifi:0.5,4g:0.5", "lognormal:0.5", "1.0", "zzz", "topk", "qsgd", "dgc", "fp16", "bf16", "raw",
            "clock", "arrival", "hinge", "constant", "polynomial", "metropolis", "max-degree", "a b", "run.1",
            "results", "fp32", "edges.txt", "decoded", "trained"]
_INTS = [-1, 0, 1, 2, 3, 5, 100]
_FLOATS = [-0.5, 0.0, 1e-6, 0.01, 0.05, 0.5, 0.999, 1.0, 1.5, 2.0, float("inf")]


#: The other knobs a probed knob needs to matter: a codec's knob is checked when that
#: codec is the compressor.
CONTEXT = {
    **{k: {"compressor": "qsgd"} for k in ("qsgd-levels", "qsgd-bucket")},
    **{k: {"compressor": "topk"} for k in ("topk-ratio", "topk-values")},
    **{k: {"compressor": "dgc"} for k in ("dgc-sparsity", "dgc-warmup-rounds", "dgc-warmup-epochs", "dgc-momentum",
                                             "dgc-clip-norm")},
    "powersgd-rank": {"compressor": "powersgd"}, "powersgd-iters": {"compressor": "powersgd"}, "int8-block": {"compressor": "int8"},
    "threshold-tau": {"compressor": "threshold"},
}
#: Knobs every probe of which is valid: any path names a file (read when the clock or graph is
#: built), any text a tracking store (MLflow takes it as a SQLite path or a URI when the run starts).
UNBOUNDED = {"netem-file", "topology-file", "resume-from", "mlflow-uri"}


def _probes(owner, param):
    annotation = {f.name: f.type for f in dataclasses.fields(owner)}[param]
    kinds = {part.strip() for part in str(annotation).split("|")}
    if "bool" in kinds:
        return [True, False]
    if "str" in kinds:
        return _STRINGS
    return (_INTS if "int" in kinds else []) + (_FLOATS if "float" in kinds else [])


def _field(key: str) -> str:
    return key.replace("-", "_")


def _accepts(build, **kwargs) -> bool:
    try:
        build(**kwargs)
    except (ValueError, ConfigError):
        return False
    return True


def _owner_default(owner, param):
    fields = {f.name: f for f in dataclasses.fields(owner)}
    f = fields[param]
    assert f.default is not dataclasses.MISSING, f"{owner.__name__}.{param} has no plain default"
    return f.default


def test_every_owned_key_is_a_run_config_key_and_the_owner_declares_it():
    keys = set(RunConfig.keys())
    assert set(OWNED) <= keys, sorted(set(OWNED) - keys)
    for key, (owner, param) in OWNED.items():
        assert dataclasses.is_dataclass(owner), owner
        assert param in {f.name for f in dataclasses.fields(owner)}, (key, owner, param)
        # The owner's docstring documents the knob under its run-config key, in brackets.
        brackets = " ".join(re.findall(r"\[([^\]]*)\]", re.sub(r"\s+", " ", owner.__doc__ or "")))
        assert re.search(rf"(?<![\w-]){re.escape(key)}(?![\w-])", brackets), \
            f"{owner.__name__}'s docstring does not name run-config key [{key}]"


@pytest.mark.parametrize("key", sorted(OWNED))
def test_run_config_and_pyproject_take_the_owners_default(key):
    owner, param = OWNED[key]
    default = _owner_default(owner, param)
    run_default = {f.name: f.default for f in dataclasses.fields(RunConfig)}[_field(key)]
    assert run_default == default and type(run_default) is type(default), (key, run_default, default)
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert app[key] == default, f"pyproject.toml {key} = {app[key]!r}, {owner.__name__}.{param} = {default!r}"


@pytest.mark.parametrize(("name", "build", "param", "key"), LIBRARY, ids=[f"{n}-{p}" for n, _, p, _ in LIBRARY])
def test_library_constructors_take_the_owners_default(name, build, param, key):
    owner, owner_param = OWNED[key]
    default = _owner_default(owner, owner_param)
    cls = {"DGA": DGA, "Compressed": Compressed, "Gossip": Gossip, "GossipMod": GossipMod, "FedAsync": FedAsync,
           "FedBuff": FedBuff, "SSP": SSP, "AsyncLoop": AsyncLoop, "BackupWorkers": BackupWorkers,
           "RunClock": RunClock, "Experiment": Experiment}[name]
    if param in SIGNATURE.get(name, {}):
        # Passed on to AsyncFL, whose None keeps the config object's default.
        assert inspect.signature(AsyncFL.__init__).parameters[param].default is SIGNATURE[name][param]
        assert AsyncConfig().concurrency == default
        return
    sig_default = inspect.signature(cls.__init__).parameters[param].default
    assert sig_default == default, f"{name}({param}=...) defaults to {sig_default!r}, {owner.__name__} to {default!r}"


@pytest.mark.parametrize("key", sorted(OWNED))
def test_run_config_accepts_exactly_what_the_owner_accepts(key):
    owner, param = OWNED[key]
    context = CONTEXT.get(key, {})
    owner_context = {OWNED[k][1]: v for k, v in context.items()}
    seen = {True: 0, False: 0}
    for value in _probes(owner, param):
        by_owner = _accepts(owner, **owner_context, **{param: value})
        by_run = _accepts(RunConfig.from_mapping, mapping={**context, key: value})
        assert by_owner == by_run, (f"{key}={value!r}: {owner.__name__} "
                                    f"{'accepts' if by_owner else 'refuses'} it, the run config "
                                    f"{'accepts' if by_run else 'refuses'} it")
        seen[by_owner] += 1
    # The probes cross a boundary: some values pass, some are refused.
    assert seen[True] and (seen[False] or key in UNBOUNDED or _probes(owner, param) == [True, False]), (key, seen)


@pytest.mark.parametrize(("name", "build", "param", "key"), LIBRARY, ids=[f"{n}-{p}" for n, _, p, _ in LIBRARY])
def test_library_constructors_accept_exactly_what_the_owner_accepts(name, build, param, key):
    owner, owner_param = OWNED[key]
    for value in _probes(owner, owner_param):
        by_owner = _accepts(owner, **{owner_param: value})
        by_library = _accepts(build, **{param: value})
        assert by_owner == by_library, (f"{name}({param}={value!r}) "
                                        f"{'accepts' if by_library else 'refuses'} what {owner.__name__} "
                                        f"{'accepts' if by_owner else 'refuses'}")


def test_bad_owned_values_name_the_run_config_key():
    for mapping, named in [({"gossip-gamma": 0.0}, "'gossip-gamma'"), ({"dga-pipeline": "x"}, "'dga-pipeline'"),
                           ({"backup-workers": 1.5}, "'backup-workers'"), ({"staleness": "zzz"}, "'staleness'"),
                           ({"compressor": "qsgd", "error-feedback": True}, "'error-feedback'"),
                           ({"compute-speed": "file"}, "'compute-speed'"),
                           ({"message-overhead-s": -1.0}, "'message-overhead-s'")]:
        with pytest.raises(ConfigError) as err:
            RunConfig.from_mapping(mapping)
        prefix = str(err.value).split(": ", 1)[0]  # "run-config key 'a'" or "run-config keys 'a' and 'b'"
        assert prefix.startswith("run-config key") and named in prefix, str(err.value)


def test_owned_builds_the_library_object_from_the_run_config():
    cfg = RunConfig.from_mapping({"strategy": "gossip", "gossip-algorithm": "choco", "gossip-gamma": 0.3,
                                  "choco-scale": 0.5, "topology": "k-regular", "topology-degree": 3,
                                  "dga-delay": 2, "staleness": "hinge", "staleness-b": 2.0})
    assert cfg.owned(ChocoConfig) == ChocoConfig(gamma=0.3, scale=0.5)
    assert cfg.owned(GossipConfig).topology_params() == {"k": 3}
    assert cfg.owned(DGAConfig) == DGAConfig(delay=2)
    assert cfg.owned(StalenessFunction) == StalenessFunction("hinge", b=2.0)
    assert cfg.owned(AsyncConfig) == AsyncConfig()
    assert cfg.owned(LoopConfig) == LoopConfig()
    assert cfg.owned(ClockConfig) == ClockConfig()
    assert cfg.owned(ResultsConfig) == ResultsConfig()
    assert cfg.owned(DownlinkConfig) == DownlinkConfig()
    assert cfg.update_config() == UpdateConfig()
    with pytest.raises(ValueError, match="owns no run-config key"):
        cfg.owned(OuterSGD)


def test_strategies_built_from_the_run_config_keep_their_own_server_lr_default():
    # server-lr = 0 means "the strategy's own default": the default the class declares.
    from fededge.strategies.registry import build_strategy

    assert build_strategy(RunConfig(strategy="diloco")).outer.lr == OuterSGD.lr
    assert build_strategy(RunConfig(strategy="fedbuff")).config.server_lr == AsyncConfig.server_lr
    assert build_strategy(RunConfig(strategy="fedbuff", server_lr=0.5)).config.server_lr == 0.5
    assert inspect.signature(FedAvgOuter.__init__).parameters["lr"].default == OuterSGD.lr
