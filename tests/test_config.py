import tomllib
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
        ("model", "vgg", r"'model' must be one of mlp, cnn, resnet18"),
        ("strategy", "fedsgd", r"'strategy' must be one of fedavg"),
        ("device", "tpu", r"'device' must be one of auto, cpu, cuda"),
        ("alpha", 0, r"'alpha' must be > 0"),
        ("clients-per-round", 0, r"'clients-per-round' must be >= 1 as a count"),
        ("clients-per-round", 1.5, r"as a fraction must be in \(0, 1\]"),
        ("target-accuracy", 0.0, r"'target-accuracy' must be in \(0.0, 1.0\]"),
        ("local-steps", "ten", r"'local-steps' must be an integer"),
        ("local-steps", 2.5, r"'local-steps' must be an integer"),
        ("local-lr", "fast", r"'local-lr' must be a number"),
        ("dataset", 3, r"'dataset' must be a string"),
        ("num-rounds", True, r"'num-rounds' must be a int"),
        ("run-name", "a b", r"'run-name' may hold only"),
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


def test_every_strategy_name_builds():
    from fededge.strategies.registry import build_strategy

    for name in STRATEGIES:
        s = build_strategy(RunConfig(strategy=name))
        assert type(s).__name__.lower().startswith(name[:5])
