"""encode_batch (several clients' updates as one batched program) against each client's
own UpdateEncoder.encode: the same payload bytes and the same states, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from fededge.compress.batch import batchable, encode_batch
from fededge.compress.update import UpdateConfig, UpdateEncoder


def _delta(gen: torch.Generator, *, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "conv.weight": torch.randn(8, 3, 3, 3, generator=gen) * scale,
        "fc.weight": torch.randn(10, 61, generator=gen) * scale,  # 610 signs: a part byte at the end
        "fc.bias": torch.randn(10, generator=gen) * scale,  # 1-D: the small codec
        "bn.running_mean": torch.randn(8, generator=gen),  # a statistic
        "tiny.weight": torch.randn(3, 4, generator=gen),  # under min-numel
        "big.bias": torch.randn(300, generator=gen),
    }


def _states(encoders: list[UpdateEncoder]) -> list[dict[str, torch.Tensor]]:
    return [e.state_dict() for e in encoders]


def _same_states(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert [sorted(s) for s in a] == [sorted(s) for s in b]
    for sa, sb in zip(a, b):
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape
            assert torch.equal(sa[k].view(torch.int32), sb[k].view(torch.int32)), k  # bits, -0.0 included


CONFIGS = [
    UpdateConfig(compressor="signsgd", error_feedback=True),
    UpdateConfig(compressor="signsgd", error_feedback=False),
    UpdateConfig(compressor="signsgd", error_feedback=True, lossless=True, compress_1d=True),
    UpdateConfig(compressor="signsgd", error_feedback=True, norm_stats="global", min_numel=8),
    UpdateConfig(compressor="topk", error_feedback=True, topk_ratio=0.05),
    UpdateConfig(compressor="topk", topk_ratio=0.01, lossless=True),
    # No batched form: client by client, still through encode_batch.
    UpdateConfig(compressor="topk", error_feedback=True, topk_ratio=0.05, topk_values="fp16"),
    UpdateConfig(compressor="qsgd", qsgd_levels=7),
    UpdateConfig(compressor="qsgd", qsgd_levels=2, qsgd_bucket=0, lossless=True),
    UpdateConfig(compressor="qsgd", qsgd_levels=255, qsgd_bucket=100, compress_1d=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.compressor}-ef{int(c.error_feedback)}-{c.norm_stats}"
                         f"-z{int(c.lossless)}-1d{int(c.compress_1d)}")
def test_batch_gives_each_clients_own_bytes_and_states(cfg: UpdateConfig) -> None:
    gen = torch.Generator().manual_seed(3)
    clients = 5
    alone = [UpdateEncoder(cfg, stream=s) for s in range(clients)]
    together = [UpdateEncoder(cfg, stream=s) for s in range(clients)]
    for rnd in range(4):
        deltas = [_delta(gen, scale=10.0 ** (c - 2)) for c in range(clients)]
        if rnd == 2:  # an exact zero and a negative zero: sign counts both as +
            deltas[1]["fc.weight"][0, :3] = torch.tensor([0.0, -0.0, 0.0])
        if rnd == 1:  # an all-zero update: signSGD's scale 0, QSGD's buckets of norm 0
            deltas[3]["conv.weight"].zero_()
        if rnd == 3:  # ties at the k-th largest magnitude: top-k breaks them as torch.topk does
            deltas[2]["fc.weight"][:, :40] = 0.5
            deltas[2]["fc.weight"][:, 40:] = -0.5
        expected = [e.encode(copy.deepcopy(d), round=rnd) for e, d in zip(alone, deltas)]
        got = encode_batch(together, deltas, round=rnd)
        assert got == expected
        _same_states(_states(together), _states(alone))


def test_a_client_without_a_residual_beside_clients_with_one() -> None:
    cfg = UpdateConfig(compressor="signsgd", error_feedback=True)
    gen = torch.Generator().manual_seed(0)
    alone = [UpdateEncoder(cfg, stream=s) for s in range(3)]
    together = [UpdateEncoder(cfg, stream=s) for s in range(3)]
    first = [_delta(gen) for _ in range(3)]
    for e in alone[:2]:
        e.encode(copy.deepcopy(first[0]), round=0)
    encode_batch(together[:2], [first[0], first[0]], round=0)
    deltas = [_delta(gen) for _ in range(3)]  # client 2 starts now, with no residual
    assert encode_batch(together, deltas, round=1) == [e.encode(d, round=1) for e, d in zip(alone, deltas)]
    _same_states(_states(together), _states(alone))


@pytest.mark.parametrize("name", ["fc.weight", "fc.bias", "bn.running_mean"])
def test_a_non_finite_update_is_refused_as_the_client_alone_refuses_it(name: str) -> None:
    cfg = UpdateConfig(compressor="signsgd", error_feedback=True)
    gen = torch.Generator().manual_seed(1)
    deltas = [_delta(gen) for _ in range(3)]
    deltas[1][name][2] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf") as alone:
        UpdateEncoder(cfg, stream=1).encode(deltas[1], round=0)
    with pytest.raises(ValueError, match="NaN or Inf") as together:
        encode_batch([UpdateEncoder(cfg, stream=s) for s in range(3)], deltas, round=0)
    assert str(together.value) == str(alone.value)


def test_a_residual_of_another_shape_is_named() -> None:
    cfg = UpdateConfig(compressor="signsgd", error_feedback=True)
    gen = torch.Generator().manual_seed(2)
    encoders = [UpdateEncoder(cfg, stream=s) for s in range(2)]
    encoders[0].load_state_dict({"ef/fc.weight": torch.zeros(5, 5)})
    with pytest.raises(ValueError, match="changed shape"):
        encode_batch(encoders, [_delta(gen), _delta(gen)], round=0)


def test_deltas_of_different_models_are_encoded_each_on_its_own() -> None:
    cfg = UpdateConfig(compressor="signsgd", error_feedback=True)
    gen = torch.Generator().manual_seed(4)
    a, b = _delta(gen), _delta(gen)
    b["fc.weight"] = torch.randn(10, 62, generator=gen)
    alone = [UpdateEncoder(cfg, stream=s) for s in range(2)]
    together = [UpdateEncoder(cfg, stream=s) for s in range(2)]
    assert encode_batch(together, [a, b], round=0) == [e.encode(d, round=0) for e, d in zip(alone, [a, b])]
    _same_states(_states(together), _states(alone))


def test_which_encoders_have_a_batched_form() -> None:
    assert batchable(UpdateEncoder(UpdateConfig(compressor="signsgd", error_feedback=True)))
    assert batchable(UpdateEncoder(UpdateConfig(compressor="signsgd")))
    assert batchable(UpdateEncoder(UpdateConfig(compressor="topk", error_feedback=True)))
    assert not batchable(UpdateEncoder(UpdateConfig(compressor="topk", error_feedback=True, topk_values="bf16")))
    assert batchable(UpdateEncoder(UpdateConfig(compressor="qsgd")))
    assert batchable(UpdateEncoder(UpdateConfig(compressor="powersgd")))
    assert not batchable(UpdateEncoder(UpdateConfig(compressor="dgc")))


#: PowerSGD's batch rounds differently (batched matmuls, one batched QR): its decoded
#: tensors and states agree with each client's own to float32 rounding. The factors of a
#: 10 x 610 matrix differ by ~1e-7 relative; a wrong step (a missed unit-columns scaling,
#: another client's Q, a residual not subtracted) differs by order one.
PSGD_TOL = 1e-4


def _close_payloads(got: dict[str, bytes], expected: dict[str, bytes]) -> None:
    from fededge.compress.codec import decode_any

    assert sorted(got) == sorted(expected)
    for name in expected:
        assert len(got[name]) == len(expected[name]), name
        a, b = decode_any(got[name]), decode_any(expected[name])
        torch.testing.assert_close(a, b, rtol=PSGD_TOL, atol=PSGD_TOL * float(b.abs().max() + 1e-30))


@pytest.mark.parametrize("iters,rank", [(1, 2), (2, 4), (1, 16)], ids=["r2", "r4-iters2", "r16-full"])
def test_powersgd_batch_is_each_clients_own_to_rounding(iters: int, rank: int) -> None:
    """Warm starts over rounds, a client that joins late (fresh Q beside warm ones), a
    zero update (the contractive fallback to the largest rows), a tiny and a huge scale
    (the power-of-two scaling before the QR), a rank that covers the matrix (exact)."""
    cfg = UpdateConfig(compressor="powersgd", powersgd_rank=rank, powersgd_iters=iters, error_feedback=True)
    gen = torch.Generator().manual_seed(7)
    clients = 4
    alone = [UpdateEncoder(cfg, stream=s) for s in range(clients)]
    together = [UpdateEncoder(cfg, stream=s) for s in range(clients)]
    for rnd in range(4):
        live = clients if rnd else clients - 1  # client 3 joins in round 1
        deltas = [_delta(gen, scale=0.1) for _ in range(live)]
        if rnd == 0:  # no residual yet: M is the update itself
            deltas[1]["conv.weight"].mul_(1e-25)
            deltas[2]["conv.weight"].mul_(1e20)
        if rnd == 2 and rank < 8:  # (at full rank M would be the last residual: rounding noise, no factors to check)
            deltas[0]["fc.weight"].zero_()
        expected = [e.encode(copy.deepcopy(d), round=rnd) for e, d in zip(alone[:live], deltas)]
        got = encode_batch(together[:live], deltas, round=rnd)
        for g, e in zip(got, expected):
            _close_payloads(g, e)
        for c, (a, b) in enumerate(zip(together[:live], alone)):
            sa, sb = a.state_dict(), b.state_dict()
            assert sorted(sa) == sorted(sb)
            for k in sa:
                # A residual is rounding noise where the rank covers the matrix: measured
                # against the update it was left from.
                scale = max(float(sb[k].abs().max()), float(deltas[c][k.rpartition(":")[2]].abs().max()))
                torch.testing.assert_close(sa[k], sb[k], rtol=PSGD_TOL, atol=PSGD_TOL * scale + 1e-30, msg=k)


def test_powersgd_batch_refusing_a_client_changes_no_state() -> None:
    """A NaN in one client's matrix: the batch raises that client's error and leaves every
    encoder's Q and residual as they were (PowerSGD adds to its residual in place: the
    client-by-client fallback works on copies), so that each client can then be encoded
    on its own to its own result."""
    cfg = UpdateConfig(compressor="powersgd", powersgd_rank=2, error_feedback=True)
    gen = torch.Generator().manual_seed(8)
    encoders = [UpdateEncoder(cfg, stream=s) for s in range(3)]
    encode_batch(encoders, [_delta(gen) for _ in range(3)], round=0)
    before = _states(encoders)
    deltas = [_delta(gen) for _ in range(3)]
    deltas[1]["fc.weight"][1, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_batch(encoders, deltas, round=1)
    _same_states(_states(encoders), before)


@pytest.mark.parametrize("cfg", [UpdateConfig(compressor="signsgd", error_feedback=True),
                                 UpdateConfig(compressor="topk", error_feedback=True, topk_ratio=0.05),
                                 UpdateConfig(compressor="qsgd", qsgd_levels=7),
                                 UpdateConfig(compressor="powersgd", powersgd_rank=2, error_feedback=True)],
                         ids=lambda c: c.compressor)
def test_small_chunks_give_the_same_result(cfg: UpdateConfig, monkeypatch) -> None:
    """Chunks of two clients for the 10 x 61 matrix, six for the conv's, one (the
    client-by-client path) for a matrix over the chunk: the chunking changes nothing."""
    from fededge.compress import batch

    monkeypatch.setattr(batch, "CHUNK_VALUES", 1300)
    gen = torch.Generator().manual_seed(9)
    alone = [UpdateEncoder(cfg, stream=s) for s in range(5)]
    together = [UpdateEncoder(cfg, stream=s) for s in range(5)]
    for rnd in range(3):
        deltas = [_delta(gen) | {"wide.weight": torch.randn(2, 700, generator=gen)} for _ in range(5)]
        expected = [e.encode(copy.deepcopy(d), round=rnd) for e, d in zip(alone, deltas)]
        got = encode_batch(together, deltas, round=rnd)
        if cfg.compressor == "powersgd":
            for g, e in zip(got, expected):
                _close_payloads(g, e)
        else:
            assert got == expected
            _same_states(_states(together), _states(alone))


@pytest.mark.parametrize("cfg", [UpdateConfig(compressor="powersgd", powersgd_rank=2, error_feedback=True),
                                 UpdateConfig(compressor="dgc"),
                                 UpdateConfig(compressor="signsgd", error_feedback=True)],
                         ids=lambda c: c.compressor)
def test_the_client_by_client_path_is_all_or_nothing_too(cfg: UpdateConfig) -> None:
    """Encoders of different configs (no batch: each encoded as encode() would): a NaN in
    the last client's last matrix raises with every state as it was."""
    gen = torch.Generator().manual_seed(10)
    other = UpdateConfig(compressor=cfg.compressor, error_feedback=cfg.error_feedback, min_numel=8)
    encoders = [UpdateEncoder(cfg, stream=0), UpdateEncoder(other, stream=1)]
    encode_batch(encoders, [_delta(gen), _delta(gen)], round=0)
    before = _states(encoders)
    deltas = [_delta(gen), _delta(gen)]
    deltas[1]["fc.weight"][3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_batch(encoders, deltas, round=1)
    _same_states(_states(encoders), before)
