"""Gossip (D-PSGD, CHOCO-SGD) through Flower, in-process: the relay reproduces the pure
rules, learns, measures honestly, refuses bad settings and survives a failing node."""

import json

import pytest
import torch

from fededge.config import ConfigError, RunConfig
from fededge.server.inprocess import run_inprocess
from .apps import failing_once
from fededge.topology import TopologyError

BASE = {"strategy": "gossip", "num-rounds": 3, "local-steps": 4, "progress": "off"}


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _max_diff(a, b) -> float:
    ma, mb = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    assert ma.keys() == mb.keys()
    return max(float((ma[k].double() - mb[k].double()).abs().max()) for k in ma)


def test_complete_graph_uniform_dpsgd_round_is_fedavg(tmp_path):
    """One round on the complete graph with max-degree weights (J/n) is the average of the
    trained models: FedAvg's model. Not bit for bit (about a quarter of the entries differ,
    by at most ~6e-8): FedAvg weights by examples (equal here, 479 each with iid on 3
    clients) and sums in numpy in its sampled node order, gossip sums x_j * W_ij in torch
    in node order, and W's diagonal is 1 - 2/3, one ulp off the 1/3 off the diagonal."""
    over = {"num-rounds": 1, "local-steps": 5, "partition": "iid"}
    fedavg = run_inprocess({**over, "progress": "off", "results-dir": str(tmp_path / "f")}, num_clients=3)
    gossip = run_inprocess({**BASE, **over, "topology": "complete", "mixing": "max-degree",
                            "results-dir": str(tmp_path / "g")}, num_clients=3)
    assert _max_diff(fedavg, gossip) < 1e-6
    f, g = _lines(fedavg)[1], _lines(gossip)[1]
    assert g["accuracy"] == pytest.approx(f["accuracy"], abs=1e-9)
    # Every node holds the average after mixing: no spread, no disagreement.
    assert g["node_accuracy_min"] == g["node_accuracy_max"] == pytest.approx(g["accuracy"])
    assert g["consensus_distance"] < 1e-10
    assert _lines(gossip)[0]["spectral_gap"] == pytest.approx(1.0)


def test_choco_lossless_with_gamma_one_is_dpsgd(tmp_path):
    over = {**BASE, "topology": "ring", "num-rounds": 3}
    dpsgd = run_inprocess({**over, "results-dir": str(tmp_path / "d")}, num_clients=4)
    choco = run_inprocess({**over, "gossip-algorithm": "choco", "gossip-gamma": 1.0,
                           "results-dir": str(tmp_path / "c")}, num_clients=4)
    # x̂_j = x0 + (y_j - x0) is y_j up to float32 rounding, which SGD then carries along.
    assert _max_diff(dpsgd, choco) < 1e-4
    for a, b in zip(_lines(dpsgd)[1:], _lines(choco)[1:]):
        assert b["consensus_distance"] == pytest.approx(a["consensus_distance"], rel=1e-3)
        assert b["node_accuracy_mean"] == pytest.approx(a["node_accuracy_mean"], abs=0.01)
        # CHOCO sends differences (the same size uncompressed) plus the model for
        # evaluation, which is counted apart and not in bytes_up.
        assert b["bytes_eval_up"] > 0 and a["bytes_eval_up"] == 0
        assert b["bytes_up"] == pytest.approx(a["bytes_up"], rel=0.01)


def test_ring_learns_and_reports_the_spread_and_the_traffic(tmp_path):
    run = _lines(run_inprocess({**BASE, "num-rounds": 6, "local-steps": 10, "netem": "4g",
                                "results-dir": str(tmp_path)}, num_clients=4))
    first = run[0]
    assert first["topology"] == "ring" and first["topology_n"] == 4 and first["mixing"] == "metropolis"
    assert first["spectral_gap"] == pytest.approx(2 / 3) and "spectral gap" in first["topology_summary"]
    assert run[-1]["loss"] < first["loss"] - 0.3 and run[-1]["accuracy"] > 0.5
    for r in run[1:]:
        assert r["num_clients"] == 4 and r["failures"] == 0 and r["gossip_failed"] == []
        assert r["node_accuracy_min"] <= r["node_accuracy_mean"] <= r["node_accuracy_max"]
        assert r["consensus_distance"] > 0
        assert r["round_sim_s"] > 0
    # A ring of 4: every message goes to 2 neighbours. The relay takes each message up
    # once and down twice (from round 2: round 1's downlink is the initial model).
    for r in run[2:]:
        assert r["bytes_p2p"] == pytest.approx(2 * r["bytes_up"], rel=0.01)
        assert r["bytes_down"] == pytest.approx(r["bytes_p2p"], rel=0.01)


def test_choco_topk_sends_a_fraction_of_dpsgd(tmp_path):
    over = {**BASE, "num-rounds": 2}
    d = _lines(run_inprocess({**over, "results-dir": str(tmp_path / "d")}, num_clients=4))
    c = _lines(run_inprocess({**over, "gossip-algorithm": "choco", "compressor": "topk", "topk-ratio": 0.01,
                              "results-dir": str(tmp_path / "c")}, num_clients=4))
    assert c[2]["bytes_p2p"] < d[2]["bytes_p2p"] / 20
    assert c[2]["bytes_up"] < d[2]["bytes_up"] / 20


def test_choco_scaled_sign_learns_at_one_bit_per_element(tmp_path):
    """The benchmark's best CHOCO codec (scaled sign, gamma 0.8): each node's message is
    about 1 bit per weight, so the relay carries ~1/32 of the float32 models per round,
    and the ring still learns."""
    run_dir = run_inprocess({**BASE, "num-rounds": 6, "local-steps": 10, "gossip-algorithm": "choco",
                             "compressor": "signsgd", "gossip-gamma": 0.8,
                             "results-dir": str(tmp_path)}, num_clients=4)
    run = _lines(run_dir)
    numel = sum(v.numel() for v in torch.load(run_dir / "model.pt").values())
    for r in run[1:]:
        assert r["gossip_failed"] == [] and r["failures"] == 0
        # 4 messages a round: 1 bit per weight, one scale per tensor, headers and framing.
        assert 4 * numel / 8 < r["bytes_up"] < 4 * 4 * numel / 25
    assert run[-1]["loss"] < run[0]["loss"] - 0.3 and run[-1]["accuracy"] > 0.5


@pytest.mark.parametrize("over, match", [
    ({"compressor": "topk"}, "use gossip-algorithm='choco'"),
    ({"gossip-algorithm": "choco", "topology": "one-peer-exponential"}, "assume a static graph"),
    ({"gossip-algorithm": "choco", "compressor": "dgc"}, "'compressor' with gossip-algorithm='choco': compressor 'dgc' keeps encoder state"),
    ({"gossip-algorithm": "choco", "compressor": "topk", "error-feedback": True}, "'error-feedback' with gossip-algorithm='choco': error_feedback must be false"),
    ({"clients-per-round": 2}, "'clients-per-round' must be 1.0"),
    ({"fraction-evaluate": 0.5}, "'fraction-evaluate' must be 0"),
    ({"downlink-compressor": "fp16"}, "'downlink-compressor' must be 'none'"),
    ({"topology": "file"}, "'topology-file': topology='file' needs topology_file, a file"),
    ({"topology": "rings"}, "'topology': topology must be one of ring"),
    ({"mixing": "uniform"}, "'mixing': mixing must be one of metropolis, max-degree"),
    ({"gossip-algorithm": "sgp"}, "'gossip-algorithm': algorithm must be one of dpsgd, choco"),
    ({"gossip-gamma": 0.0}, r"'gossip-gamma': gamma must be in \(0, 1\]"),
    ({"topology-p": 1.5}, r"'topology-p': topology_p must be in \[0, 1\]"),
])
def test_bad_gossip_settings_are_named(over, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_mapping({"strategy": "gossip", **over})


def test_an_impossible_topology_stops_the_run_before_training(tmp_path):
    with pytest.raises(TopologyError, match="hypercube: n=6 is not a power of two"):
        run_inprocess({**BASE, "topology": "hypercube", "results-dir": str(tmp_path)}, num_clients=6)
    (run_dir,) = list(tmp_path.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "TopologyError" in summary["error"]
    assert (run_dir / "metrics.jsonl").read_text() == ""  # not even round 0


def test_topology_keys_reach_the_graph(tmp_path):
    edges = tmp_path / "edges.txt"
    edges.write_text("0 1\n1 2\n2 3\n# a path\n")
    run = _lines(run_inprocess({**BASE, "num-rounds": 1, "topology": "file", "topology-file": str(edges),
                                "results-dir": str(tmp_path / "r")}, num_clients=4))
    assert run[0]["topology_edges"] == 3 and run[1]["num_clients"] == 4


@pytest.mark.parametrize("algorithm, at_round", [("dpsgd", 2), ("choco", 2), ("choco", 1)])
def test_a_failing_node_is_left_out_and_the_run_goes_on(tmp_path, algorithm, at_round):
    """D-PSGD: its neighbours move its weight to their own model. CHOCO: its missing q is a
    zero update for everyone, and the node gets the relay's estimates back."""
    over = {**BASE, "num-rounds": 4, "gossip-algorithm": algorithm, "gossip-gamma": 0.5,
            "results-dir": str(tmp_path)}
    run_dir = run_inprocess(over, num_clients=4, client_app=failing_once(1, at_round))
    lines = _lines(run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert [r["num_clients"] for r in lines[1:]] == [4 if t != at_round else 3 for t in (1, 2, 3, 4)]
    assert [len(r["gossip_failed"]) for r in lines[1:]] == [int(t == at_round) for t in (1, 2, 3, 4)]
    assert lines[at_round]["failures"] == 1
    assert all(r["loss"] == r["loss"] and r["consensus_distance"] < 10 for r in lines)  # finite, sane


@pytest.mark.parametrize("algorithm", ["dpsgd", "choco"])
def test_a_node_that_lost_its_state_gets_a_model_and_rejoins(tmp_path, algorithm):
    """A SuperNode that restarted holds no model: its message of that round fails, and the
    relay, which sent a model only until a node had completed a round, never sent one
    again (the node failed every later round, the run still 'completed')."""
    from .apps import losing_state_once

    over = {**BASE, "num-rounds": 5, "gossip-algorithm": algorithm, "gossip-gamma": 0.5,
            "results-dir": str(tmp_path)}
    run_dir = run_inprocess(over, num_clients=4, client_app=losing_state_once(1, 3))
    lines = _lines(run_dir)
    assert [len(r["gossip_failed"]) for r in lines[1:]] == [0, 0, 1, 0, 0]
    assert [r["num_clients"] for r in lines[1:]] == [4, 4, 3, 4, 4]


@pytest.mark.parametrize("algorithm", ["dpsgd", "choco"])
def test_a_reply_with_a_tensor_of_another_shape_is_left_out_not_mixed(tmp_path, algorithm):
    """D-PSGD's relay checked the tensors' names only: a flattened weight stopped the run
    in the relay's mixing (CHOCO's evaluation copy the same)."""
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    from fededge import keys
    from fededge.arrays import record_from_torch, record_to_torch
    from fededge.clients.app import run_config_mods
    from fededge.clients.app import train as fededge_train

    app = ClientApp()
    record = keys.GOSSIP_MESSAGE if algorithm == "dpsgd" else keys.GOSSIP_EVAL_ARRAYS

    def tamper(msg: Message, context: Context, call_next):  # noqa: ANN001, ANN202 - outside the gossip mod
        reply = call_next(msg, context)
        if int(context.node_config[keys.PARTITION_ID]) == 1 and int(msg.content[keys.CONFIG][keys.SERVER_ROUND]) == 2:
            w = dict(record_to_torch(reply.content[record]))
            k = next(k for k, v in w.items() if v.ndim == 2)
            w[k] = w[k].reshape(-1)  # the same elements, another shape
            reply.content[record] = record_from_torch(w)
        return reply

    @app.train(mods=[tamper, run_config_mods])
    def train(msg: Message, context: Context) -> Message:
        return fededge_train(msg, context)

    run_dir = run_inprocess({**BASE, "num-rounds": 3, "gossip-algorithm": algorithm, "results-dir": str(tmp_path)},
                            num_clients=4, client_app=app)
    lines = _lines(run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert [r["rejected"] for r in lines[1:]] == [0, 1, 0]


def test_choco_on_a_time_varying_graph_is_refused_by_the_library_too():
    """Only the run config refused it: a library Gossip(algorithm='choco',
    topology='one-peer-exponential') failed every node from round 3."""
    from fededge.strategies.gossip import Gossip

    with pytest.raises(ValueError, match="changes peers every round, but CHOCO's public estimates"):
        Gossip(algorithm="choco", topology="one-peer-exponential")


def test_one_peer_exponential_sends_one_message_per_node(tmp_path):
    """The time-varying graph: each round every node hears one peer (2^(t mod 2) away for
    n = 4), so the relay forwards one model per node and p2p is one copy per message."""
    run = _lines(run_inprocess({**BASE, "topology": "one-peer-exponential",
                                "results-dir": str(tmp_path)}, num_clients=4))
    assert run[0]["topology"] == "one-peer-exponential"
    for r in run[2:]:
        assert r["num_clients"] == 4 and r["consensus_distance"] > 0
        assert r["bytes_p2p"] == pytest.approx(r["bytes_up"], rel=0.01)
        assert r["bytes_down"] == pytest.approx(r["bytes_p2p"], rel=0.01)


def test_a_library_gossip_refuses_a_checkpoint_of_another_graph_or_step():
    """Only the algorithm and the topology's name were compared: a library user resuming
    with another seed (another random graph), topology parameters, mixing or gamma was
    not refused (fededge's CLI compares the run config)."""
    from fededge.strategies.gossip import Gossip
    from fededge.strategies.resume import ResumeError

    saved = Gossip(topology="erdos-renyi", seed=1).settings()
    for other in (dict(seed=2), dict(mixing="max-degree"), dict(gamma=0.3, algorithm="choco"),
                  dict(topology_params={"p": 0.9})):
        mine = Gossip(**{"topology": "erdos-renyi", "seed": 1, **other})
        with pytest.raises(ResumeError, match="the checkpoint ran with"):
            mine.load_state_dict({"settings": dict(saved), "round": 1, "attrs": {}})
    # A checkpoint from before these settings were compared (algorithm and topology only) loads.
    old = {k: v for k, v in saved.items() if k in ("algorithm", "topology_name")}
    Gossip(topology="erdos-renyi", seed=2).load_state_dict({"settings": old, "round": 1, "attrs": {}})


def test_a_topology_file_edited_since_the_checkpoint_is_refused_on_resume(tmp_path):
    """The settings name the topology file, not what it holds: a file edited between the
    checkpoint and the resume mixed other neighbours' models without a word."""
    edges = tmp_path / "edges.txt"
    edges.write_text("0 1\n1 2\n2 3\n")
    conf = {**BASE, "num-rounds": 2, "topology": "file", "topology-file": str(edges), "checkpoint-every": 1,
            "results-dir": str(tmp_path / "r")}
    run_dir = run_inprocess(conf, num_clients=4)
    edges.write_text("0 1\n1 2\n2 3\n3 0\n")  # a ring now
    from fededge.strategies.resume import ResumeError

    with pytest.raises(ResumeError, match="another graph than the checkpoint's"):
        run_inprocess({**conf, "num-rounds": 3, "resume-from": str(run_dir)}, num_clients=4)
    edges.write_text("0 1\n1 2\n2 3\n")  # the same graph again: it resumes
    again = run_inprocess({**conf, "num-rounds": 3, "resume-from": str(run_dir)}, num_clients=4)
    assert json.loads((again / "summary.json").read_text())["status"] == "completed"
    assert [r["round"] for r in _lines(again)] == [0, 1, 2, 3]
