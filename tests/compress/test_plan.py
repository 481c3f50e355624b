"""The per-tensor plan: which codec each tensor of an update goes with (issue 36)."""

from __future__ import annotations

import pytest
import torch

from fededge.compress.plan import PlanMismatchError, UpdatePlan, is_statistic, tensor_role
from fededge.compress.update import COMPRESSORS, UNBIASED, UpdateConfig, UpdateEncoder
from fededge.compress.wire import peek_codec
from fededge.models.zoo import build_model


def resnet_state() -> dict[str, torch.Tensor]:
    return build_model("resnet18", input_shape=(3, 32, 32), num_classes=10, seed=0).state_dict()


def config(compressor: str, **kw) -> UpdateConfig:
    ef = compressor not in ("dgc", "powersgd", "none", *UNBIASED)
    return UpdateConfig(compressor=compressor, error_feedback=ef, **kw)


def test_roles_of_a_resnet18():
    sd = resnet_state()
    plan = UpdatePlan.build(config("signsgd"), sd, with_bytes=False)
    by = {e.name: e for e in plan.entries}
    # BatchNorm's statistics: raw whatever their size (layer4's hold 512 values, over
    # compress-min-numel), never the compressor or the small cast.
    assert by["layer4.1.bn2.running_var"].role == "statistic" and by["layer4.1.bn2.running_var"].codec == "raw"
    assert by["layer4.1.bn2.running_mean"].codec == "raw"
    assert by["bn1.num_batches_tracked"].role == "integer" and by["bn1.num_batches_tracked"].codec is None
    # 1-D of 512 elements (a BatchNorm scale, the fc bias is 10): the small codec.
    assert by["layer4.1.bn2.weight"].role == "vector" and by["layer4.1.bn2.weight"].codec == "raw"
    assert by["fc.bias"].role == "small"
    assert by["layer4.1.conv2.weight"].codec == "signsgd" and by["fc.weight"].codec == "signsgd"
    assert all(is_statistic(e.name) == (e.role == "statistic") for e in plan.entries)
    # compress-1d sends the large 1-D ones through the compressor, but never under PowerSGD.
    one_d = UpdatePlan.build(config("signsgd", compress_1d=True), sd, with_bytes=False)
    assert one_d.codec_of("layer4.1.bn2.weight") == "signsgd" and one_d.codec_of("fc.bias") == "raw"
    assert one_d.codec_of("layer4.1.bn2.running_var") == "raw"
    psgd = UpdatePlan.build(config("powersgd", compress_1d=True), sd, with_bytes=False)
    assert psgd.codec_of("layer4.1.bn2.weight") == "raw"
    assert UpdatePlan.build(UpdateConfig(), sd).entries == ()
    assert UpdatePlan.build(config("dgc"), sd, with_bytes=False).codec_of("fc.weight") == "topk"


@pytest.mark.parametrize("compressor", [c for c in COMPRESSORS if c != "none"])
def test_the_encoder_follows_the_plan_and_the_plan_counts_its_bytes(compressor):
    """What a client sends is, tensor by tensor, the codec the plan gives and exactly the
    bytes the plan counts (the steady state for DGC)."""
    model = build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    sd = {k: v for k, v in model.state_dict().items()}
    cfg = config(compressor, small_codec="fp16" if compressor != "fp16" else "bf16", min_numel=64)
    plan = UpdatePlan.build(cfg, sd)
    g = torch.Generator().manual_seed(3)
    delta = {k: torch.randn(v.shape, generator=g) for k, v in sd.items() if v.is_floating_point()}
    steady = cfg.dgc_warmup_rounds + 1 if compressor == "dgc" else 0
    payloads = UpdateEncoder(cfg, stream=5).encode(delta, round=steady)
    assert {k: peek_codec(p) for k, p in payloads.items()} == {e.name: e.codec for e in plan.entries if e.codec}
    sizes = {e.name: e.bytes for e in plan.entries if e.codec}
    if compressor in ("topk", "randk", "dgc", "threshold"):
        # Entropy-coded index sets (and threshold's data-dependent count): the plan's
        # bytes are those of its own random update, an estimate for another.
        assert all(abs(len(p) - sizes[k]) <= max(8, 0.05 * sizes[k]) for k, p in payloads.items())
    else:
        assert {k: len(p) for k, p in payloads.items()} == sizes
    roles = {e.role for e in plan.entries}
    assert {"statistic", "integer", "matrix"} <= roles
    plan.check({k: peek_codec(p) for k, p in payloads.items()})  # accepted whole
    assert plan.payload_bytes < plan.dense_bytes or compressor == "raw"


def test_a_mismatch_is_refused_by_name():
    sd = resnet_state()
    server = UpdatePlan.build(config("topk"), sd, with_bytes=False)
    with pytest.raises(PlanMismatchError, match=r"tensor 'layer4.0.bn1.weight' \(vector, shape \[512\]\) came in "
                                                r"codec 'topk'; this server's plan gives it codec 'raw'"):
        server.check({"conv1.weight": "topk", "layer4.0.bn1.weight": "topk"})
    with pytest.raises(PlanMismatchError, match="'extra.weight' is not in this server's update plan"):
        server.check({"extra.weight": "topk"})
    with pytest.raises(PlanMismatchError, match=r"'bn1.num_batches_tracked' .* no codec \(sent as it is\)"):
        server.check({"bn1.num_batches_tracked": "raw"})


def test_summary_and_json():
    plan = UpdatePlan.build(config("powersgd"), resnet_state())
    lines = plan.summary()
    assert lines[0].startswith("update plan (powersgd)")
    assert any(" statistic " in line and " raw " in line for line in lines)
    assert "x)" in lines[-1] and plan.dense_bytes / plan.payload_bytes > 50
    js = plan.as_json()
    assert {"name", "shape", "role", "codec", "bytes"} == set(js[0])
    assert sum(e["bytes"] for e in js) == plan.payload_bytes


def test_role_rule_on_plain_shapes():
    cfg = config("qsgd", min_numel=10)
    assert tensor_role("w", (4, 4), True, cfg) == "matrix"
    assert tensor_role("w", (3, 3), True, cfg) == "small"
    assert tensor_role("b", (100,), True, cfg) == "vector"
    assert tensor_role("x.running_mean", (4, 4), True, cfg) == "statistic"
    assert tensor_role("n", (), False, cfg) == "integer"
