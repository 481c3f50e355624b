#!/usr/bin/env python
"""Error feedback (EF, a residual) against EF21 (a tracked estimate) on the reduced ResNet.

Issue 36: on the 6,000-image reduced ResNet the codecs with memory end 2-3.4 points under
the uncompressed run at 40 rounds, late rather than unstable. EF21 (Richtarik, Sokolov and
Fatkhullin, 2021, "EF21: A New, Simpler, Theoretically Better, and Practically Faster
Error Feedback") is the literature's other error feedback: each client keeps an estimate
``g_i`` of its update and sends the compressed change, ``c_i = C(delta_i - g_i)``,
``g_i += c_i``; the server keeps ``G`` (the average of the ``g_i``), adds the average
``c_i`` to it and applies ``G`` (dense) every round, where EF (Seide et al. 2014; Stich
et al. 2018; what fededge's ``error-feedback=true`` does) sends ``C(delta_i + e_i)``,
keeps ``e_i`` = what was left out, and the server applies the average of what was sent.
Both keep the same state per client and send the same bytes.

This is a probe, not fededge's runtime: plain torch, so that the rule is the only
difference. The task is bench_codecs_cnn's ``resnet-synth`` at ``local-lr=0.05``
(``resnet18-w8`` on ``synthetic-images``, 6,000 images at amplitude 0.1, IID over 10
clients, every client every round, K = 10 local steps of batch 32, momentum 0.9 started
fresh each round), with the 1-D tensors and the BatchNorm statistics sent raw and
averaged (fededge's runs used ``norm-stats=global``: these absolute accuracies are not
bench_codecs_cnn's). Codecs, per tensor of two dimensions or more: ``topk`` (1%),
``sign`` (the sign times the mean absolute value, fededge's ``signsgd``), ``psgd2``
(PowerSGD rank 2, one power step a round from each client's own warm-started Q).

Example
-------
::

    python benchmarks/probe_ef21.py none topk 1 40        # the uncompressed run of seed 1
    python benchmarks/probe_ef21.py ef sign 1 40
    python benchmarks/probe_ef21.py ef21 sign 1 40

Each prints the test accuracy after every round and a JSON line with all of them.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib

import torch
import torch.nn.functional as F

from fededge.data.datasets import load_dataset
from fededge.models.zoo import build_model

CLIENTS, STEPS, BATCH, LR, MOMENTUM = 10, 10, 32, 0.05, 0.9


def compress(codec: str, x: torch.Tensor, q: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """What the server decodes of ``x`` (``q``: this client's PowerSGD Qs, updated)."""
    if codec == "topk":
        flat = x.flatten()
        idx = flat.abs().topk(max(1, int(flat.numel() * 0.01))).indices
        out = torch.zeros_like(flat)
        out[idx] = flat[idx]
        return out.view_as(x)
    if codec == "sign":
        return x.sign() * x.abs().mean()
    if codec == "psgd2":
        m = x.reshape(x.shape[0], -1)
        if name not in q:
            q[name] = torch.randn(m.shape[1], 2, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
        p, _ = torch.linalg.qr(m @ q[name])
        q[name] = m.t() @ p
        return (p @ q[name].t()).view_as(x)
    raise ValueError(f"codec is topk, sign or psgd2, not {codec!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rule", choices=["none", "ef", "ef21"], help="none: uncompressed (the codec is ignored)")
    ap.add_argument("codec", choices=["topk", "sign", "psgd2"])
    ap.add_argument("seed", type=int)
    ap.add_argument("rounds", type=int)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    ds = load_dataset("synthetic-images", seed=args.seed, synthetic_samples=6000, synthetic_amplitude=0.1)
    model = build_model("resnet18-w8", input_shape=tuple(ds.x_train.shape[1:]), num_classes=ds.num_classes,
                        seed=args.seed)
    perm = torch.randperm(len(ds.y_train), generator=torch.Generator().manual_seed(args.seed))
    parts = [perm[i::CLIENTS] for i in range(CLIENTS)]
    weights = {n for n, p in model.named_parameters() if p.dim() >= 2}  # compressed; the rest raw
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    memory: list[dict[str, torch.Tensor]] = [{} for _ in range(CLIENTS)]  # EF: e_i; EF21: g_i
    qs: list[dict[str, torch.Tensor]] = [{} for _ in range(CLIENTS)]
    tracked: dict[str, torch.Tensor] = {}  # EF21: the server's G
    sampler = torch.Generator().manual_seed(args.seed + 1)

    def accuracy() -> float:
        model.load_state_dict(glob)
        model.eval()
        with torch.no_grad():
            return (model(ds.x_test).argmax(1) == ds.y_test).float().mean().item()

    accs, t0 = [accuracy()], time.time()
    for rnd in range(1, args.rounds + 1):
        avg = {k: torch.zeros_like(v) for k, v in glob.items() if v.is_floating_point()}
        for i in range(CLIENTS):
            model.load_state_dict(glob)
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            for _ in range(STEPS):
                b = parts[i][torch.randint(len(parts[i]), (BATCH,), generator=sampler)]
                opt.zero_grad()
                F.cross_entropy(model(ds.x_train[b]), ds.y_train[b]).backward()
                opt.step()
            trained = model.state_dict()
            for k in avg:
                d = trained[k] - glob[k]
                if args.rule != "none" and k in weights:
                    m = memory[i].get(k, torch.zeros_like(d))
                    if args.rule == "ef":
                        c = compress(args.codec, d + m, qs[i], k)
                        memory[i][k] = d + m - c
                    else:
                        c = compress(args.codec, d - m, qs[i], k)
                        memory[i][k] = m + c
                    d = c
                avg[k] += d / CLIENTS
        for k, a in avg.items():
            if args.rule == "ef21" and k in weights:
                tracked[k] = tracked.get(k, torch.zeros_like(a)) + a
                a = tracked[k]
            glob[k] = glob[k] + a
        for k, v in glob.items():  # BatchNorm's counters: the last client's
            if not v.is_floating_point():
                glob[k] = trained[k]
        accs.append(accuracy())
        print(rnd, round(accs[-1], 4), f"{time.time() - t0:.0f} s", flush=True)
    print(json.dumps({"rule": args.rule, "codec": args.codec, "seed": args.seed, "accs": accs}))


if __name__ == "__main__":
    main()
