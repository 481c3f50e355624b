"""Compressed uplinks through the Flower path (client mod + server wrapper), in-process."""

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, Context, Message
from flwr.clientapp import ClientApp

from fededge.clients.app import train as fededge_train
from fededge.clients.app import run_config_mods
from fededge.keys import COMPRESSED
from fededge.compress.update import COMPRESSORS, UNBIASED, UpdateConfig
from fededge.strategies.compressed import Compressed
from fededge.server.inprocess import run_inprocess

BASE = {"num-rounds": 3, "local-steps": 10, "partition": "iid", "progress": "off"}
# Error feedback on and off for every biased codec; unbiased codecs refuse it (below).
CASES = [(c, ef) for c in COMPRESSORS if c != "none"
         for ef in ([False, True] if c not in ("dgc", "powersgd", *UNBIASED) else [False])]


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("compressor", "ef"), CASES)
def test_every_compressor_learns_through_flower(tmp_path, compressor, ef):
    # Sparsifiers at 10% (their default is 1%) so that three rounds move the model.
    ratio = {"topk-ratio": 0.1} if compressor in ("topk", "randk") else {}
    run_dir = run_inprocess({**BASE, "compressor": compressor, "error-feedback": ef, **ratio,
                             "results-dir": str(tmp_path)}, num_clients=4)
    lines = _lines(run_dir)
    assert all(r["num_clients"] == 4 and r["rejected"] == 0 for r in lines[1:])
    # Learns: the loss falls clearly below the initial model's and accuracy leaves chance
    # (0.1). Three short rounds of 4 clients: measured best accuracies 0.17 (random-k with
    # error feedback, an unbiased high-variance codec) to 0.63.
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.05, [r["loss"] for r in lines]
    assert max(r["accuracy"] for r in lines) > 0.15
    ratio = lines[-1]["compression_ratio"]
    assert ratio is not None and ratio > (0.99 if compressor == "raw" else 1.5)
    # bytes_up is what was sent: the compressed payloads, much less than float32 weights.
    plain = json.loads((run_dir / "config.json").read_text())["model_parameters"] * 4 * 4
    assert lines[-1]["bytes_up"] < plain * (1.02 if compressor == "raw" else 0.7)  # headers: ~1%


def test_raw_codec_reduces_to_fedavg(tmp_path):
    a = run_inprocess({**BASE, "results-dir": str(tmp_path / "a")}, num_clients=3)
    b = run_inprocess({**BASE, "compressor": "raw", "results-dir": str(tmp_path / "b")}, num_clients=3)
    ma, mb = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    for k in ma:  # sent + (trained - sent) in float32: equal up to one rounding
        torch.testing.assert_close(mb[k], ma[k], rtol=1e-6, atol=1e-6)
    assert [r["accuracy"] for r in _lines(a)] == [r["accuracy"] for r in _lines(b)]


def _corrupting(partition: int):
    def mod(msg: Message, context: Context, call_next):  # noqa: ANN001, ANN202
        reply = call_next(msg, context)
        if int(context.node_config["partition-id"]) == partition and COMPRESSED in reply.content:
            rec = reply.content[COMPRESSED]
            name = next(iter(rec.keys()))
            rec[name] = Array(rec[name].numpy()[:-3].copy())  # truncate one payload
        return reply
    return mod


def test_a_malformed_update_is_rejected_logged_and_counted(tmp_path):
    app = ClientApp()
    app.train(mods=[_corrupting(1), run_config_mods])(fededge_train)
    run_dir = run_inprocess({**BASE, "compressor": "topk", "results-dir": str(tmp_path)},
                            num_clients=3, client_app=app)
    lines = _lines(run_dir)
    assert [r["rejected"] for r in lines] == [0, 1, 1, 1]
    assert [r["num_clients"] for r in lines[1:]] == [2, 2, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["total_rejected"] == 3
    assert lines[-1]["loss"] < lines[0]["loss"]  # the others still trained


def test_every_update_malformed_fails_the_run_by_name(tmp_path):
    from fededge.server.experiment import RoundFailedError

    app = ClientApp()
    app.train(mods=[_corrupting(0), run_config_mods])(fededge_train)
    with pytest.raises(RoundFailedError, match=r"1 rejected.*tensor .* body length|1 rejected.*truncated|1 rejected"):
        run_inprocess({**BASE, "compressor": "topk", "results-dir": str(tmp_path)},
                      num_clients=1, client_app=app)


def test_flower_fedadam_behind_the_wrapper(tmp_path):
    run_dir = run_inprocess({**BASE, "strategy": "fedadam", "server-lr": 0.05, "compressor": "topk",
                             "error-feedback": True, "topk-ratio": 0.1, "results-dir": str(tmp_path)},
                            num_clients=4)
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["strategy_class"] == "fededge.strategies.compressed.Compressed"
    lines = _lines(run_dir)
    assert lines[-1]["loss"] < lines[0]["loss"] and lines[-1]["compression_ratio"] > 5


def test_encoder_state_lives_in_context_state(tmp_path):
    from fededge.clients.app import app as default_app
    from fededge.server.grid import InProcessGrid  # noqa: F401 - for the type below

    seen = {}

    def spy(msg, context, call_next):  # noqa: ANN001, ANN202
        reply = call_next(msg, context)
        seen[int(context.node_config["partition-id"])] = sorted(context.state.keys())
        return reply

    app = ClientApp()
    app.train(mods=[spy, run_config_mods])(fededge_train)
    run_inprocess({**BASE, "compressor": "onebit", "error-feedback": True, "results-dir": str(tmp_path)},
                  num_clients=2, client_app=app)
    assert all("fededge.compress" in keys for keys in seen.values()), seen
    del default_app


@pytest.mark.parametrize(("key", "value", "match"), [
    ("compressor", "zip", r"'compressor': compressor must be one of"),
    ("topk-ratio", 0.0, r"'topk-ratio': ratio must be in"),
    ("topk-values", "fp8", r"'topk-values': must be one of fp32, fp16, bf16, got 'fp8'"),
    ("qsgd-levels", 0, r"'qsgd-levels / qsgd-bucket'"),
])
def test_bad_compression_config_names_the_key(key, value, match):
    from fededge.config import ConfigError, RunConfig

    comp = {"topk-ratio": "topk", "topk-values": "topk", "qsgd-levels": "qsgd"}.get(key)
    mapping = {key: value, **({"compressor": comp} if comp else {})}
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_mapping(mapping)


@pytest.mark.parametrize("codec", UNBIASED)
def test_error_feedback_on_an_unbiased_codec_is_refused(codec):
    from fededge.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=rf"'error-feedback'.*{codec} is unbiased.*error-feedback=false"):
        RunConfig.from_mapping({"compressor": codec, "error-feedback": True})


def test_update_that_decodes_to_nan_is_rejected(tmp_path):
    from fededge.compress.bundle import pack_bundle, unpack_bundle
    from fededge.compress.wire import pack, unpack

    def nan_payload(msg, context, call_next):  # noqa: ANN001, ANN202
        reply = call_next(msg, context)
        if int(context.node_config["partition-id"]) == 0:
            rec = reply.content[COMPRESSED]
            payloads = unpack_bundle(rec["bundle"].numpy().tobytes())
            name = next(iter(payloads))
            header, body = unpack(payloads[name])
            payloads[name] = pack(header, b"\xff" * len(body))  # 0xFFFF is an fp16 NaN
            rec["bundle"] = Array(np.frombuffer(pack_bundle(payloads), dtype=np.uint8).copy())
        return reply

    app = ClientApp()
    app.train(mods=[nan_payload, run_config_mods])(fededge_train)
    run_dir = run_inprocess({**BASE, "num-rounds": 1, "compressor": "fp16", "results-dir": str(tmp_path)},
                            num_clients=2, client_app=app)
    assert _lines(run_dir)[-1]["rejected"] == 1 and _lines(run_dir)[-1]["num_clients"] == 1


def test_client_with_nan_weights_fails_its_reply(tmp_path):
    def nan_weights(msg, context, call_next):  # noqa: ANN001, ANN202
        reply = call_next(msg, context)
        if int(context.node_config["partition-id"]) == 0:
            arrays = reply.content["arrays"]
            name = next(iter(arrays.keys()))
            bad = arrays[name].numpy().copy()
            bad.flat[0] = np.nan
            arrays[name] = Array(bad)
        return reply

    app = ClientApp()
    app.train(mods=[run_config_mods, nan_weights])(fededge_train)  # NaN first, then compression
    run_dir = run_inprocess({**BASE, "num-rounds": 1, "compressor": "fp16", "results-dir": str(tmp_path)},
                            num_clients=2, client_app=app)
    last = _lines(run_dir)[-1]
    assert last["failures"] == 1 and last["num_clients"] == 1  # the encoder refused NaN


@pytest.mark.parametrize("uplink", ["none", "topk"])
def test_fp16_downlink_halves_bytes_down_and_learns(tmp_path, uplink):
    plain = run_inprocess({**BASE, "results-dir": str(tmp_path / "p")}, num_clients=3)
    down = run_inprocess({**BASE, "downlink-compressor": "fp16", "compressor": uplink, "topk-ratio": 0.1,
                          "results-dir": str(tmp_path / "d")}, num_clients=3)
    a, b = _lines(plain), _lines(down)
    for ra, rb in zip(a[1:], b[1:]):
        assert 0.45 < rb["bytes_down"] / ra["bytes_down"] < 0.56  # float16 + framing
    assert b[-1]["loss"] < b[0]["loss"] - 0.05 and all(r["rejected"] == 0 for r in b)


def test_downlink_base_is_what_the_client_received(tmp_path):
    # raw uplink after an fp16 downlink: the server rebuilds the client's weights from the
    # fp16-rounded model it sent, so the result equals training from that model.
    a = run_inprocess({**BASE, "num-rounds": 1, "downlink-compressor": "fp16", "compressor": "raw",
                       "results-dir": str(tmp_path / "a")}, num_clients=1)
    b = run_inprocess({**BASE, "num-rounds": 1, "downlink-compressor": "fp16",
                       "results-dir": str(tmp_path / "b")}, num_clients=1)
    ma, mb = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name, form", [
    ("dga", r"DGA\(\.\.\., update=update\)"),
    ("gossip", r'Gossip\(algorithm="choco", \.\.\.\) beside the clients\' GossipMod\(update=update\)'),
    ("fedbuff", r"not supported yet"), ("backup", r"not supported yet")])
def test_a_strategy_with_its_own_loop_is_refused_at_construction_with_the_form_it_supports(name, form):
    """Issue 37: Compressed(DGA(...)) failed only at round 1, with NotImplementedError."""
    from fededge.api import DGA, BackupWorkers, FedBuff, Gossip

    inner = {"dga": lambda: DGA(delay=1), "gossip": Gossip, "fedbuff": lambda: FedBuff(buffer_size=2),
             "backup": lambda: BackupWorkers(backup=1)}[name]()
    with pytest.raises(ValueError, match=r"runs its own\. With compression: " + form):
        Compressed(inner, update=UpdateConfig(compressor="topk"))


def test_compressed_wraps_any_strategy_on_flowers_loop_and_refuses_a_non_strategy():
    from flwr.serverapp.strategy import FedAvgM, FedMedian, QFedAvg

    from fededge.api import FedAvgOuter

    for inner in (FedAvgM(), FedMedian(), QFedAvg(client_learning_rate=0.1), FedAvgOuter()):
        assert Compressed(inner).inner is inner
    with pytest.raises(TypeError, match="wraps a flwr.serverapp.strategy.Strategy, got dict"):
        Compressed({})


# ------------------------------------------------- integer tensors and the fp16 downlink


class _WithBuffers(torch.nn.Module):
    """A linear layer with an integer buffer of a user's model (not a counter by name), a
    BatchNorm-like counter past float16's range and a float buffer past it too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        self.register_buffer("pos_ids", torch.arange(32))
        self.register_buffer("bn_num_batches_tracked", torch.tensor(70_000))  # not a counter by name
        self.norm = torch.nn.Module()
        self.norm.register_buffer("num_batches_tracked", torch.tensor(70_001))  # a counter by name
        self.register_buffer("scale", torch.full((4,), 1.0e5))


def _buffers_app(update: UpdateConfig) -> ClientApp:
    from flwr.app import MetricRecord, RecordDict

    from fededge.arrays import record_from_torch, record_to_torch
    from fededge.clients.mods import CompressionMod

    app = ClientApp(mods=[CompressionMod(update)])

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        received = record_to_torch(msg.content["arrays"])
        model = _WithBuffers()
        model.load_state_dict(received)  # as a user's app loads it: integers stay integers
        pid = int(context.node_config["partition-id"])
        with torch.no_grad():
            model.fc.weight.add_(0.01 * (pid + 1))
            model.norm.num_batches_tracked.add_(20)
        return Message(RecordDict({"arrays": record_from_torch(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": 10 * (pid + 1)})}), reply_to=msg)

    return app


@pytest.mark.parametrize("downlink", ["none", "fp16", "bf16"])
def test_integer_buffers_stay_integers_through_flowers_average_and_the_cast_downlink(downlink):
    """Flower's FedAvg averages every array into float64: a user's integer buffer was then
    given a codec by the server's plan from round 2 and every client refused as a
    mismatch; a counter went through fp16 (rounded past 2048, a crash past 65504)."""
    from flwr.app import ArrayRecord, RecordDict
    from flwr.serverapp.strategy import FedAvg

    from fededge import _flwr_internals as fi
    from fededge.arrays import record_from_torch, record_to_torch
    from fededge.server.grid import InProcessGrid

    update = UpdateConfig(compressor="topk", topk_ratio=0.1, error_feedback=True)
    grid = InProcessGrid(_buffers_app(update), num_nodes=3, run_config={})
    strategy = Compressed(FedAvg(fraction_evaluate=0.0, min_available_nodes=3), update=update, downlink=downlink)
    start = _WithBuffers().state_dict()
    try:
        with fi.task_identity(run_id=1, node_id=1, task_id=1):
            result = strategy.start(grid=grid, initial_arrays=record_from_torch(start), num_rounds=3)
    finally:
        grid.close()
    stats = strategy.take_stats()
    assert stats.rejected == 0 and stats.decoded == 9, stats.reasons  # 3 clients x 3 rounds
    final = record_to_torch(result.arrays)
    assert final["pos_ids"].dtype == torch.int64 and torch.equal(final["pos_ids"], torch.arange(32))
    assert final["bn_num_batches_tracked"].dtype == torch.int64 and int(final["bn_num_batches_tracked"]) == 70_000
    counter = final["norm.num_batches_tracked"]
    assert counter.dtype == torch.int64 and int(counter) == 70_001 + 3 * 20  # exact, past float16's range
    # A float tensor fp16 cannot hold travels as float32 (exact, where it crashed the
    # round); bf16 holds it, rounded (99,840), as its clients received it.
    scale = torch.full((4,), 1.0e5)
    expected = scale.to(torch.bfloat16).float() if downlink == "bf16" else scale
    torch.testing.assert_close(final["scale"].float(), expected, rtol=1e-6, atol=0)
    # The clients' weights were averaged (what FedAvg gives): the model moved by the
    # examples-weighted mean of the clients' steps, 3 rounds, within top-k + EF's delay.
    assert not torch.equal(final["fc.weight"], start["fc.weight"])
    del RecordDict, ArrayRecord


def test_an_integer_the_client_sends_as_it_is_is_taken_where_an_average_made_it_a_float():
    """The plan's check on the server: a tensor the client holds as an integer (sent as
    it is) that the server holds as a float (a checkpoint of an averaged model) is that
    integer, not a tensor of the compressor's."""
    from flwr.app import MetricRecord, RecordDict

    from fededge.arrays import record_from_torch
    from fededge.compress.update import UpdateEncoder
    from fededge.keys import UNCOMPRESSED
    from fededge.protocol import bundle_record
    from fededge.strategies.compressed import CompressionStats, decode_compressed

    cfg = UpdateConfig(compressor="topk", topk_ratio=0.1)
    sent = {"fc.weight": torch.randn(16, 32), "pos_ids": torch.arange(32, dtype=torch.float64)}
    content = RecordDict({COMPRESSED: bundle_record(UpdateEncoder(cfg).encode({"fc.weight": torch.randn(16, 32)},
                                                                              round=1)),
                          UNCOMPRESSED: record_from_torch({"pos_ids": torch.arange(32)}),
                          "metrics": MetricRecord({"num-examples": 3})})
    out = decode_compressed(content, sent, CompressionStats(), expect=cfg, server_round=2)
    assert out["arrays"]["pos_ids"].dtype == "int64"
    # Sent as it is in another shape: malformed, by name (it was averaged into the model).
    from fededge.compress import MalformedPayloadError

    content[UNCOMPRESSED] = record_from_torch({"pos_ids": torch.arange(31)})
    with pytest.raises(MalformedPayloadError, match=r"tensor 'pos_ids' \(sent as it is\): shape \(31,\) != model "
                                                    r"shape \(32,\)"):
        decode_compressed(content, sent, CompressionStats(), expect=cfg, server_round=2)


def test_a_server_that_recalibrates_keeps_its_statistics_where_no_update_config_says_so():
    """NormCalibrated(Compressed(inner)) without ``update=``: clients under
    norm-stats=global leave the statistics out; they were refused as malformed, every
    reply of every round, and the run went on without training."""
    from flwr.app import RecordDict
    from flwr.serverapp.strategy import FedAvg

    from fededge.compress.update import UpdateEncoder
    from fededge.protocol import bundle_record
    from fededge.strategies.compressed import CompressionStats, decode_compressed
    from fededge.strategies.normstats import NormCalibrated

    sent = {"conv.weight": torch.randn(8, 4, 3, 3), "bn.running_mean": torch.zeros(8),
            "bn.running_var": torch.ones(8), "bn.num_batches_tracked": torch.tensor(5)}
    glob = UpdateConfig(compressor="signsgd", norm_stats="global")
    payloads = UpdateEncoder(glob).encode({"conv.weight": torch.randn(8, 4, 3, 3)}, round=0)
    inner = Compressed(FedAvg())
    assert not inner.server_sets_statistics
    NormCalibrated(inner)
    assert inner.server_sets_statistics
    out = decode_compressed(RecordDict({COMPRESSED: bundle_record(payloads)}), sent, CompressionStats(),
                            keep_statistics=inner.server_sets_statistics)
    assert out["arrays"]["bn.num_batches_tracked"].numpy() == 5
    assert np.array_equal(out["arrays"]["bn.running_var"].numpy(), np.ones(8, np.float32))
    from fededge.compress import MalformedPayloadError

    sent["other.weight"] = torch.zeros(3)  # not a statistic: still missing, still refused
    with pytest.raises(MalformedPayloadError, match="'other.weight' of the model is missing"):
        decode_compressed(RecordDict({COMPRESSED: bundle_record(payloads)}), sent, CompressionStats(),
                          keep_statistics=True)


def test_global_norm_stats_without_normcalibrated_is_refused_before_round_1():
    """The clients send no statistics under norm_stats='global': without NormCalibrated the
    model's BatchNorm statistics stayed at round 0's, silently."""
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.serverapp.strategy import FedAvg

    from fededge.errors import ConfigError
    from fededge.strategies.compressed import Compressed
    from fededge.strategies.normstats import NormCalibrated

    update = UpdateConfig(compressor="signsgd", error_feedback=True, norm_stats="global")
    with pytest.raises(ConfigError, match=r"wrap it in NormCalibrated\(Compressed\(...\)\)"):
        Compressed(FedAvg(), update=update).configure_train(1, ArrayRecord(), ConfigRecord(), None)
    NormCalibrated(Compressed(FedAvg(), update=update))  # wrapped: the server's own statistics


def test_normcalibrated_tells_a_compressed_under_another_wrapper_that_it_sets_the_statistics():
    from flwr.serverapp.strategy import FedAvg

    from fededge.strategies.compressed import Compressed
    from fededge.strategies.normstats import NormCalibrated
    from fededge.strategies.plainbuffers import PlainBuffers

    inner = Compressed(FedAvg(), update=UpdateConfig(compressor="signsgd", norm_stats="global"))
    NormCalibrated(PlainBuffers(inner))
    assert inner.server_sets_statistics  # (only a Compressed directly inside was told)


def test_plainbuffers_casts_a_0d_integer_buffer_back_whatever_the_header_cache(monkeypatch):
    """np.rint of a 0-d array is a numpy scalar, which Flower's Array refuses: a user's
    Linear+BatchNorm app under PlainBuffers(FedAvgM) crashed in round 1 (fededge's own
    survived on a warm header cache)."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAvgM
    from flwr.supercore.task_identity import TaskIdentity

    from fededge import arrays as fa
    from fededge.strategies.plainbuffers import PlainBuffers

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    monkeypatch.setattr(fa, "_written", {})  # a cold cache: Flower's own conversion

    class Grid:
        def get_node_ids(self):  # noqa: ANN202
            return [1, 2]

        def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: ANN001, ANN202
            return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    model = ArrayRecord({"w": Array(np.ones(2, np.float32)), "bn.num_batches_tracked": Array(np.array(8, np.int32))})
    pb = PlainBuffers(FedAvgM(min_available_nodes=1, min_train_nodes=1, fraction_evaluate=0.0))
    sent = list(pb.configure_train(1, model, ConfigRecord(), Grid()))
    replies = [Message(RecordDict({"arrays": ArrayRecord({"w": Array(np.full(2, 1.5, np.float32)),
                                                          "bn.num_batches_tracked": Array(np.array(n, np.int32))}),
                                   "metrics": MetricRecord({"num-examples": w})}), reply_to=m)
               for m, n, w in zip(sent, (9, 12), (3, 1))]
    arrays, _ = pb.aggregate_train(1, replies)
    counter = arrays["bn.num_batches_tracked"].numpy()
    assert counter.dtype == np.int32 and counter.shape == () and int(counter) == 10  # (9*3 + 12) / 4 = 9.75
    assert arrays["w"].numpy().dtype == np.float32
