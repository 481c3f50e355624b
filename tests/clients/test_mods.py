"""The client mods as library pieces: configured by their constructors, blind to the run
config, inert on other strategies' messages, refusing a wrong order by name; and
fededge's own ClientApp is exactly these mods around plain local SGD."""

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fededge import _flwr_internals as fi
from fededge import keys
from fededge.api import (
    CompressionMod, ConfigError, DGAMod, GossipMod, ModOrderError, StateStoreMod, UpdateConfig, config_error_mod,
)
from fededge.protocol import cast_downlink, config_error_detail
from tests.clients.userapp import client_app, initial_arrays, run

TOPK = UpdateConfig(compressor="topk", topk_ratio=0.25, error_feedback=True)
DGA_CONFIG = {keys.SERVER_ROUND: 1, keys.DGA_GLOBAL_ROUND: 0, keys.DGA_CORRECTION: True}
CHOCO_CONFIG = {keys.SERVER_ROUND: 1, keys.GOSSIP_INDEX: 0, keys.GOSSIP_ALGORITHM: "choco", keys.GOSSIP_GAMMA: 0.5,
                keys.GOSSIP_ROW_NODES: [0, 1], keys.GOSSIP_ROW_WEIGHTS: [0.5, 0.5], keys.GOSSIP_EVAL: True}


class Untouchable(dict):
    """A run config that fails any test that reads it."""

    def _no(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a mod read the run config")

    __getitem__ = __contains__ = __iter__ = __len__ = get = keys = items = values = _no


def _step(msg: Message, context: Context) -> Message:
    """A train function that reads nothing but its message: one fixed step on the weights."""
    arrays = {k: v + 0.01 for k, v in msg.content[keys.ARRAYS].to_torch_state_dict().items()}
    metrics = MetricRecord({keys.NUM_EXAMPLES: 10, keys.COMPUTE_S: 0.0})
    return Message(RecordDict({keys.ARRAYS: ArrayRecord(arrays), keys.METRICS: metrics}), reply_to=msg)


def _call(mods, content: dict, *, train=_step, context: Context | None = None) -> tuple[Message, Context]:
    app = ClientApp()
    app.train(mods=list(mods))(train)
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        msg = Message(RecordDict(content), 7, "train")
    fi.set_message_id(msg, "m1")
    context = context or Context(run_id=1, node_id=7, node_config={keys.PARTITION_ID: 0}, state=RecordDict(),
                                 run_config=Untouchable())
    return app(msg, context), context


def _config(d: dict) -> ConfigRecord:
    return ConfigRecord(dict(d))


# ----------------------------------------------------------------- no run config


def test_compression_mod_decodes_the_downlink_and_compresses_without_the_run_config():
    content = {**cast_downlink(initial_arrays(), "fp16"), keys.CONFIG: _config({keys.SERVER_ROUND: 1})}
    reply, context = _call([CompressionMod(TOPK)], content)
    assert keys.COMPRESSED in reply.content and keys.ARRAYS not in reply.content
    assert keys.STATE_COMPRESS in context.state  # error feedback's residuals


def test_dga_mod_runs_a_round_without_the_run_config():
    reply, context = _call([DGAMod()], {keys.ARRAYS: initial_arrays(), keys.CONFIG: _config(DGA_CONFIG)})
    assert reply.content[keys.METRICS][keys.DGA_STALENESS] == 0
    # D = 0 round 1: the reply is the trained model itself (G(0) + its change).
    for k, v in reply.content[keys.ARRAYS].to_torch_state_dict().items():
        assert torch.equal(v, initial_arrays().to_torch_state_dict()[k] + 0.01)
    assert keys.STATE_DGA in context.state


def test_gossip_mod_runs_a_choco_round_without_the_run_config():
    reply, context = _call([GossipMod(UpdateConfig(compressor="signsgd"))],
                           {keys.ARRAYS: initial_arrays(), keys.CONFIG: _config(CHOCO_CONFIG)})
    assert {keys.GOSSIP_MESSAGE, keys.GOSSIP_EVAL_ARRAYS, keys.METRICS} == set(reply.content.keys())
    assert keys.STATE_GOSSIP in context.state


def test_a_compressing_gossip_mod_under_dpsgd_is_a_config_error_naming_choco():
    """D-PSGD sends whole models: the GossipMod's codec was ignored, every message dense."""
    with pytest.raises(ConfigError, match=r"compressed gossip is CHOCO-SGD, Gossip\(algorithm='choco'"):
        _call([GossipMod(UpdateConfig(compressor="signsgd"))],
              {keys.ARRAYS: initial_arrays(), keys.CONFIG: _config({**CHOCO_CONFIG, keys.GOSSIP_ALGORITHM: "dpsgd"})})
    _call([GossipMod()], {keys.ARRAYS: initial_arrays(),  # no codec: D-PSGD as it is
                          keys.CONFIG: _config({**CHOCO_CONFIG, keys.GOSSIP_ALGORITHM: "dpsgd"})})


def test_config_error_mod_names_a_users_config_error_without_the_run_config():
    def bad(msg, context):  # noqa: ANN001, ANN202
        raise ConfigError("run-config key 'my-lr' must be > 0")

    reply, _ = _call([config_error_mod], {keys.CONFIG: _config({})}, train=bad)
    assert config_error_detail(reply.error.reason) == "run-config key 'my-lr' must be > 0"


# ----------------------------------------------------------------- other messages, failures, order


def test_dga_and_gossip_mods_leave_other_strategies_messages_untouched():
    """FedAvg through the user's app with DGAMod and GossipMod is FedAvg, bit for bit,
    and they keep no state."""
    plain, _ = run(lambda c: FedAvg(fraction_evaluate=0.0, min_available_nodes=4), client_app())
    modded, grid = run(lambda c: FedAvg(fraction_evaluate=0.0, min_available_nodes=4),
                       client_app([DGAMod(), GossipMod()]))
    assert plain == modded
    assert all(len(ctx.state) == 0 for ctx in grid.contexts.values())


@pytest.mark.parametrize("mod, config", [(DGAMod(), DGA_CONFIG), (GossipMod(), CHOCO_CONFIG)], ids=["dga", "gossip"])
def test_a_failed_train_leaves_the_state_as_it_was(mod, config):
    def broken(msg, context):  # noqa: ANN001, ANN202
        raise RuntimeError("out of memory")

    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(RuntimeError, match="out of memory"):
        _call([mod], {keys.ARRAYS: initial_arrays(), keys.CONFIG: _config(config)}, train=broken, context=context)
    assert len(context.state) == 0


@pytest.mark.parametrize("mods, config, match", [
    # CompressionMod, inside, finds no DGA update of the round and says so first.
    ([DGAMod(), CompressionMod(TOPK)], DGA_CONFIG, r"no update of that round: register DGAMod inside CompressionMod"),
    ([GossipMod(), CompressionMod(TOPK)], CHOCO_CONFIG, r"GossipMod got a compressed reply.*Register CompressionMod"),
    ([CompressionMod(TOPK)], DGA_CONFIG, r"DGA state holds no update of that round: register DGAMod inside"),
], ids=["dga-outside", "gossip-outside", "dga-missing"])
def test_mods_in_an_order_that_cannot_work_fail_by_name(mods, config, match):
    with pytest.raises(ModOrderError, match=match):
        _call(mods, {keys.ARRAYS: initial_arrays(), keys.CONFIG: _config(config)})


def test_constructors_validate_their_arguments():
    with pytest.raises(ValueError, match="an UpdateConfig or its fields, not both"):
        CompressionMod(TOPK, compressor="topk")
    with pytest.raises(ValueError, match="compressor must be one of"):
        CompressionMod(compressor="zip")
    assert CompressionMod(compressor="topk", topk_ratio=0.25, error_feedback=True).update == TOPK
    for bad in (-1.0, float("nan"), float("inf"), "4"):
        with pytest.raises(ValueError, match="'dgc-warmup-epochs': must be a finite number >= 0"):
            CompressionMod(compressor="dgc", dgc_warmup_epochs=bad)
    with pytest.raises(ValueError, match="'dgc' keeps encoder state"):
        GossipMod(UpdateConfig(compressor="dgc"))
    with pytest.raises(ValueError, match="error_feedback must be false"):
        GossipMod(TOPK)
    with pytest.raises(ValueError, match=r"GossipMod: scale must be in \[0, 1\]"):
        GossipMod(choco_scale=2.0)


# ----------------------------------------------------------------- fededge's app is a user of the mods

HAND = {  # the run config's knobs, and the same pieces assembled by hand
    "fedavg-topk": ({"compressor": "topk", "topk-ratio": 0.1, "error-feedback": True},
                    lambda: [StateStoreMod(), CompressionMod(compressor="topk", topk_ratio=0.1, error_feedback=True)]),
    "dga-signsgd": ({"strategy": "dga", "dga-delay": 1, "compressor": "signsgd", "error-feedback": True},
                    lambda: [StateStoreMod(), CompressionMod(compressor="signsgd", error_feedback=True), DGAMod()]),
    "choco-signsgd": ({"strategy": "gossip", "gossip-algorithm": "choco", "gossip-gamma": 0.8,
                       "compressor": "signsgd"},
                      lambda: [StateStoreMod(), GossipMod(UpdateConfig(compressor="signsgd"))]),
}


@pytest.mark.parametrize("case", list(HAND))
def test_fededge_app_and_the_pieces_assembled_by_hand_train_the_same_model(tmp_path, case):
    from fededge.clients.app import client_mods
    from fededge.clients.app import train as fededge_train
    from fededge.config import RunConfig
    from fededge.server.inprocess import run_inprocess

    over, mods = HAND[case]
    over = {**over, "num-rounds": 3, "local-steps": 3, "model": "mlp", "progress": "off"}
    assert [type(m) for m in client_mods(RunConfig.from_mapping(over))] == [type(m) for m in mods()]
    own = run_inprocess({**over, "results-dir": str(tmp_path / "own")}, num_clients=3)
    hand = ClientApp(mods=[config_error_mod])
    hand.train(mods=mods())(fededge_train)  # fededge's train: plain local SGD
    built = run_inprocess({**over, "results-dir": str(tmp_path / "hand")}, num_clients=3, client_app=hand)
    a, b = torch.load(own / "model.pt"), torch.load(built / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dga_mod_keeps_its_updates_in_flight_as_stored_and_writes_the_same_state():
    """Three rounds in flight (the global model of round 0 only): each message encodes the
    model and its own round's update again, and keeps the earlier updates as the very
    ``Array`` objects stored before. The state is what encoding all of it would give."""
    from fededge.algorithms.dga import DGAClient, DGAConfig
    from fededge.arrays import record_from_torch, record_to_torch

    context = None
    stored = []
    for rnd in (1, 2, 3):
        content = {keys.CONFIG: _config({**DGA_CONFIG, keys.SERVER_ROUND: rnd})}
        if rnd == 1:
            content[keys.ARRAYS] = initial_arrays()
        reply, context = _call([DGAMod()], content, context=context)
        assert reply.content[keys.METRICS][keys.DGA_STALENESS] == rnd - 1
        stored.append(context.state[keys.STATE_DGA])
    first, last = stored[0], stored[-1]
    kept = [k for k in first if k.startswith("inflight/1/")]
    assert kept and all(last[k] is first[k] for k in kept)
    assert all(last[k] is not stored[1].get(k) for k in last if k.startswith(("inflight/3/", "model/")))
    again = record_from_torch(DGAClient.from_state_dict(DGAConfig(), record_to_torch(last)).state_dict())
    assert list(again.keys()) == list(last.keys())
    assert again.object_id == last.object_id


# ----------------------------------------------------------------- normalisation statistics


def _bn_arrays() -> ArrayRecord:
    return ArrayRecord({"conv.weight": torch.ones(4, 3), "bn.weight": torch.ones(4), "bn.running_mean": torch.zeros(4),
                        "bn.running_var": torch.ones(4), "bn.num_batches_tracked": torch.tensor(3)})


def _bn_step(offer: bool, seen: list):
    """A train function that changes every tensor and, if ``offer``, offers statistics
    that record the weights they were asked for."""
    from fededge.clients.mods import offer_norm_statistics

    def train(msg: Message, context: Context) -> Message:
        sd = msg.content[keys.ARRAYS].to_torch_state_dict()
        out = {k: (v + 0.5 if v.is_floating_point() else v + 20) for k, v in sd.items()}
        if offer:
            def stats(weights):  # noqa: ANN001, ANN202
                seen.append({k: v.clone() for k, v in weights.items()})
                return {"bn.running_mean": weights["conv.weight"].sum(1), "bn.running_var": torch.full((4,), 7.0)}
            offer_norm_statistics(stats)
        metrics = MetricRecord({keys.NUM_EXAMPLES: 10, keys.COMPUTE_S: 0.0})
        return Message(RecordDict({keys.ARRAYS: ArrayRecord(out), keys.METRICS: metrics}), reply_to=msg)

    return train


@pytest.mark.parametrize("norm_stats", ["decoded", "trained"])
def test_statistics_are_those_of_the_decoded_model_when_the_train_function_offers_them(norm_stats):
    from fededge.compress.update import decode_update
    from fededge.protocol import bundle_payloads

    seen: list = []
    update = UpdateConfig(compressor="signsgd", error_feedback=True, min_numel=0, norm_stats=norm_stats)
    content = {keys.ARRAYS: _bn_arrays(), keys.CONFIG: _config({keys.SERVER_ROUND: 1})}
    reply, _ = _call([CompressionMod(update)], content, train=_bn_step(True, seen))
    got = decode_update(bundle_payloads(reply.content[keys.COMPRESSED]), max_elements=100)
    assert reply.content[keys.UNCOMPRESSED]["bn.num_batches_tracked"].numpy() == 23  # the counter, as it is
    if norm_stats == "trained":
        assert not seen and torch.allclose(got["bn.running_var"], torch.full((4,), 0.5))  # trained 1.5, as deltas
        return
    # The weights asked about are the received model plus the update as it decodes: the
    # sign codec sends conv's +0.5 as its scaled sign (exactly 0.5 here), bn.weight raw.
    (weights,) = seen
    assert torch.equal(weights["conv.weight"], torch.ones(4, 3) + got["conv.weight"])
    assert torch.equal(weights["bn.weight"], torch.full((4,), 1.5))
    assert int(weights["bn.num_batches_tracked"]) == 23
    # What the server adds to its statistics takes them to the offered values.
    assert torch.allclose(got["bn.running_mean"], weights["conv.weight"].sum(1))
    assert torch.allclose(torch.ones(4) + got["bn.running_var"], torch.full((4,), 7.0))


def test_without_an_offer_the_statistics_go_as_trained_and_a_warning_says_so(caplog):
    import fededge.clients.mods as mods

    mods._warned_norm_stats = False
    content = {keys.ARRAYS: _bn_arrays(), keys.CONFIG: _config({keys.SERVER_ROUND: 1})}
    update = UpdateConfig(compressor="signsgd", min_numel=0)
    with caplog.at_level("WARNING"):
        reply, _ = _call([CompressionMod(update)], content, train=_bn_step(False, []))
    assert "offer_norm_statistics" in caplog.text and keys.COMPRESSED in reply.content


def test_norm_statistics_are_the_models_own_and_leave_it_unchanged():
    from fededge.clients.train import norm_statistics
    from fededge.models.zoo import build_model

    model = build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    for b in (m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)):
        b.running_mean.fill_(5.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(100, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    stats = norm_statistics(model, x, batches=3, batch_size=20, seed=4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # unchanged
    assert set(stats) == {k for k in before if k.endswith(("running_mean", "running_var"))}
    assert stats == {} or not torch.allclose(stats["features.1.running_mean"], torch.full_like(stats[
        "features.1.running_mean"], 5.0))
    # The first BatchNorm's mean is the conv output's mean over the 60 examples drawn.
    order = torch.randperm(100, generator=torch.Generator().manual_seed(4))[:60]
    conv = model.features[0]
    with torch.no_grad():
        want = torch.stack([conv(x[order[i:i + 20]]).mean((0, 2, 3)) for i in range(0, 60, 20)]).mean(0)
    assert torch.allclose(stats["features.1.running_mean"], want, atol=1e-5)
    assert torch.equal(norm_statistics(model, x, batches=3, batch_size=20, seed=4)["features.1.running_var"],
                       stats["features.1.running_var"])


@pytest.mark.parametrize("examples,steps,epochs,warmup", [
    (2400, 10, 4.0, 30),  # a round is 0.13 of an epoch: 4 epochs are 30 rounds
    (2400.0, 10, 4.0, 30),  # a whole float is a count
    (2400, 10, 0.0, 4),   # epochs off: dgc-warmup-rounds alone
    (144, 20, 4.0, 4),    # a round is 4.4 epochs: at least dgc-warmup-rounds
    (None, 10, 4.0, 4),   # the reply does not say its examples: the rounds alone
    (2400, None, 4.0, 4),  # nor the config its local steps
    (float("nan"), 10, 4.0, 4),  # nor anything a count can be made of
    (2400, "auto", 4.0, 4),
    (2400, -10, 4.0, 4),
], ids=["short-rounds", "float-count", "epochs-off", "long-rounds", "no-examples", "no-steps", "nan", "text",
        "negative"])
def test_dgc_warms_up_over_the_larger_of_its_rounds_and_epochs_of_the_clients_data(examples, steps, epochs, warmup):
    """CompressionMod sizes DGC's sparsity warm-up per client: the larger of
    dgc-warmup-rounds and dgc-warmup-epochs epochs of its data (the reply's num-examples,
    a round's examples from the train config's local steps and batch size)."""
    from fededge.compress.codec import decode_any
    from fededge.compress.codecs import keep_count
    from fededge.compress.dgc import DGCConfig
    from fededge.protocol import bundle_payloads

    g = torch.Generator().manual_seed(0)
    start = {"w": torch.zeros(100, 100)}

    def train(msg, context):  # noqa: ANN001, ANN202
        received = msg.content[keys.ARRAYS].to_torch_state_dict()
        arrays = {k: v + torch.randn(v.shape, generator=g) for k, v in received.items()}
        metrics = MetricRecord({keys.COMPUTE_S: 0.0} | ({} if examples is None else {keys.NUM_EXAMPLES: examples}))
        return Message(RecordDict({keys.ARRAYS: ArrayRecord(arrays), keys.METRICS: metrics}), reply_to=msg)

    update = UpdateConfig(compressor="dgc", dgc_warmup_epochs=epochs)
    rnd = 6  # the encoder's round 5: past the default 4 rounds' warm-up, inside 30
    reply, _ = _call([CompressionMod(update)], {
        keys.ARRAYS: ArrayRecord(start),
        keys.CONFIG: _config({keys.SERVER_ROUND: rnd, keys.BATCH_SIZE: 32}
                             | ({} if steps is None else {keys.LOCAL_STEPS: steps}))}, train=train)
    sent = int((decode_any(bundle_payloads(reply.content[keys.COMPRESSED])["w"]) != 0).sum())
    want = DGCConfig(final_sparsity=update.dgc_sparsity, warmup_rounds=warmup)
    assert sent == keep_count(1 - want.sparsity_at(rnd - 1), 10_000)
    assert (sent > 100) == (warmup == 30)  # 1% of 10,000 once warmed up


def _own_train(metrics_name: str):
    """A user's train function: its MetricRecord under a name of its own (Flower takes a
    reply's one MetricRecord whatever its name)."""
    from flwr.app import ArrayRecord, MetricRecord, RecordDict

    def train(msg, context):  # noqa: ANN001, ANN202
        sd = msg.content["arrays"].to_torch_state_dict()
        out = {k: v + 0.1 for k, v in sd.items()}
        return Message(RecordDict({"arrays": ArrayRecord(out),
                                   metrics_name: MetricRecord({"num-examples": 10, "loss": 0.5})}), reply_to=msg)
    return train


def _call_own(mods, content, train, rnd=1, node=7):
    from flwr.app import RecordDict

    from fededge import _flwr_internals as fi

    app = ClientApp()
    app.train(mods=mods)(train)
    with fi.task_identity(run_id=1, node_id=1, task_id=rnd):
        msg = Message(RecordDict(content), node, "train")
    fi.set_message_id(msg, f"m{rnd}")
    return app(msg, Context(run_id=1, node_id=node, node_config={"partition-id": 0}, state=RecordDict(),
                            run_config={}))


def test_the_mods_keep_a_reply_to_its_one_metric_record_under_its_own_name():
    """CompressionMod and DGAMod added an empty 'metrics' beside a user's 'train_metrics':
    two MetricRecords, and Flower's FedAvg behind Compressed refused every reply."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.serverapp.strategy import FedAvg

    from fededge import keys
    from fededge.clients.mods import DGAMod
    from fededge.strategies.compressed import Compressed

    w = {"w": torch.ones(8, 8), "b": torch.zeros(8)}
    upd = UpdateConfig(compressor="topk", topk_ratio=0.25, error_feedback=True)
    r = _call_own([CompressionMod(upd)], {"arrays": ArrayRecord(w), "config": ConfigRecord({keys.SERVER_ROUND: 1})},
              _own_train("train_metrics"))
    assert list(r.content.metric_records) == ["train_metrics"]
    r2 = _call_own([DGAMod()], {"arrays": ArrayRecord(w), "config": ConfigRecord(
        {keys.SERVER_ROUND: 1, keys.DGA_GLOBAL_ROUND: 0, keys.DGA_CORRECTION: True})}, _own_train("train_metrics"))
    assert list(r2.content.metric_records) == ["train_metrics"] and keys.DGA_STALENESS in r2.content["train_metrics"]
    s = Compressed(FedAvg(), update=upd)
    s._sent[1] = {k: v.clone() for k, v in w.items()}
    arrays, _ = s.aggregate_train(1, [r])
    assert arrays is not None and torch.allclose(torch.from_numpy(arrays["b"].numpy()).float(), torch.full((8,), 0.1))


def test_compression_takes_the_round_from_the_config_record_that_carries_it():
    """Read only from a record named 'config': under FedAvg(configrecord_key='train-config')
    every round was round 1, so random-k sent the same coordinates every round."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from fededge.compress.update import decode_update
    from fededge.protocol import bundle_payloads

    def train(msg, context):  # noqa: ANN001, ANN202
        sd = msg.content["arrays"].to_torch_state_dict()
        return Message(RecordDict({"arrays": ArrayRecord({k: v + 1 for k, v in sd.items()}),
                                   "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)

    mod = CompressionMod(UpdateConfig(compressor="randk", topk_ratio=0.05))
    picked = []
    for rnd in (1, 2, 3):
        r = _call_own([mod], {"arrays": ArrayRecord({"w": torch.zeros(32, 32)}),
                          "train-config": ConfigRecord({"server-round": rnd})}, train, rnd=rnd)
        d = decode_update(bundle_payloads(r.content["compressed"]), max_elements=4096)["w"]
        picked.append(tuple(torch.nonzero(d.flatten()).flatten().tolist()))
    assert len(set(picked)) == 3
