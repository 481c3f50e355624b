"""Settings objects are passed whole (issue 38): DGA(config=DGAConfig(...)),
Experiment(results=ResultsConfig(...), clock=ClockConfig(...)), RunClock(config=...),
beside the keyword forms, equal to them, and never both at once."""

from __future__ import annotations

import dataclasses

import pytest
from flwr.app import MetricRecord

from fededge.algorithms.dga import DGAConfig
from fededge.config import RunConfig
from fededge.netem.runclock import ClockConfig, RunClock
from fededge.server.experiment import Experiment
from fededge.server.results import ResultsConfig
from fededge.strategies.dga import DGA
from fededge.strategies.registry import build_strategy


def _evaluate(rnd, arrays):  # never called here
    return MetricRecord({"accuracy": 0.0, "loss": 0.0})


def test_dga_takes_its_config_whole_or_as_keywords_not_both():
    whole = DGA(config=DGAConfig(delay=2, warmup_rounds=1, pipeline="off"))
    keywords = DGA(delay=2, warmup_rounds=1, pipeline="off")
    assert whole.config == keywords.config and whole.pipeline == keywords.pipeline == "off"
    with pytest.raises(ValueError, match="not both"):
        DGA(config=DGAConfig(delay=2), delay=3)
    # fededge's app hands DGA the run config's DGAConfig, as it is
    cfg = RunConfig(strategy="dga", dga_delay=2, dga_warmup_rounds=3)
    assert build_strategy(cfg).config == cfg.owned(DGAConfig)


def test_experiment_keeps_the_settings_objects_it_is_given_or_builds():
    results = ResultsConfig(results_dir="out", checkpoint_every=1, evaluate_every=2, progress="off")
    clock = ClockConfig(netem="4g", sim_step_s=0.1)
    whole = Experiment(evaluate_fn=_evaluate, results=results, clock=clock)
    assert whole.results is results and whole.clock_config is clock
    keywords = Experiment(evaluate_fn=_evaluate, results_dir="out", checkpoint_every=1, evaluate_every=2,
                          progress="off", netem="4g", sim_step_s=0.1)
    assert keywords.results == results and keywords.clock_config == clock
    for exp in (whole, keywords):
        assert (exp.checkpoint_every, exp.evaluate_every, str(exp.results_dir)) == (1, 2, "out")
    with pytest.raises(ValueError, match="not both"):
        Experiment(evaluate_fn=_evaluate, results=results, checkpoint_every=3)
    with pytest.raises(ValueError, match="not both"):
        Experiment(evaluate_fn=_evaluate, clock=clock, netem="wifi")
    with pytest.raises(TypeError, match="results must be a ResultsConfig"):
        Experiment(evaluate_fn=_evaluate, results=clock)
    with pytest.raises(ValueError):  # a bad knob is still refused at construction
        Experiment(evaluate_fn=_evaluate, sim_step_s=-1.0)


def test_run_clock_takes_its_config_whole():
    clock = ClockConfig(netem="wifi", compute_speed="2.0", sim_step_s=0.5)
    a = RunClock(config=clock, seed=3)
    b = RunClock(**dataclasses.asdict(clock), seed=3)
    assert a.config == b.config == clock
    assert (a.netem, a.compute_speed, a.sim_step_s) == (b.netem, b.compute_speed, b.sim_step_s)
    assert a.build(4).state_dict() == b.build(4).state_dict()
    with pytest.raises(ValueError, match="not both"):
        RunClock(config=clock, netem="4g")
