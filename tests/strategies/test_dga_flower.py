"""DGA through Flower (strategy + ClientApp), in-process: the same rule as the pure module."""

import json

import pytest
import torch

from fededge.config import ConfigError, RunConfig
from fededge.server.inprocess import run_inprocess
from .apps import failing_once, losing_state_once
from fededge.strategies.dga import DGA

BASE = {"num-rounds": 5, "local-steps": 4, "progress": "off"}


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same_models(a, b) -> None:
    ma, mb = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k


@pytest.mark.parametrize(("pipeline", "keep"), [("on", False), ("off", False), ("on", True)])
def test_zero_delay_is_fedavg_bit_for_bit(tmp_path, pipeline, keep):
    """D = 0 reproduces synchronous local SGD (Flower's FedAvg, K local steps) exactly,
    also with the clients' momentum kept across rounds (keep-momentum, on both sides)."""
    base = {**BASE, "keep-momentum": keep}
    fedavg = run_inprocess({**base, "results-dir": str(tmp_path / "fedavg")}, num_clients=4)
    dga = run_inprocess({**base, "strategy": "dga", "dga-delay": 0, "dga-pipeline": pipeline,
                         "results-dir": str(tmp_path / "dga")}, num_clients=4)
    _same_models(fedavg, dga)
    a, b = _lines(fedavg), _lines(dga)
    assert [r["accuracy"] for r in a] == [r["accuracy"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert all(r["staleness"] == 0 and r["dga_delay"] == 0 for r in b[1:])


def test_pipelined_and_lockstep_train_the_same_model(tmp_path):
    over = {**BASE, "strategy": "dga", "dga-delay": 2, "netem": "4g"}
    on = run_inprocess({**over, "dga-pipeline": "on", "results-dir": str(tmp_path / "on")}, num_clients=3)
    off = run_inprocess({**over, "dga-pipeline": "off", "results-dir": str(tmp_path / "off")}, num_clients=3)
    _same_models(on, off)
    a, b = _lines(on), _lines(off)
    assert [r["accuracy"] for r in a] == [r["accuracy"] for r in b]
    assert [r["pipelined"] for r in a[1:]] == [True] * 5 and [r["pipelined"] for r in b[1:]] == [False] * 5


def test_delay_shows_in_staleness_bytes_and_the_clock(tmp_path):
    # sim-step-s: a fixed compute charge, so the clock's comparison below does not depend
    # on how busy the machine is (the suite runs beside other tests).
    over = {**BASE, "num-rounds": 6, "strategy": "dga", "dga-delay": 2, "netem": "4g", "sim-step-s": 0.02}
    run = _lines(run_inprocess({**over, "results-dir": str(tmp_path / "dga")}, num_clients=3))
    sync = _lines(run_inprocess({**over, "strategy": "fedavg", "results-dir": str(tmp_path / "fedavg")},
                                num_clients=3))
    # Round t starts from G(t-1-D): its clients have min(t-1, D) own rounds in flight.
    assert [r["staleness"] for r in run[1:]] == [0, 1, 2, 2, 2, 2]
    assert [r["staleness_steps"] for r in run[1:]] == [0, 4, 8, 8, 8, 8]
    assert [r["dga_global_round"] for r in run[1:]] == [0, 0, 0, 1, 2, 3]
    assert all(r["num_clients"] == 3 and r["failures"] == 0 for r in run[1:])
    # Rounds 2 and 3 carry no new global model: a config only, not ~0.38 MB per client.
    model_down = run[1]["bytes_down"]
    assert model_down > 3 * 300_000
    assert run[2]["bytes_down"] < model_down / 100 and run[3]["bytes_down"] < model_down / 100
    assert all(abs(r["bytes_down"] - model_down) < 1000 for r in run[4:])
    assert all(abs(r["bytes_up"] - s["bytes_up"]) < 1000 for r, s in zip(run[1:], sync[1:]))
    # 4g: 0.38 MB up at 6.3 Mbit/s is ~0.48 s a round either way; FedAvg adds the download
    # and both latencies every round, DGA overlaps them (and the compute) with the upload.
    dga_round = (run[-1]["sim_s"] - run[1]["sim_s"]) / 5
    fedavg_round = (sync[-1]["sim_s"] - sync[1]["sim_s"]) / 5
    upload = run[2]["bytes_up"] / 3 * 8 / 6.3e6
    assert upload <= dga_round < fedavg_round - 0.15, (dga_round, fedavg_round, upload)


def test_without_correction_all_clients_hold_the_stale_global_model(tmp_path):
    over = {**BASE, "strategy": "dga", "dga-delay": 2, "dga-correction": False}
    with_c = run_inprocess({**over, "dga-correction": True, "results-dir": str(tmp_path / "c")}, num_clients=3)
    without = run_inprocess({**over, "results-dir": str(tmp_path / "n")}, num_clients=3)
    a, b = _lines(with_c), _lines(without)
    assert a[1]["accuracy"] == b[1]["accuracy"]  # round 1 is the same in both
    assert a[3]["accuracy"] != b[3]["accuracy"]  # from round 2 on, the correction matters


@pytest.mark.parametrize("pipeline", ["on", "off"])
def test_a_failed_client_is_left_out_and_rejoins(tmp_path, pipeline):
    run_dir = run_inprocess({**BASE, "num-rounds": 6, "strategy": "dga", "dga-delay": 1,
                             "dga-pipeline": pipeline, "results-dir": str(tmp_path)},
                            num_clients=3, client_app=failing_once(1, 2))
    lines = _lines(run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    clients = [r["num_clients"] for r in lines[1:]]
    failures = [r["failures"] for r in lines[1:]]
    # Round 2 fails on partition 1. Its round-3 message names a global model it does not
    # hold (the round-2 message brought it, and failed): refused, then resynchronised.
    assert failures[1] == 1 and sum(failures) <= 3, failures
    assert clients[-1] == 3 and clients[-2] == 3, clients


def test_bad_dga_settings_are_named():
    with pytest.raises(ConfigError, match="'dga-delay': delay must be >= 0"):
        RunConfig.from_mapping({"strategy": "dga", "dga-delay": -1})
    with pytest.raises(ConfigError, match="'dga-pipeline': pipeline must be one of auto, on, off"):
        RunConfig.from_mapping({"strategy": "dga", "dga-pipeline": "yes"})
    with pytest.raises(ConfigError, match="'downlink-compressor' with strategy='dga' needs a 'compressor'"):
        RunConfig.from_mapping({"strategy": "dga", "downlink-compressor": "fp16"})
    RunConfig.from_mapping({"strategy": "dga", "compressor": "qsgd"})  # uplink compression is fine
    RunConfig.from_mapping({"strategy": "dga", "compressor": "raw", "downlink-compressor": "bf16"})


def test_pipelining_on_a_grid_that_may_run_two_messages_at_once_is_refused():
    class RayLike:
        runs_messages_in_order = False

    with pytest.raises(ValueError, match="dga-pipeline=on needs a grid that runs each node's messages in order"):
        DGA(delay=1, pipeline="on").start(RayLike(), initial_arrays=None)  # type: ignore[arg-type]


# ------------------------------------------------------------------ compressed uplinks


@pytest.mark.parametrize("pipeline", ["on", "off"])
def test_dga_with_a_lossless_codec_trains_the_uncompressed_model(tmp_path, pipeline):
    """compressor="raw" sends Δ(t) exactly; the server rebuilds G(g) + Δ(t) in float32,
    the client sent G(g) + Δ(t) computed as (model after K steps) - (own updates in
    flight): equal up to float32 rounding, whichever rounds carry no arrays."""
    over = {**BASE, "strategy": "dga", "dga-delay": 2, "dga-pipeline": pipeline}
    plain = run_inprocess({**over, "results-dir": str(tmp_path / "plain")}, num_clients=3)
    raw = run_inprocess({**over, "compressor": "raw", "results-dir": str(tmp_path / "raw")}, num_clients=3)
    ma, mb = torch.load(plain / "model.pt"), torch.load(raw / "model.pt")
    for k in ma:
        torch.testing.assert_close(mb[k], ma[k], rtol=1e-5, atol=1e-6)
    a, b = _lines(plain), _lines(raw)
    assert [r["accuracy"] for r in a] == pytest.approx([r["accuracy"] for r in b], abs=0.01)
    assert all(r["compression_ratio"] == pytest.approx(1.0, abs=1e-3) for r in b[1:])
    assert [r["staleness"] for r in b[1:]] == [0, 1, 2, 2, 2]


def test_dga_with_topk_sends_less_shortens_rounds_and_learns(tmp_path):
    # sim-step-s: a fixed compute charge, so the comparison of the clock's rounds below
    # does not depend on how busy the machine is (the suite runs beside other tests).
    over = {**BASE, "num-rounds": 8, "strategy": "dga", "dga-delay": 2, "netem": "4g", "sim-step-s": 0.02}
    plain = _lines(run_inprocess({**over, "results-dir": str(tmp_path / "plain")}, num_clients=3))
    on = run_inprocess({**over, "compressor": "topk", "topk-ratio": 0.01, "error-feedback": True,
                        "results-dir": str(tmp_path / "on")}, num_clients=3)
    off = run_inprocess({**over, "compressor": "topk", "topk-ratio": 0.01, "error-feedback": True,
                         "dga-pipeline": "off", "results-dir": str(tmp_path / "off")}, num_clients=3)
    _same_models(on, off)  # error feedback's residuals and DGA's history agree in both loops
    comp = _lines(on)
    assert all(r["compression_ratio"] > 40 for r in comp[1:])
    assert all(r["bytes_up"] < p["bytes_up"] / 20 for r, p in zip(comp[1:], plain[1:]))
    # 4g: the upload no longer bounds a DGA round (0.38 MB at 6.3 Mbit/s, ~0.48 s).
    per_round = [(x[-1]["sim_s"] - x[1]["sim_s"]) / 7 for x in (plain, comp)]
    assert per_round[1] < per_round[0] - 0.3, per_round
    # It learns, if slowly: 1% of the coordinates a round over 8 rounds of 4 steps.
    assert comp[-1]["loss"] < comp[0]["loss"] - 0.02 and comp[-1]["accuracy"] > comp[0]["accuracy"] + 0.05
    assert [r["staleness"] for r in comp[1:]] == [0, 1, 2, 2, 2, 2, 2, 2]


def test_a_malformed_dga_update_is_rejected_and_the_client_rejoins(tmp_path):
    from flwr.app import Array, Context, Message
    from flwr.clientapp import ClientApp

    from fededge.clients.app import train as fededge_train
    from fededge.clients.app import run_config_mods
    from fededge.keys import COMPRESSED

    def corrupt_round_3(msg: Message, context: Context, call_next):  # noqa: ANN001, ANN202
        reply = call_next(msg, context)
        if (int(context.node_config["partition-id"]) == 1 and COMPRESSED in reply.content
                and int(msg.content["config"]["server-round"]) == 3):
            rec = reply.content[COMPRESSED]
            name = next(iter(rec.keys()))
            rec[name] = Array(rec[name].numpy()[:-3].copy())
        return reply

    app = ClientApp()
    app.train(mods=[corrupt_round_3, run_config_mods])(fededge_train)
    run_dir = run_inprocess({**BASE, "num-rounds": 6, "strategy": "dga", "dga-delay": 1, "compressor": "topk",
                             "topk-ratio": 0.1, "error-feedback": True, "results-dir": str(tmp_path)},
                            num_clients=3, client_app=app)
    lines = _lines(run_dir)
    assert [r["rejected"] for r in lines[1:]] == [0, 0, 1, 0, 0, 0]
    assert [r["num_clients"] for r in lines[1:]][2] == 2
    assert lines[-1]["num_clients"] == 3  # resynchronised with the next global model
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["total_rejected"] == 1


def test_dga_downlink_cast_halves_the_model_messages_and_keeps_the_exact_global_model(tmp_path):
    over = {**BASE, "num-rounds": 6, "strategy": "dga", "dga-delay": 2, "compressor": "raw"}
    full = _lines(run_inprocess({**over, "results-dir": str(tmp_path / "full")}, num_clients=3))
    run = run_inprocess({**over, "downlink-compressor": "fp16", "results-dir": str(tmp_path / "fp16")},
                        num_clients=3)
    half = _lines(run)
    # Rounds 1 and 4-6 carry G(g): about half the bytes; rounds 2-3 carry a config only.
    for r, f in zip(half[1:], full[1:]):
        if f["bytes_down"] > 300_000:
            assert 0.45 < r["bytes_down"] / f["bytes_down"] < 0.55, (r["bytes_down"], f["bytes_down"])
        else:
            assert abs(r["bytes_down"] - f["bytes_down"]) < 1000
    # The clients start from the rounded G(g), the server keeps the exact one: the run
    # trains like the uncast one, not identically.
    assert [r["accuracy"] for r in half] == pytest.approx([r["accuracy"] for r in full], abs=0.05)
    assert half[-1]["loss"] < half[0]["loss"] and half[-1]["compression_ratio"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("pipeline", ["on", "off"])
def test_computing_ahead_trains_the_same_model_bit_for_bit(tmp_path, pipeline):
    """dga-compute-ahead only moves each round's content into the previous round's message
    (a preview; fededge.clients.preview): the same models, metrics and bytes in all
    (but the previews' few config bytes), with a warm-up and error feedback."""
    over = {**BASE, "num-rounds": 6, "strategy": "dga", "dga-delay": 2, "dga-warmup-rounds": 1,
            "compressor": "topk", "error-feedback": True, "dga-pipeline": pipeline}
    plain = run_inprocess({**over, "results-dir": str(tmp_path / "plain")}, num_clients=3)
    ahead = run_inprocess({**over, "dga-compute-ahead": True, "results-dir": str(tmp_path / "ahead")},
                          num_clients=3)
    _same_models(plain, ahead)
    a, b = _lines(plain), _lines(ahead)
    for k in ("accuracy", "loss", "staleness", "dga_global_round", "bytes_up"):
        assert [r.get(k) for r in a] == [r.get(k) for r in b], k
    down = [sum(r["bytes_down"] for r in x) for x in (a, b)]
    assert 0 < down[1] - down[0] < 3 * 6 * 400, down  # each message's preview config, a few hundred bytes
    # The contents moved: round 5's G(2) came with round 4's message. Round 5 is a
    # checkpoint (checkpoint-every=5), past which nothing is sent early: round 6 in full.
    assert b[5]["bytes_down"] < a[5]["bytes_down"] / 10 and b[4]["bytes_down"] > a[4]["bytes_down"] * 10
    assert b[6]["bytes_down"] == a[6]["bytes_down"]


@pytest.mark.parametrize("delay", [1, 2])
def test_a_node_that_lost_its_preview_is_refused_by_name_and_resynchronised(tmp_path, delay):
    run_dir = run_inprocess({**BASE, "num-rounds": 6, "strategy": "dga", "dga-delay": delay,
                             "dga-compute-ahead": True, "results-dir": str(tmp_path)},
                            num_clients=3, client_app=losing_state_once(1, 3))
    lines = _lines(run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    failures = [r["failures"] for r in lines[1:]]
    clients = [r["num_clients"] for r in lines[1:]]
    # Round 3's message refers to the preview partition 1 no longer holds: an error reply
    # naming it. With D = 1 round 4 is pushed after that error and brings everything
    # again; with D = 2 it was pushed before, as a reference to the preview round 3's
    # message brought, which the node kept.
    assert failures == [0, 0, 1, 0, 0, 0], failures
    assert clients == [3, 3, 2, 3, 3, 3], clients
