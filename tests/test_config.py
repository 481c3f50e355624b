try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest

from fededge.config import STRATEGIES, ConfigError, RunConfig

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_app_config_equals_runconfig_defaults():
    # flwr run reads pyproject.toml, run_inprocess reads RunConfig: they must agree,
    # and every key must be in pyproject (Flower refuses overrides of absent keys).
    app_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert app_cfg == RunConfig().to_mapping()


def test_roundtrip_through_mapping():
    cfg = RunConfig.from_mapping({"local-steps": 7, "alpha": 0.1, "dataset": "synthetic"})
    assert (cfg.local_steps, cfg.alpha, cfg.dataset) == (7, 0.1, "synthetic")
    assert RunConfig.from_mapping(cfg.to_mapping()) == cfg


def test_unknown_key_is_named_with_suggestion():
    with pytest.raises(ConfigError, match=r"unknown run-config key 'local-step'; did you mean 'local-steps'"):
        RunConfig.from_mapping({"local-step": 5})


def test_snake_case_key_is_refused_and_kebab_suggested():
    with pytest.raises(ConfigError, match=r"'local_steps'.*did you mean 'local-steps'"):
        RunConfig.from_mapping({"local_steps": 5})


@pytest.mark.parametrize(
    ("key", "value", "pattern"),
    [
        ("num-rounds", 0, r"'num-rounds' must be >= 1, got 0"),
        ("local-lr", -0.1, r"'local-lr' must be > 0"),
        ("momentum", 1.0, r"'momentum' must be in \[0.0, 1.0\)"),
        ("partition", "zipf", r"'partition' must be one of iid, dirichlet, shards"),
        ("dataset", "imagenet", r"'dataset' must be one of .*digits"),
        ("model", "vgg", r"'model' must be one of mlp, cnn, cnn-bn, cnn-fedavg, resnet18"),
        ("strategy", "fedsgd", r"'strategy' must be one of fedavg"),
        ("device", "tpu", r"'device' must be one of auto, cpu, cuda"),
        ("alpha", 0, r"'alpha' must be > 0"),
        ("clients-per-round", 0, r"'clients-per-round' must be >= 1 as a count"),
        ("clients-per-round", 1.5, r"as a fraction must be in \(0, 1\]"),
        ("target-accuracy", 0.0, r"'target-accuracy': target_accuracy must be in \(0, 1\]"),
        ("local-steps", "ten", r"'local-steps' must be an integer"),
        ("local-steps", 2.5, r"'local-steps' must be an integer"),
        ("local-lr", "fast", r"'local-lr' must be a number"),
        ("dataset", 3, r"'dataset' must be a string"),
        ("num-rounds", True, r"'num-rounds' must be a int"),
        ("run-name", "a b", r"'run-name': run_name may hold only"),
    ],
)
def test_bad_values_name_the_key(key, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        RunConfig.from_mapping({key: value})


def test_clients_per_round_count_or_fraction():
    assert RunConfig.from_mapping({"clients-per-round": 3}).clients_per_round == 3
    assert RunConfig.from_mapping({"clients-per-round": 0.5}).clients_per_round == 0.5


def test_int_given_for_float_is_accepted():
    assert RunConfig.from_mapping({"local-lr": 1}).local_lr == 1.0


def test_every_strategy_maps_to_the_right_flower_class_and_knobs():
    from flwr.serverapp import strategy as fs

    from fededge.strategies.registry import build_strategy

    expected = {
        "fedavg": fs.FedAvg, "fedavgm": fs.FedAvgM, "fedprox": fs.FedProx, "fedadam": fs.FedAdam,
        "fedadagrad": fs.FedAdagrad, "fedyogi": fs.FedYogi, "fedmedian": fs.FedMedian,
        "fedtrimmedavg": fs.FedTrimmedAvg, "krum": fs.Krum,
    }
    from fededge.strategies.dga import DGA
    from fededge.strategies.gossip import Gossip
    from fededge.strategies.outer import FedAvgOuter

    from fededge.strategies.backup import BackupWorkers
    from fededge.strategies.fedasync import FedAsync
    from fededge.strategies.fedbuff import FedBuff
    from fededge.strategies.ssp import SSP

    expected.update({"dga": DGA, "diloco": FedAvgOuter, "gossip": Gossip, "fedasync": FedAsync,
                     "fedbuff": FedBuff, "ssp": SSP, "backup": BackupWorkers})
    assert set(expected) == set(STRATEGIES)
    from fededge.strategies.plainbuffers import PlainBuffers

    for name, cls in expected.items():
        built = build_strategy(RunConfig(strategy=name))
        if name in ("fedavgm", "fedadam", "fedadagrad", "fedyogi"):  # their step on parameters only
            assert type(built) is PlainBuffers
            built = built.inner
        assert type(built) is cls, name

    cfg = RunConfig(strategy="fedavgm", server_lr=0.5, server_momentum=0.7)
    s = build_strategy(cfg)
    assert (s.server_learning_rate, s.server_momentum) == (0.5, 0.7)
    s = build_strategy(RunConfig(strategy="fedadam", server_lr=0.03, local_lr=0.2))
    assert (s.eta, s.eta_l) == (0.03, 0.2)
    assert build_strategy(RunConfig(strategy="fedprox", proximal_mu=0.3)).proximal_mu == 0.3
    assert build_strategy(RunConfig(strategy="fedtrimmedavg", trimmed_beta=0.1)).beta == 0.1
    assert build_strategy(RunConfig(strategy="krum", krum_byzantine=2)).num_malicious_nodes == 2
    s = build_strategy(RunConfig(strategy="dga", dga_delay=3, dga_correction=False, dga_warmup_rounds=2,
                                 dga_pipeline="off"))
    assert (s.config.delay, s.config.correction, s.config.warmup_rounds, s.pipeline) == (3, False, 2, "off")
    s = build_strategy(RunConfig(strategy="diloco"))
    assert (s.outer.lr, s.outer.momentum, s.outer.nesterov) == (0.7, 0.9, True)


def test_clients_per_round_maps_to_flower_sampling():
    from fededge.strategies.registry import build_strategy

    count = build_strategy(RunConfig(clients_per_round=4))
    # Flower samples max(int(n * fraction_train), min_train_nodes): exactly 4 for any n.
    assert all(max(int(n * count.fraction_train), count.min_train_nodes) == 4 for n in (4, 10, 1000))
    frac = build_strategy(RunConfig(clients_per_round=0.5, min_available_nodes=6))
    assert (frac.fraction_train, frac.min_available_nodes) == (0.5, 6)


@pytest.mark.parametrize("key", ["weight-decay", "proximal-mu", "server-lr", "local-lr", "alpha",
                                 "synthetic-amplitude", "dgc-clip-norm", "staleness-a"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_float_key_that_is_not_a_number_is_refused_by_name(key, value):
    """NaN passed every `x < 0` / `x > 0` check (weight-decay=nan trained to NaN without a
    word), inf most; dgc-clip-norm's refusal named another key."""
    with pytest.raises(ConfigError, match=f"run-config key '{key}' must be a finite number, got {value}"):
        RunConfig.from_mapping({key: value})


def test_round_timeout_takes_inf_for_none_and_nothing_takes_nan():
    assert RunConfig.from_mapping({"round-timeout": float("inf")}).round_timeout == float("inf")
    with pytest.raises(ConfigError, match="'round-timeout' must be a finite number, got nan"):
        RunConfig.from_mapping({"round-timeout": float("nan")})


def test_krum_needs_more_than_twice_its_byzantine_clients_plus_two_a_round():
    with pytest.raises(ConfigError, match=r"'krum-byzantine' is 2 but clients-per-round is 6: .*n > 2f \+ 2 \(here 7"):
        RunConfig.from_mapping({"strategy": "krum", "krum-byzantine": 2, "clients-per-round": 6})
    RunConfig.from_mapping({"strategy": "krum", "krum-byzantine": 2, "clients-per-round": 7})
    RunConfig.from_mapping({"strategy": "krum", "krum-byzantine": 0, "clients-per-round": 2})
    # a fraction (the default 1.0) was not checked: Flower then scored by max(1, n - f - 2)
    from fededge.config import check_clients_available

    frac = RunConfig.from_mapping({"strategy": "krum", "krum-byzantine": 2})
    with pytest.raises(ConfigError, match=r"clients-per-round=1.0 of 6 clients is 6 a round: .*here 7 or more"):
        check_clients_available(frac, 6)
    check_clients_available(frac, 7)
    with pytest.raises(ConfigError, match="is 5 a round"):
        check_clients_available(RunConfig.from_mapping({"strategy": "krum", "krum-byzantine": 2,
                                                        "clients-per-round": 0.5}), 10)
