"""The records both sides exchange (fededge.protocol) and the codec a payload names."""

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fededge import keys
from fededge.compress import MalformedPayloadError
from fededge.compress.update import COMPRESSORS, UNBIASED, UpdateConfig, UpdateEncoder
from fededge.compress.wire import peek_codec
from fededge.protocol import (
    bundle_payloads, bundle_record, cast_downlink, config_error_detail, config_error_reason, decode_downlink,
    decode_update_record,
)


@pytest.mark.parametrize("compressor", [c for c in COMPRESSORS if c != "none"])
def test_wire_codecs_are_the_codecs_the_encoder_writes(compressor):
    """What a server checks an update against (UpdateConfig.wire_codecs) is what a client
    with the same config sends: the main codec for large tensors, the small codec for
    small and 1-D ones, raw for normalisation statistics."""
    small_codec = "fp16" if compressor != "fp16" else "bf16"  # apart from the main codec
    update = UpdateConfig(compressor=compressor, small_codec=small_codec, error_feedback=compressor not in (
        "dgc", "powersgd", *UNBIASED))
    g = torch.Generator().manual_seed(0)
    delta = {"conv": torch.randn(8, 4, 3, 3, generator=g), "vec": torch.randn(300, generator=g),
             "bias": torch.randn(8, generator=g), "bn.running_var": torch.rand(300, generator=g)}
    sent = {name: peek_codec(p) for name, p in UpdateEncoder(update, stream=1).encode(delta, round=0).items()}
    codecs = update.wire_codecs()
    main = codecs[0]
    assert sent["conv"] == main and sent["bias"] == sent["vec"] == small_codec
    assert sent["bn.running_var"] == "raw"
    assert set(sent.values()) == set(codecs) == {main, small_codec, "raw"}
    assert main == ("topk" if compressor == "dgc" else compressor)
    assert UpdateConfig().wire_codecs() == ()


def test_peek_codec_refuses_what_is_not_a_payload_by_name():
    with pytest.raises(MalformedPayloadError, match="bad magic"):
        peek_codec(b"XX\x01\x09")
    with pytest.raises(MalformedPayloadError, match="unknown codec id 200"):
        peek_codec(b"FE\x01\xc8")
    with pytest.raises(MalformedPayloadError, match="shorter than the 7-byte header"):
        peek_codec(b"FE")


def test_a_bundle_decodes_to_its_tensors_and_raw_arrays_pass_as_they_are():
    encoder = UpdateEncoder(UpdateConfig(compressor="fp16"), stream=0)
    delta = {"w": torch.linspace(-1, 1, 300).view(20, 15), "b": torch.ones(3)}
    payloads = encoder.encode(delta, round=0)
    rec = bundle_record(payloads)
    assert list(rec.keys()) == [keys.BUNDLE] and bundle_payloads(rec) == payloads
    out = decode_update_record(rec, max_elements=300)
    assert torch.equal(out["w"], delta["w"].half().float()) and torch.equal(out["b"], delta["b"])
    raw = decode_update_record(ArrayRecord(delta), max_elements=300)
    assert all(torch.equal(raw[k], v) for k, v in delta.items())


def test_a_cast_downlink_decodes_to_the_rounded_model_with_its_other_records():
    model = {"w": torch.tensor([1.0 + 2**-12, -3.0]), "steps": torch.tensor([7], dtype=torch.int64)}
    content = RecordDict({**cast_downlink(ArrayRecord(model), "fp16"), keys.CONFIG: ConfigRecord({"lr": 0.1})})
    assert keys.ARRAYS not in content and keys.UNCOMPRESSED in content
    out = decode_downlink(content)
    got = out[keys.ARRAYS].to_torch_state_dict()
    assert torch.equal(got["w"], model["w"].half().float())  # rounded to fp16, as the client gets it
    assert torch.equal(got["steps"], model["steps"])  # integer buffers travel as they are
    assert out[keys.CONFIG]["lr"] == 0.1 and set(out.keys()) == {keys.ARRAYS, keys.CONFIG}


def test_config_error_marker_round_trips():
    reason = config_error_reason(ValueError("lower min-partition-size"))
    assert reason.startswith(keys.CONFIG_ERROR)
    assert config_error_detail(reason) == "lower min-partition-size"
    assert config_error_detail("RuntimeError: a bug") is None

