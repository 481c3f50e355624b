"""compress-warmup-rounds (issue 36): the first rounds go uncompressed, as torch's PowerSGD
hook runs plain all-reduce before ``start_powerSGD_iter``. Both sides follow the same
UpdateConfig; a client and a server that disagree about a round are refused by name."""

import json

import pytest
import torch
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg

from fededge import keys
from fededge.api import DGA, CodecMismatchError, Compressed, CompressionMod, DGAMod, GossipMod, UpdateConfig
from fededge.compress.plan import UpdatePlan
from fededge.config import ConfigError, RunConfig
from fededge.server.inprocess import run_inprocess
from tests.clients.test_mods import _call
from tests.clients.userapp import client_app, initial_arrays, run

N = 4
TOPK_W2 = UpdateConfig(compressor="topk", topk_ratio=0.25, error_feedback=True, warmup_rounds=2)
BASE = {"num-rounds": 3, "local-steps": 10, "partition": "iid", "progress": "off", "compressor": "powersgd"}


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_round_arithmetic():
    c = UpdateConfig(compressor="dgc", warmup_rounds=3)
    assert [c.compresses(r) for r in (1, 3, 4)] == [False, False, True]
    assert c.encoder_round(4) == 0  # DGC's sparsity warm-up starts at the first compressed round
    assert UpdateConfig(compressor="dgc").encoder_round(1) == 0
    assert not UpdateConfig(warmup_rounds=0).compresses(5)  # compressor none: never


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_warmup_is_refused_by_its_key(bad):
    with pytest.raises(ValueError, match=r"'compress-warmup-rounds': must be an integer >= 0"):
        UpdateConfig(compressor="topk", warmup_rounds=bad)


def test_the_mod_sends_warmup_rounds_as_they_are_and_keeps_no_state_until_the_first_compressed_one():
    mod = CompressionMod(TOPK_W2)
    reply, context = _call([mod], {keys.ARRAYS: initial_arrays(), keys.CONFIG: ConfigRecord({keys.SERVER_ROUND: 2})})
    assert keys.ARRAYS in reply.content and keys.COMPRESSED not in reply.content
    assert keys.STATE_COMPRESS not in context.state
    reply, context = _call([mod], {keys.ARRAYS: initial_arrays(), keys.CONFIG: ConfigRecord({keys.SERVER_ROUND: 3})},
                           context=context)
    assert keys.COMPRESSED in reply.content and keys.STATE_COMPRESS in context.state
    # Round 3 is the encoder's first: the same payloads as a client without warm-up in round 1.
    first, _ = _call([CompressionMod(UpdateConfig(compressor="topk", topk_ratio=0.25, error_feedback=True))],
                     {keys.ARRAYS: initial_arrays(), keys.CONFIG: ConfigRecord({keys.SERVER_ROUND: 1})})
    assert bytes(reply.content[keys.COMPRESSED]["bundle"].data) == bytes(first.content[keys.COMPRESSED]["bundle"].data)


def test_the_library_pair_learns_and_decodes_only_the_rounds_after_the_warmup():
    stats = []

    def strategy(context):
        s = Compressed(FedAvg(fraction_evaluate=0.0, min_available_nodes=N), update=TOPK_W2)
        stats.append(s)
        return s

    history, _ = run(strategy, client_app(app_mods=[CompressionMod(TOPK_W2)]))
    assert history[5][0] < history[0][0] - 0.2
    s = stats[0].take_stats()
    assert (s.decoded, s.rejected) == (3 * N, 0)  # rounds 3, 4, 5 of 5


def test_a_client_without_the_warmup_is_refused_by_name():
    with pytest.raises(CodecMismatchError, match=r"round 1: every client update was refused: client sent a "
                                                 r"compressed update in round 1, a warm-up round of this server "
                                                 r"\(compress-warmup-rounds=2"):
        run(lambda c: Compressed(FedAvg(fraction_evaluate=0.0, min_available_nodes=N), update=TOPK_W2),
            client_app([CompressionMod(UpdateConfig(compressor="topk", topk_ratio=0.25, error_feedback=True))]))


def test_a_server_without_the_warmup_refuses_the_uncompressed_rounds():
    with pytest.raises(CodecMismatchError, match=r"client sent an uncompressed update \('arrays'\), this server "
                                                 r"expects 'topk'"):
        run(lambda c: Compressed(FedAvg(fraction_evaluate=0.0, min_available_nodes=N),
                                 update=UpdateConfig(compressor="topk", topk_ratio=0.25, error_feedback=True)),
            client_app([CompressionMod(TOPK_W2)]))


def test_dga_with_a_compression_warmup_learns():
    history, _ = run(lambda c: DGA(delay=1, fraction_evaluate=0.0, min_available_nodes=N, update=TOPK_W2),
                     client_app([CompressionMod(TOPK_W2), DGAMod()]))
    assert history[5][0] < history[0][0] - 0.2


def test_warmup_rounds_equal_the_uncompressed_run_and_a_warmup_over_every_round_is_fedavg(tmp_path):
    plain = run_inprocess({**BASE, "compressor": "none", "results-dir": str(tmp_path / "a")}, num_clients=3)
    part = run_inprocess({**BASE, "compress-warmup-rounds": 2, "results-dir": str(tmp_path / "b")}, num_clients=3)
    whole = run_inprocess({**BASE, "compress-warmup-rounds": 3, "results-dir": str(tmp_path / "c")}, num_clients=3)
    a, b, c = _lines(plain), _lines(part), _lines(whole)
    assert [r["accuracy"] for r in c] == [r["accuracy"] for r in a]
    ma, mc = torch.load(plain / "model.pt"), torch.load(whole / "model.pt")
    assert all(torch.equal(ma[k], mc[k]) for k in ma)
    assert [r["loss"] for r in b[:3]] == [r["loss"] for r in a[:3]]  # rounds 0, 1, 2: as they are
    assert b[3]["loss"] != a[3]["loss"]  # round 3: PowerSGD
    assert b[2]["bytes_up"] == a[2]["bytes_up"] and b[3]["bytes_up"] < a[3]["bytes_up"] / 3
    conf = json.loads((part / "config.json").read_text())
    assert conf["config"]["compress-warmup-rounds"] == 2


def test_the_plan_says_when_it_starts():
    sd = {"fc.weight": torch.zeros(10, 400)}
    lines = UpdatePlan.build(UpdateConfig(compressor="powersgd", warmup_rounds=4), sd).summary()
    assert lines[-1] == "  rounds 1 to 4 uncompressed (compress-warmup-rounds), the plan from round 5"


@pytest.mark.parametrize(("mapping", "match"), [
    ({"strategy": "gossip", "gossip-algorithm": "choco", "compressor": "signsgd", "compress-warmup-rounds": 1},
     r"'compress-warmup-rounds' is for uplinks to a server; with strategy='gossip'"),
    ({"strategy": "dga", "compressor": "topk", "downlink-compressor": "fp16", "compress-warmup-rounds": 1},
     r"'compress-warmup-rounds' with strategy='dga' and a 'downlink-compressor'"),
    ({"compressor": "topk", "compress-warmup-rounds": -1}, r"'compress-warmup-rounds': must be an integer >= 0"),
])
def test_configurations_that_cannot_work_stop_before_round_one(mapping, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_mapping(mapping)


def test_gossip_mod_refuses_a_warmup():
    with pytest.raises(ValueError, match=r"GossipMod: warmup_rounds=2: CHOCO's public estimates"):
        GossipMod(UpdateConfig(compressor="signsgd", warmup_rounds=2))
