"""norm-stats = global (issue 36): the server's model carries the normalisation statistics
of its own aggregated weights, pooled from the round's clients (NormCalibrated and the
clients' ``query.norm_stats`` answer); the pooling to the number; bad answers left out and
reported; clients that cannot answer stop the run at round 1 by name."""

import json
import logging

import pytest
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fededge import keys
from fededge.algorithms.normstats import NormStatsError, check_statistics, pool_statistics
from fededge.clients import app as fapp
from fededge.clients.train import norm_statistics
from fededge.compress.plan import UpdatePlan
from fededge.compress.update import UpdateConfig
from fededge.config import ConfigError, RunConfig
from fededge.models.zoo import build_model
from fededge.protocol import norm_stats_content, read_norm_stats
from fededge.server.inprocess import run_inprocess
from fededge.strategies.normstats import NormCalibrated, NormStatsQueryError
from fededge.workload import client_data

BASE = {"model": "cnn-bn", "num-rounds": 2, "local-steps": 5, "progress": "off", "compressor": "powersgd",
        "norm-stats": "global"}


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ the pooling, pure


def _biased(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"bn.running_mean": x.mean(0), "bn.running_var": x.var(0, unbiased=False)}


def test_pooling_gives_the_statistics_of_the_union_to_the_number():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, 5, generator=g, dtype=torch.float64) * s + m
             for n, s, m in ((7, 1.0, 0.0), (30, 2.0, 3.0), (13, 0.5, -1.0))]
    pooled = pool_statistics([(len(p), _biased(p)) for p in parts])
    union = _biased(torch.cat(parts))
    for k in union:  # the pool is float32: exact to its rounding
        torch.testing.assert_close(pooled[k], union[k].float(), rtol=1e-6, atol=1e-6)
    assert list(pooled) == ["bn.running_mean", "bn.running_var"]


def test_one_client_or_equal_clients_pool_to_their_own_statistics():
    s = {"a.running_mean": torch.tensor([1.0, -2.0]), "a.running_var": torch.tensor([0.5, 3.0])}
    assert all(torch.equal(pool_statistics([(9, s)])[k], s[k]) for k in s)
    assert all(torch.equal(pool_statistics([(2, s), (5, s)])[k], s[k]) for k in s)


def test_pooling_refuses_what_it_cannot_pool():
    s = {"a.running_mean": torch.zeros(2), "a.running_var": torch.ones(2)}
    with pytest.raises(ValueError, match="at least one"):
        pool_statistics([])
    with pytest.raises(ValueError, match="example count must be > 0"):
        pool_statistics([(0, s)])
    with pytest.raises(ValueError, match="same tensors"):
        pool_statistics([(1, s), (1, {"a.running_mean": torch.zeros(2)})])


@pytest.mark.parametrize(("stats", "match"), [
    ({"bn.running_mean": torch.zeros(4)}, r"missing \['bn.running_var'\]"),
    ({"bn.running_mean": torch.zeros(3), "bn.running_var": torch.ones(4)}, r"'bn.running_mean': shape \(3,\)"),
    ({"bn.running_mean": torch.full((4,), float("nan")), "bn.running_var": torch.ones(4)}, "not finite"),
    ({"bn.running_mean": torch.zeros(4), "bn.running_var": -torch.ones(4)}, "a negative variance"),
])
def test_statistics_that_do_not_fit_the_model_are_refused_by_name(stats, match):
    model = {"bn.weight": torch.ones(4), "bn.running_mean": torch.zeros(4), "bn.running_var": torch.ones(4)}
    with pytest.raises(NormStatsError, match=match):
        check_statistics(stats, model)


def test_the_answer_round_trips_exactly():
    s = {"bn.running_mean": torch.randn(6), "bn.running_var": torch.rand(6)}
    n, back = read_norm_stats(norm_stats_content(s, num_examples=40, compute_s=0.1), max_elements=6)
    assert n == 40 and all(torch.equal(back[k], s[k]) for k in s)


def test_the_plan_sends_no_statistics_under_global():
    sd = build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0).state_dict()
    plan = UpdatePlan.build(UpdateConfig(compressor="powersgd", norm_stats="global"), sd)
    stats = [e for e in plan.entries if e.role == "statistic"]
    assert stats and all(e.codec == "server" and e.bytes == 0 for e in stats)
    decoded = UpdatePlan.build(UpdateConfig(compressor="powersgd"), sd)
    # Nor their counters: the server keeps its own (each was a Flower array of its own).
    counters = [e for e in plan.entries if e.name.endswith("num_batches_tracked")]
    assert counters and all(e.role == "integer" and e.codec == "server" and e.bytes == 0 for e in counters)
    assert all(decoded.codec_of(e.name) is None and decoded.entries[[d.name for d in decoded.entries].index(e.name)]
               .bytes == 8 for e in counters)
    assert plan.payload_bytes == decoded.payload_bytes - sum(e.bytes for e in decoded.entries
                                                             if e.role == "statistic" or e.name in
                                                             {c.name for c in counters})
    assert plan.dense_bytes == decoded.dense_bytes  # the same update in float32, counters as int64


# ------------------------------------------------------------------ through Flower


def test_the_servers_statistics_are_the_pool_of_the_clients_for_its_own_weights(tmp_path):
    run_dir = run_inprocess({**BASE, "results-dir": str(tmp_path)}, num_clients=3)
    lines = _lines(run_dir)
    assert [r.get("norm_stats_clients") for r in lines[1:]] == [3, 3]
    final = torch.load(run_dir / "model.pt")
    cfg = RunConfig.from_mapping({**BASE, "results-dir": str(tmp_path)})
    model = build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    model.load_state_dict(final)
    parts = []
    for pid in range(3):
        x, _ = client_data(cfg, pid, 3, torch.device("cpu"), on_disk=False)
        stats = norm_statistics(model, x, batches=cfg.norm_stats_batches, batch_size=cfg.batch_size,
                                seed=fapp._stats_seed(cfg.seed, pid, 2, 1))
        parts.append((len(x), stats))
    expected = pool_statistics(parts)
    for k, v in expected.items():
        torch.testing.assert_close(final[k], v, rtol=1e-5, atol=1e-6)
    # The counters stay the server's (not sent); the decoded rule averages the clients'.
    counters = [k for k in final if k.endswith("num_batches_tracked")]
    assert counters and all(int(final[k]) == 0 for k in counters)
    # One more exchange: the model goes down twice, and the statistics (not sent with the
    # update) come up in the answers.
    decoded = run_inprocess({**BASE, "norm-stats": "decoded", "results-dir": str(tmp_path / "d")}, num_clients=3)
    d = _lines(decoded)
    assert 1.9 < lines[1]["bytes_down"] / d[1]["bytes_down"] < 2.05
    assert lines[1]["bytes_up"] < 1.2 * d[1]["bytes_up"]
    assert all(int(torch.load(decoded / "model.pt")[k]) > 0 for k in counters)


def test_the_clock_charges_the_second_exchange(tmp_path):
    # Local steps charged by the step (sim-step-s), not as measured: a loaded machine
    # (CI's two pytest processes) once made the run without the exchange slower than this.
    timed = {**BASE, "netem": "4g", "sim-step-s": 0.01}
    a = _lines(run_inprocess({**timed, "results-dir": str(tmp_path / "a")}, num_clients=3))
    b = _lines(run_inprocess({**timed, "norm-stats": "trained", "results-dir": str(tmp_path / "b")}, num_clients=3))
    # 4g: at least one more round trip (2 x 25 ms one way) and the model's download again.
    assert a[1]["sim_s"] > b[1]["sim_s"] + 0.05


def _app_with(query_mods=()) -> ClientApp:
    app = ClientApp()
    app.train(mods=[fapp.run_config_mods])(fapp.train)
    app.query()(fapp.node_info)
    if query_mods is not None:
        app.query(keys.NORM_STATS_ACTION, mods=list(query_mods))(fapp.norm_stats)
    return app


def test_a_bad_answer_is_left_out_and_reported_and_the_run_goes_on(tmp_path, caplog):
    def negative_for_partition_1(msg: Message, context: Context, call_next):  # noqa: ANN001, ANN202
        reply = call_next(msg, context)
        if int(context.node_config["partition-id"]) == 1:
            n, stats = read_norm_stats(reply.content, max_elements=10**6)
            reply.content = norm_stats_content({k: -1 - v for k, v in stats.items()}, num_examples=n)
        return reply

    caplog.set_level(logging.WARNING)
    run_dir = run_inprocess({**BASE, "results-dir": str(tmp_path)}, num_clients=3,
                            client_app=_app_with([negative_for_partition_1]))
    lines = _lines(run_dir)
    assert [r["norm_stats_clients"] for r in lines[1:]] == [2, 2]
    said = [r.getMessage() for r in caplog.records if "norm-stats answer was left out" in r.getMessage()]
    assert len(said) == 2 and all("a negative variance" in m for m in said), said


def test_clients_that_do_not_answer_stop_the_run_at_round_one_by_name(tmp_path):
    with pytest.raises(NormStatsQueryError, match=r"norm-stats=global: no client answered the 'query.norm_stats' "
                                                  r"message in round 1 .*@app.query\('norm_stats'\)"):
        run_inprocess({**BASE, "results-dir": str(tmp_path)}, num_clients=2, client_app=_app_with(None))


def test_a_client_and_server_that_disagree_are_refused_by_name():
    from fededge.strategies.compressed import CodecMismatchError, _check_plan

    sd = dict(build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0).state_dict())
    floats = {k: v.float() for k, v in sd.items() if v.is_floating_point()}
    from fededge.compress.update import UpdateEncoder

    def payloads(cfg):
        return UpdateEncoder(cfg).encode({k: torch.zeros_like(v) for k, v in floats.items()}, round=0)

    glob, dec = UpdateConfig(compressor="signsgd", norm_stats="global"), UpdateConfig(compressor="signsgd")
    with pytest.raises(CodecMismatchError, match=r"is missing; this server's plan gives it codec 'raw' \(a client "
                                                 r"with norm-stats=global sends no statistics\)"):
        _check_plan(payloads(glob), {}, sd, dec)
    with pytest.raises(CodecMismatchError, match=r"came in codec 'raw'; this server's plan gives it no payload "
                                                 r"\(norm-stats=global"):
        _check_plan(payloads(dec), {}, sd, glob)


@pytest.mark.parametrize(("mapping", "match"), [
    ({"strategy": "dga", "norm-stats": "global"}, r"'norm-stats' = 'global' is for strategies on Flower's round loop"),
    ({"strategy": "gossip", "norm-stats": "global"}, r"'norm-stats' = 'global'"),
    ({"strategy": "fedbuff", "norm-stats": "global"}, r"'norm-stats' = 'global'"),
])
def test_strategies_with_their_own_loop_refuse_it(mapping, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_mapping(mapping)


def test_the_wrapper_refuses_what_it_cannot_wrap():
    from flwr.serverapp.strategy import FedAvg

    from fededge.strategies.dga import DGA

    with pytest.raises(TypeError, match="wraps a flwr.serverapp.strategy.Strategy"):
        NormCalibrated(object())
    with pytest.raises(ValueError, match="runs its own"):
        NormCalibrated(DGA())
    with pytest.raises(ValueError, match="batches must be an integer >= 1"):
        NormCalibrated(FedAvg(), batches=0)


def test_counters_sent_to_a_server_that_keeps_its_own_are_refused_by_name_and_kept_when_not_sent():
    from fededge.compress.update import UpdateEncoder
    from fededge.protocol import bundle_record
    from fededge.strategies.compressed import CodecMismatchError, CompressionStats, _check_plan, decode_compressed
    from flwr.app import RecordDict

    sd = dict(build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0).state_dict())
    sd = {k: (v + 7 if k.endswith("num_batches_tracked") else v) for k, v in sd.items()}
    floats = {k: v.float() for k, v in sd.items() if v.is_floating_point()}
    counters = {k: v + 5 for k, v in sd.items() if k.endswith("num_batches_tracked")}
    glob = UpdateConfig(compressor="signsgd", norm_stats="global")
    payloads = UpdateEncoder(glob).encode({k: torch.zeros_like(v) for k, v in floats.items()}, round=0)
    with pytest.raises(CodecMismatchError, match=r"tensor '.*num_batches_tracked' came as it is \(uncompressed\); "
                                                 r"this server's plan sends it not at all \(norm-stats=global: the "
                                                 r"server keeps its own\)"):
        _check_plan(payloads, counters, sd, glob)
    _check_plan(payloads, {}, sd, glob)
    out = decode_compressed(RecordDict({keys.COMPRESSED: bundle_record(payloads)}), sd, CompressionStats(),
                            expect=glob, server_round=1)
    got = {k: torch.from_numpy(v.numpy()) for k, v in out[keys.ARRAYS].items()}
    assert all(torch.equal(got[k], sd[k]) for k in counters)  # the server's own, not the client's
    # A server without the config cannot tell: the update lacks tensors.
    from fededge.compress import MalformedPayloadError

    with pytest.raises(MalformedPayloadError, match="of the model is missing from the update"):
        decode_compressed(RecordDict({keys.COMPRESSED: bundle_record(payloads)}), sd, CompressionStats())
