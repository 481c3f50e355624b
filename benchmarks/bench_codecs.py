#!/usr/bin/env python
"""Codec speed on a ResNet-18-sized set of tensors, next to torch's own DDP hooks.

The tensors are standard-normal float32 tensors with the parameter shapes of the
CIFAR ResNet-18 of :func:`fededge.models.zoo.build_model` (62 tensors, 11,173,962
elements, 44.7 MB as float32), drawn once from a seeded generator. Every row below
works on exactly these tensors.

fededge rows
    For each codec: encode every tensor to bytes, then decode every payload with
    :func:`fededge.compress.decode_any` (header parsing, validation and the finite check
    included). Stateless codecs get a fresh seeded ``torch.Generator`` per repetition.
    Stateful encoders keep their state across repetitions (as a client does across
    rounds): ``PowerSGDEncoder`` (rank 2, warm-started Q, error feedback; 1-D tensors
    raw), ``DGCEncoder`` (final sparsity 0.999, timed at rounds past the warm-up) and
    ``ErrorFeedback`` around onebit and topk. The stateless ``powersgd`` codec rejects
    1-D tensors, so they go raw there too, as ``PowerSGDEncoder`` sends them.

torch rows (the real hooks, not re-implementations)
    A single-process gloo process group (``file://`` rendezvous in a temporary
    directory, world size 1) and a real ``DistributedDataParallel`` around the same
    ResNet-18. One forward/backward pass with a capturing comm hook hands over DDP's
    own ``GradBucket`` objects (``GradBucket`` has no Python constructor), after DDP's
    bucket rebuild, so the layout is DDP's steady state. Before every timed call each
    bucket's flat buffer is refilled (untimed) with the benchmark tensors, in the order
    DDP put the parameters in the bucket; the hook is then called on every bucket in
    index order and each returned Future is waited on.

    * ``fp16_compress_hook(None, bucket)``: ``buffer.to(float16).div_(world_size)``,
      all-reduce of the float16 tensor, then ``buffer.copy_(result)`` (back to float32
      in place). Cast first, then divide: that is the order in this torch version's
      ``default_hooks._compress_hook``.
    * ``powerSGD_hook(state, bucket)`` with ``PowerSGDState(process_group=None,
      matrix_approximation_rank=2, start_powerSGD_iter=2, use_error_feedback=True,
      warm_start=True)`` and the other fields at their defaults (min_compression_rate 2,
      orthogonalization_epsilon 0, no same-shape batching). Two untimed warm-up
      iterations run the vanilla all-reduce the hook insists on first, one more
      allocates P, Q and the error; timed calls are all warm-started with error
      feedback. Per bucket the hook adds the error, clones the buffer, all-reduces the
      1-D tensors uncompressed, orthogonalizes Q (Gram-Schmidt at rank 2), P = M Q,
      all-reduces P, orthogonalizes P, Q = M^T P, all-reduces Q, writes P Q^T into the
      buffer and stores the new error. With world size 1 the all-reduces are
      identities, but they are real gloo calls and cost something; the script times the
      same all-reduces alone so their share is visible.

What is timed differs, and the comparison says so: fededge's PowerSGD row serialises P
and Q to a versioned byte payload, parses it back, multiplies P Q^T again on the
decoding side (the encoder needs its own P Q^T for the residual, because client and
server are different machines) and checks the result is finite; the hook keeps
everything in memory, computes P Q^T once in place, and does three all-reduces. The
issue's goal is fededge's PowerSGD encode + decode at most 1.2x the hook's time.

Timing: ``time.perf_counter``; one untimed warm-up per row, then ``--repeat``
repetitions, interleaved across rows (rep 1 of every row, then rep 2, ...) so a busy
moment on a shared machine does not land on one row only; medians are reported. The
PowerSGD head-to-head then runs ``--pair-repeat`` more interleaved pairs (fededge,
hook, all-reduces alone) and reports their medians and minimums.

Examples
--------
::

    python benchmarks/bench_codecs.py                    # about 1-3 min on 2 cores
    python benchmarks/bench_codecs.py --threads 1 --repeat 5 --json codecs.json
    python benchmarks/bench_codecs.py --only powersgd-ef,fp16 --pair-repeat 40
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fededge.compress import (
    DGCConfig, DGCEncoder, ErrorFeedback, PowerSGDConfig, PowerSGDEncoder, build_codec, decode_any,
)
from fededge.models.zoo import build_model

MB = 1e6


# --------------------------------------------------------------------------- tensors


def make_model(seed: int) -> torch.nn.Module:
    return build_model("resnet18", input_shape=(3, 32, 32), num_classes=10, seed=seed)


def make_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Standard-normal float32 tensors with the ResNet-18 parameter shapes, by name."""
    model = make_model(seed)
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=g, dtype=torch.float32) for name, p in model.named_parameters()}


# --------------------------------------------------------------------------- rows


@dataclass
class Row:
    label: str
    group: str  # "fededge" or "torch"
    note: str = ""
    enc: list[float] = field(default_factory=list)
    dec: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    payload_bytes: int | None = None
    error: str | None = None
    first: float | None = None  # the untimed warm-up call (first-call costs)

    def med(self, xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None


class FededgeRow:
    """encode all tensors -> payloads (timed), decode all payloads (timed)."""

    def __init__(self, label: str, note: str, encode: Callable[[str, torch.Tensor, int], bytes],
                 keep: bool = False):
        self.row = Row(label, "fededge", note)
        self._encode = encode
        self.calls = 0
        self.keep = keep  # keep the last decoded tensors (for the checks against torch)
        self.last_decoded: dict[str, torch.Tensor] = {}

    def run(self, tensors: dict[str, torch.Tensor], timed: bool) -> float:
        """One encode + decode of every tensor; returns its seconds."""
        call = self.calls
        self.calls += 1
        t0 = time.perf_counter()
        payloads = [self._encode(name, x, call) for name, x in tensors.items()]
        t1 = time.perf_counter()
        decoded = [decode_any(p) for p in payloads]
        t2 = time.perf_counter()
        if len(decoded) != len(tensors):
            raise AssertionError("decoded a different number of tensors")
        self.row.payload_bytes = sum(len(p) for p in payloads)
        self.last_decoded = dict(zip(tensors, decoded)) if self.keep else {}
        if not timed and self.row.first is None:
            self.row.first = t2 - t0
        if timed:
            self.row.enc.append(t1 - t0)
            self.row.dec.append(t2 - t1)
            self.row.total.append(t2 - t0)
        return t2 - t0


def stateless(name: str, **params: Any) -> Callable[[str, torch.Tensor, int], bytes]:
    codec = build_codec(name, **params)
    gens: dict[int, torch.Generator] = {}

    def encode(tensor_name: str, x: torch.Tensor, call: int) -> bytes:
        g = gens.get(call)
        if g is None:
            gens.clear()
            g = gens[call] = torch.Generator().manual_seed(1000 + call)
        return codec.encode(x, generator=g)

    return encode


def stateless_powersgd(rank: int) -> Callable[[str, torch.Tensor, int], bytes]:
    psgd = stateless("powersgd", rank=rank)
    raw = build_codec("raw")

    def encode(tensor_name: str, x: torch.Tensor, call: int) -> bytes:
        return raw.encode(x) if x.dim() < 2 else psgd(tensor_name, x, call)

    return encode


def fededge_rows(rank: int, tau: float, ratio: float, qsgd_levels: int, qsgd_bucket: int) -> list[FededgeRow]:
    rows = [
        FededgeRow("raw", "float32 + header", stateless("raw")),
        FededgeRow("fp16", "", stateless("fp16"), keep=True),
        FededgeRow("bf16", "", stateless("bf16")),
        FededgeRow("int8", "per-tensor scale", stateless("int8")),
        FededgeRow("qsgd", f"levels={qsgd_levels} bucket={qsgd_bucket}",
                   stateless("qsgd", levels=qsgd_levels, bucket=qsgd_bucket)),
        FededgeRow("terngrad", "", stateless("terngrad")),
        FededgeRow("onebit", "", stateless("onebit")),
        FededgeRow("signsgd", "", stateless("signsgd")),
        FededgeRow("threshold", f"tau={tau:g}", stateless("threshold", tau=tau)),
        FededgeRow("topk", f"ratio={ratio:g}", stateless("topk", ratio=ratio)),
        FededgeRow("randk", f"ratio={ratio:g}", stateless("randk", ratio=ratio)),
        FededgeRow("powersgd", f"stateless, rank={rank}, 1-D raw", stateless_powersgd(rank)),
    ]
    ps = PowerSGDEncoder(PowerSGDConfig(rank=rank, seed=0))
    rows.append(FededgeRow("powersgd-ef", f"PowerSGDEncoder rank={rank}, warm start + EF, 1-D raw",
                           lambda n, x, call: ps.encode(n, x), keep=True))
    dgc_cfg = DGCConfig(final_sparsity=0.999)
    dgc = DGCEncoder(dgc_cfg)
    rows.append(FededgeRow("dgc", f"DGCEncoder final_sparsity=0.999, rounds >= {dgc_cfg.warmup_rounds}",
                           lambda n, x, call: dgc.encode(n, x, round=dgc_cfg.warmup_rounds + call)))
    ef_onebit = ErrorFeedback(build_codec("onebit"))
    rows.append(FededgeRow("ef+onebit", "ErrorFeedback(onebit)",
                           lambda n, x, call: ef_onebit.encode(n, x, generator=torch.Generator().manual_seed(call))))
    ef_topk = ErrorFeedback(build_codec("topk", ratio=ratio))
    rows.append(FededgeRow("ef+topk", f"ErrorFeedback(topk ratio={ratio:g})",
                           lambda n, x, call: ef_topk.encode(n, x, generator=torch.Generator().manual_seed(call))))
    return rows


# --------------------------------------------------------------------------- torch hooks


class StandInBucket:
    """Duck-typed GradBucket (only with --bucket standin): what the hooks call on one."""

    def __init__(self, index: int, count: int, buffer: torch.Tensor, shapes: list[torch.Size]):
        self._index, self._count, self._buffer, self._shapes = index, count, buffer, shapes

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        out, off = [], 0
        for s in self._shapes:
            n = s.numel()
            out.append(self._buffer[off:off + n].view(s))
            off += n
        return out


class TorchHooks:
    """A 1-process gloo group, DDP's real GradBuckets filled with the benchmark tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], seed: int, bucket_mode: str, bucket_cap_mb: float):
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        self.dist = dist
        self.default_hooks = default_hooks
        self.powerSGD_hook = powerSGD_hook
        self.tensors = tensors
        self._tmp = tempfile.TemporaryDirectory(prefix="bench_codecs_pg_")
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{self._tmp.name}/rendezvous")
        self.world_size = dist.get_world_size()
        self.ddp = None
        #: per bucket, in index order: (bucket, names of its parameters in buffer order)
        self.buckets: list[tuple[Any, list[str]]] = []
        if bucket_mode == "ddp":
            self._capture_ddp_buckets(seed, bucket_cap_mb)
            self.bucket_kind = (f"real GradBuckets captured from DDP (bucket_cap_mb={bucket_cap_mb:g}, "
                                "after DDP's bucket rebuild)")
        else:
            names = list(reversed(list(tensors)))
            buf = torch.empty(sum(tensors[n].numel() for n in names))
            self.buckets = [(StandInBucket(0, 1, buf, [tensors[n].shape for n in names]), names)]
            self.bucket_kind = "one duck-typed stand-in bucket holding every tensor (--bucket standin)"
        covered = sorted(n for _, names in self.buckets for n in names)
        if covered != sorted(tensors):
            raise AssertionError("the buckets do not hold exactly the benchmark tensors")
        self.psgd_state = None

    def _capture_ddp_buckets(self, seed: int, bucket_cap_mb: float) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = make_model(seed)
        by_id = {id(p): n for n, p in model.named_parameters()}
        self.ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
        captured: dict[int, Any] = {}

        def capture(_state: Any, bucket: Any) -> torch.futures.Future:
            captured[bucket.index()] = bucket
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        # DDP checks the annotations as objects; this module's are strings (PEP 563).
        capture.__annotations__ = {"bucket": self.dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        self.ddp.register_comm_hook(None, capture)
        g = torch.Generator().manual_seed(seed)
        for _ in range(2):  # DDP rebuilds its buckets after the first iteration
            captured.clear()
            self.ddp.zero_grad(set_to_none=True)
            self.ddp(torch.randn(2, 3, 32, 32, generator=g)).sum().backward()
        for i in sorted(captured):
            b = captured[i]
            self.buckets.append((b, [by_id[id(p)] for p in b.parameters()]))

    def fill(self) -> None:
        """Copy the benchmark tensors into the bucket buffers (untimed; the hooks work in place)."""
        for bucket, names in self.buckets:
            torch.cat([self.tensors[n].reshape(-1) for n in names], out=bucket.buffer())

    def flat_input(self) -> torch.Tensor:
        return torch.cat([self.tensors[n].reshape(-1) for _, names in self.buckets for n in names])

    def flat_output(self) -> torch.Tensor:
        return torch.cat([b.buffer() for b, _ in self.buckets])

    def fp16(self) -> float:
        self.fill()
        t0 = time.perf_counter()
        futs = [self.default_hooks.fp16_compress_hook(None, b) for b, _ in self.buckets]
        for f in futs:
            f.wait()
        return time.perf_counter() - t0

    def fp16_bytes(self) -> int:
        return 2 * sum(b.buffer().numel() for b, _ in self.buckets)

    def powersgd_setup(self, rank: int) -> None:
        ph = self.powerSGD_hook
        self.psgd_state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                           use_error_feedback=True, warm_start=True)
        # iterations 0 and 1: vanilla all-reduce (the hook's rule); iteration 2: first PowerSGD
        # step, which allocates P, Q and the error. None of them is timed.
        for _ in range(3):
            self.powersgd()
        if self.psgd_state.iter != 3 or len(self.psgd_state.p_memory_dict) != len(self.buckets):
            raise AssertionError(f"PowerSGD hook not active after warm-up (iter {self.psgd_state.iter})")

    def powersgd(self) -> float:
        self.fill()
        t0 = time.perf_counter()
        for b, _ in self.buckets:  # DDP's order; the last index advances state.iter
            self.powerSGD_hook.powerSGD_hook(self.psgd_state, b).wait()
        return time.perf_counter() - t0

    def powersgd_elements(self) -> tuple[int, int]:
        """(elements all-reduced uncompressed, elements of P and Q) per call."""
        st = self.psgd_state
        pq = sum(st.p_memory_dict[i].numel() + st.q_memory_dict[i].numel() for i in st.p_memory_dict)
        low_rank = 0
        for b, _ in self.buckets:
            for t in b.gradients():
                n, m = t.shape[0], t.numel() // t.shape[0]
                r = min(n, m, st.matrix_approximation_rank)
                if (n + m) * r * st.min_compression_rate < n * m:
                    low_rank += t.numel()
        total = sum(b.buffer().numel() for b, _ in self.buckets)
        return total - low_rank, pq

    def allreduces_alone(self) -> float:
        """The powerSGD hook's three all-reduces per bucket, same sizes, nothing else."""
        st = self.psgd_state
        bufs = []
        for b, _ in self.buckets:
            i = b.index()
            n_uncompressed = sum(t.numel() for t in b.gradients() if not self._compressed(t))
            bufs += [torch.zeros(n_uncompressed), st.p_memory_dict[i].clone(), st.q_memory_dict[i].clone()]
        t0 = time.perf_counter()
        for x in bufs:
            self.dist.all_reduce(x, async_op=True).get_future().wait()
        return time.perf_counter() - t0

    def _compressed(self, t: torch.Tensor) -> bool:
        st = self.psgd_state
        n, m = t.shape[0], t.numel() // t.shape[0]
        r = min(n, m, st.matrix_approximation_rank)
        return (n + m) * r * st.min_compression_rate < n * m

    def close(self) -> None:
        self.buckets.clear()
        self.psgd_state = None
        self.ddp = None
        gc.collect()
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
        self._tmp.cleanup()


# --------------------------------------------------------------------------- report


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).norm() / x.double().norm())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                    help="torch.set_num_threads (default: min(2, cpu count))")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions per row after one warm-up (default 3)")
    ap.add_argument("--pair-repeat", type=int, default=20,
                    help="extra interleaved fededge/torch PowerSGD pairs for the ratio line (default 20)")
    ap.add_argument("--rank", type=int, default=2)
    ap.add_argument("--ratio", type=float, default=0.001, help="topk / randk ratio (default 0.001)")
    ap.add_argument("--tau", type=float, default=1e-3, help="threshold tau (default 1e-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bucket", choices=["ddp", "standin"], default="ddp",
                    help="torch hooks get DDP's real GradBuckets (default) or one duck-typed stand-in")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket_cap_mb (default 25, DDP's own)")
    ap.add_argument("--only", default="", help="comma-separated fededge row labels to run (default: all)")
    ap.add_argument("--skip-torch", action="store_true", help="no torch hook rows")
    ap.add_argument("--json", default="", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.pair_repeat < 0 or args.threads < 1:
        ap.error("--repeat and --threads must be >= 1, --pair-repeat >= 0")

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    tensors = make_tensors(args.seed)
    n_elem = sum(t.numel() for t in tensors.values())
    f32_bytes = 4 * n_elem

    rows = fededge_rows(args.rank, args.tau, args.ratio, qsgd_levels=16, qsgd_bucket=512)
    if args.only:
        want = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = want - {r.row.label for r in rows}
        if unknown:
            ap.error(f"unknown --only label(s) {sorted(unknown)}; choose from {[r.row.label for r in rows]}")
        rows = [r for r in rows if r.row.label in want]

    hooks: TorchHooks | None = None
    bucket_info = ""
    torch_error = None
    fp16_row = Row("torch fp16_compress_hook", "torch", "")
    psgd_row = Row("torch powerSGD_hook", "torch", "")
    if not args.skip_torch:
        try:
            hooks = TorchHooks(tensors, args.seed, args.bucket, args.bucket_cap_mb)
            hooks.powersgd_setup(args.rank)
            fp16_row.note = f"world size {hooks.world_size}, gloo"
            psgd_row.note = f"rank {args.rank}, warm start + EF, world size {hooks.world_size}, gloo"
        except Exception as e:  # report and go on with the fededge rows
            torch_error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            if hooks is not None:
                hooks.close()
            hooks = None

    setup_s = time.perf_counter() - started
    print(f"# bench_codecs: {len(tensors)} tensors, {n_elem:,} elements ({f32_bytes / MB:.2f} MB float32), "
          f"threads {torch.get_num_threads()}, {args.repeat} reps + 1 warm-up", flush=True)
    try:
        # warm-up (rep -1) and timed reps, interleaved across rows
        for rep in range(-1, args.repeat):
            timed = rep >= 0
            for fr in rows:
                try:
                    if fr.row.error is None:
                        fr.run(tensors, timed)
                except Exception as e:
                    fr.row.error = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
            if hooks is not None:
                t = hooks.fp16()
                if timed:
                    fp16_row.total.append(t)
                elif fp16_row.first is None:
                    fp16_row.first = t
                t = hooks.powersgd()
                if timed:
                    psgd_row.total.append(t)
                elif psgd_row.first is None:
                    psgd_row.first = t
            print(f"#   {'warm-up' if not timed else f'rep {rep + 1}/{args.repeat}'} done "
                  f"at {time.perf_counter() - started:.0f} s", flush=True)

        # checks: torch's fp16 round trip must equal fededge's bit for bit
        checks: list[str] = []
        fp16_fe = next((r for r in rows if r.row.label == "fp16" and r.row.error is None), None)
        if hooks is not None:
            fp16_row.payload_bytes = hooks.fp16_bytes()
            hooks.fp16()
            out = hooks.flat_output()
            want = hooks.flat_input().half().float()
            checks.append(f"torch fp16 hook output == x.half().float(): {torch.equal(out, want)}")
            if fp16_fe is not None:
                fe = torch.cat([fp16_fe.last_decoded[n].reshape(-1) for _, names in hooks.buckets for n in names])
                checks.append(f"torch fp16 hook output == fededge fp16 decode (bit-exact): {torch.equal(out, fe)}")
            unc, pq = hooks.powersgd_elements()
            psgd_row.payload_bytes = 4 * (unc + pq)

        # PowerSGD head-to-head
        pair: dict[str, list[float]] = {"fededge": [], "torch": [], "allreduce": []}
        ps_fe = next((r for r in rows if r.row.label == "powersgd-ef" and r.row.error is None), None)
        if ps_fe is not None and hooks is not None:
            for _ in range(args.pair_repeat):
                pair["fededge"].append(ps_fe.run(tensors, timed=False))
                pair["torch"].append(hooks.powersgd())
                pair["allreduce"].append(hooks.allreduces_alone())
            # relative error of one more step on each side (same input, both warm-started with EF)
            x = torch.cat([tensors[n].reshape(-1) for _, names in hooks.buckets for n in names])
            ps_fe.run(tensors, timed=False)
            fe_out = torch.cat([ps_fe.last_decoded[n].reshape(-1) for _, names in hooks.buckets for n in names])
            hooks.powersgd()
            checks.append(f"PowerSGD ||x - decoded|| / ||x|| after {ps_fe.calls} steps: fededge "
                          f"{rel_err(x, fe_out):.4f}, torch hook {rel_err(x, hooks.flat_output()):.4f} "
                          "(both include error feedback; random data has no low-rank structure)")
    finally:
        if hooks is not None:
            bucket_info = (f"torch hooks: {hooks.bucket_kind}; {len(hooks.buckets)} bucket(s) of "
                           f"{[b.buffer().numel() for b, _ in hooks.buckets]} elements")
            hooks.close()

    # ---- table
    all_rows = [fr.row for fr in rows] + ([fp16_row, psgd_row] if not args.skip_torch else [])
    head = (f"{'codec':<26} {'encode s':>9} {'decode s':>9} {'total s':>9} {'payload MB':>11} {'ratio':>8} "
            f"{'1st s':>7}  note")
    print()
    print(head)
    print("-" * len(head))
    for r in all_rows:
        if r.group == "torch" and r is fp16_row:
            print("-" * len(head))
        if r.error is not None or (r.group == "torch" and torch_error is not None):
            print(f"{r.label:<26} failed: {r.error or torch_error}")
            continue
        ratio = None if not r.payload_bytes else f32_bytes / r.payload_bytes
        print(f"{r.label:<26} {fmt(r.med(r.enc)):>9} {fmt(r.med(r.dec)):>9} {fmt(r.med(r.total)):>9} "
              f"{fmt(None if r.payload_bytes is None else r.payload_bytes / MB):>11} {fmt(ratio, '.1f'):>8} "
              f"{fmt(r.first, '.2f'):>7}  {r.note}")
    print()
    print(f"medians of {args.repeat} reps. payload: fededge bytes on the wire (headers included); torch rows: "
          "bytes one worker all-reduces (fp16: 2 B/element; powerSGD: 1-D tensors as float32 + P + Q). "
          f"ratio: {f32_bytes / MB:.2f} MB float32 / payload. torch hooks are one call per bucket, "
          "encode and decode not separable. 1st s: the untimed warm-up call (torch powerSGD_hook: its 4th call, "
          "after the setup's 3).")
    print(f"setup (tensors, model, process group, DDP bucket capture, hook warm-up): {setup_s:.1f} s")
    if bucket_info:
        print(bucket_info)

    # ---- PowerSGD ratio line
    verdict = None
    if pair["fededge"]:
        fe_med, th_med, ar_med = (statistics.median(pair[k]) for k in ("fededge", "torch", "allreduce"))
        ratio_med = fe_med / th_med
        ratio_min = min(pair["fededge"]) / min(pair["torch"])
        verdict = ratio_med <= 1.2
        print()
        print(f"PowerSGD rank {args.rank}, {args.pair_repeat} interleaved pairs: fededge PowerSGDEncoder encode + "
              f"decode_any median {fe_med:.4f} s (min {min(pair['fededge']):.4f}); torch powerSGD_hook median "
              f"{th_med:.4f} s (min {min(pair['torch']):.4f}), of which its all-reduces alone ~{ar_med:.4f} s")
        print(f"PowerSGD ratio fededge / torch: {ratio_med:.2f}x (medians), {ratio_min:.2f}x (minimums); "
              f"goal <= 1.2x: {'MET' if verdict else 'NOT MET'}")
        print("  (fededge: serialise P, Q to bytes + parse + P Q^T again on the decoder + finite check, no "
              "all-reduce; torch: in memory, P Q^T once, three real gloo all-reduces at world size 1)")
    for c in checks:
        print("check: " + c)

    # ---- provenance
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    print()
    print(f"command: {command}")
    print(f"date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {platform.platform()}")
    print(f"threads: torch.get_num_threads()={torch.get_num_threads()}, "
          f"interop={torch.get_num_interop_threads()}, os.cpu_count()={os.cpu_count()}, "
          f"loadavg={'-' if load is None else ' '.join(f'{v:.2f}' for v in load)}")
    print(f"wall: {time.perf_counter() - started:.1f} s")

    if args.json:
        out = {
            "command": command, "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "elements": n_elem, "float32_bytes": f32_bytes, "repeat": args.repeat,
            "rows": [{"label": r.label, "group": r.group, "note": r.note, "encode_s": r.enc, "decode_s": r.dec,
                      "total_s": r.total, "payload_bytes": r.payload_bytes, "error": r.error or
                      (torch_error if r.group == "torch" else None)} for r in all_rows],
            "powersgd_pairs": pair, "powersgd_goal_met": verdict, "checks": checks,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    failed = any(r.error for r in all_rows) or torch_error is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
