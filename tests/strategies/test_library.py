"""fededge's pieces in a user's own Flower app (issue 16): its own model, data, train
function and run-config keys; fededge's mods on the ClientApp and its strategies or
wrapper on the server. Each pairing trains; a client/server codec mismatch fails by name.
"""

import logging

import pytest
from flwr.serverapp.strategy import FedAdam, FedAvg

from fededge.api import DGA, CodecMismatchError, Compressed, CompressionMod, DGAMod, Gossip, GossipMod, UpdateConfig
from tests.clients.userapp import client_app, run

N = 4
TOPK = UpdateConfig(compressor="topk", topk_ratio=0.25, error_feedback=True)


def _learned(history, *, by: float = 0.2) -> None:
    """The test loss fell clearly and accuracy left chance (1/3)."""
    rounds = sorted(r for r in history if r >= 0)
    losses = [history[r][0] for r in rounds]
    assert losses[-1] < losses[0] - by, losses
    assert history[rounds[-1]][1] > 0.6, [history[r][1] for r in rounds]


def test_compression_mod_with_flowers_fedadam_learns_and_ignores_the_users_keys():
    """The reported app: ClientApp(mods=[CompressionMod(...)]) on the whole app, the
    server's FedAdam wrapped. The run config holds only the user's keys."""
    stats = []

    def strategy(context):
        s = Compressed(FedAdam(fraction_evaluate=0.0, min_available_nodes=N, eta=0.05), update=TOPK)
        stats.append(s)
        return s

    history, grid = run(strategy, client_app(app_mods=[CompressionMod(TOPK)]))
    _learned(history)
    # Every update came compressed (top-25% and raw biases: over 2x fewer bytes) and was
    # decoded; the encoder's residuals stayed on the clients.
    s = stats[0].take_stats()
    assert (s.decoded, s.rejected) == (5 * N, 0) and s.ratio > 2
    assert all("fededge.compress" in ctx.state for ctx in grid.contexts.values())


def test_dga_mod_with_dga_learns():
    history, grid = run(lambda c: DGA(delay=1, fraction_evaluate=0.0, min_available_nodes=N),
                        client_app([DGAMod()]))
    _learned(history)
    assert all("fededge.dga" in ctx.state for ctx in grid.contexts.values())


def test_dga_with_a_client_app_that_runs_no_dga_mod_is_told_to_add_it():
    """Round 1 passed (a full model), then the user's own train function failed on DGA's
    messages with "Missing key(s) in state_dict", naming nothing of DGA."""
    from fededge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"DGA round 1: no client reply .* add DGAMod\(\) to the ClientApp's mods"):
        run(lambda c: DGA(delay=1, fraction_evaluate=0.0, min_available_nodes=N), client_app([]))


def test_compressed_dga_learns_with_the_mods_in_the_documented_order():
    history, _ = run(lambda c: DGA(delay=1, fraction_evaluate=0.0, min_available_nodes=N),
                     client_app([CompressionMod(TOPK), DGAMod()]))
    _learned(history)


@pytest.mark.parametrize("update", [UpdateConfig(), UpdateConfig(compressor="signsgd")],
                         ids=["uncompressed", "signsgd"])
def test_gossip_mod_with_choco_learns(update):
    history, grid = run(lambda c: Gossip(topology="ring", algorithm="choco", gamma=0.8, min_available_nodes=N),
                        client_app([GossipMod(update)]))
    _learned(history)
    assert all("fededge.gossip" in ctx.state for ctx in grid.contexts.values())


def test_a_codec_mismatch_on_every_client_fails_the_run_by_name():
    with pytest.raises(CodecMismatchError, match=r"round 1: every client update was refused: client sent codec "
                                                 r"'topk' \(tensor 'fc1.weight'\), this server expects 'signsgd'"):
        run(lambda c: Compressed(FedAvg(fraction_evaluate=0.0, min_available_nodes=N),
                                 update=UpdateConfig(compressor="signsgd")),
            client_app([CompressionMod(TOPK)]))


def test_an_uncompressed_client_is_a_mismatch_too():
    with pytest.raises(CodecMismatchError, match=r"client sent an uncompressed update \('arrays'\), this server "
                                                 r"expects 'topk' \('raw' for tensors under 256 elements\)"):
        run(lambda c: Compressed(FedAvg(fraction_evaluate=0.0, min_available_nodes=N), update=TOPK), client_app())


def test_one_mismatched_client_is_rejected_and_logged_and_the_run_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="fededge")
    good, bad = CompressionMod(TOPK), CompressionMod(compressor="signsgd")

    def per_client(msg, context, call_next):  # noqa: ANN001, ANN202 - client 1 is configured differently
        mod = bad if int(context.node_config["partition-id"]) == 1 else good
        return mod(msg, context, call_next)

    stats = []

    def strategy(context):
        s = Compressed(FedAvg(fraction_evaluate=0.0, min_available_nodes=N), update=TOPK)
        stats.append(s)
        return s

    history, _ = run(strategy, client_app([per_client]))
    _learned(history)
    s = stats[0].take_stats()  # over the whole run: nobody took them per round
    rounds = 5
    assert (s.rejected, s.mismatched, s.decoded) == (rounds, rounds, rounds * (N - 1))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("fededge")]
    assert len(warned) == rounds and all("client sent codec 'signsgd'" in w and "expects 'topk'" in w
                                         for w in warned), warned


def _one_client_in(codec: str):
    """Client 1's CompressionMod sends ``codec``; the others TOPK, as the server expects."""
    good, bad = CompressionMod(TOPK), CompressionMod(compressor=codec)

    def mod(msg, context, call_next):  # noqa: ANN001, ANN202
        return (bad if int(context.node_config["partition-id"]) == 1 else good)(msg, context, call_next)

    return mod


def test_dga_refuses_an_update_in_another_codec_by_name_and_the_run_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="fededge")
    history, _ = run(lambda c: DGA(delay=1, fraction_evaluate=0.0, min_available_nodes=N, update=TOPK),
                     client_app([_one_client_in("signsgd"), DGAMod()]))
    _learned(history)  # on the other three clients' updates
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("fededge")]
    assert len(warned) == 5 and all("CodecMismatchError: client sent codec 'signsgd'" in w and "expects 'topk'" in w
                                    for w in warned), warned


def test_a_codec_mismatch_on_every_dga_client_fails_the_run_by_name():
    with pytest.raises(CodecMismatchError, match=r"DGA round 1: every client update was refused: node \d+: "
                                                 r"CodecMismatchError: client sent codec 'topk' "
                                                 r"\(tensor 'fc1.weight'\), this server expects 'signsgd'"):
        run(lambda c: DGA(delay=1, fraction_evaluate=0.0, min_available_nodes=N,
                          update=UpdateConfig(compressor="signsgd")),
            client_app([CompressionMod(TOPK), DGAMod()]))


def test_an_uncompressed_dga_client_is_a_mismatch_too():
    with pytest.raises(CodecMismatchError, match=r"client sent an uncompressed update \('arrays'\), this server "
                                                 r"expects 'topk'"):
        run(lambda c: DGA(delay=1, fraction_evaluate=0.0, min_available_nodes=N, update=TOPK),
            client_app([DGAMod()]))


def test_every_name_fededge_api_exports_is_documented_in_docs_library_md():
    """Issue 37: PreviewMod, StateSpillMod and StateStoreMod were exported but not in the
    user's page. Each name must appear as code (`Name`) in docs/library.md."""
    import re
    from pathlib import Path

    import fededge.api as api

    text = (Path(__file__).resolve().parents[2] / "docs" / "library.md").read_text()
    documented = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)[(`]", text))
    missing = [name for name in api.__all__ if name not in documented]
    assert not missing, f"exported by fededge.api but not documented in docs/library.md: {missing}"


def test_gossip_with_a_client_app_that_runs_no_gossip_mod_is_told_to_add_it():
    """Every reply was left out every round, and the run went on training nothing."""
    from fededge.errors import ConfigError
    from fededge.strategies.gossip import Gossip

    with pytest.raises(ConfigError, match=r"gossip round 1: no reply is a gossip message: .*add GossipMod\(\.\.\.\)"):
        run(lambda c: Gossip(topology="ring", min_available_nodes=N, fraction_evaluate=0.0), client_app([]))
