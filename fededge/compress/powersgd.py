"""PowerSGD: rank-r compression by one step of power iteration, with error feedback.

Vogels, Karimireddy and Jaggi, 2019, "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization". A tensor with two or more dimensions is viewed as the
matrix M of shape (shape[0], prod(shape[1:])) (a conv weight (out, in, kh, kw) becomes
(out, in*kh*kw)) and sent as two thin factors P (n x r) and Q (m x r); the receiver
computes P Q^T.

Star topology versus all-reduce
-------------------------------
The original runs inside an all-reduce: every worker computes P_i = M_i Q, the workers
all-reduce P = mean(P_i) and orthogonalize it, then compute Q_i = M_i^T P and all-reduce
Q = mean(Q_i). Two round trips, and the result P Q^T is the rank-r projection of the
*average* matrix. fededge's clients talk to a server in one round trip, so each client i
runs the power step on its own M_i and sends (P_i, Q_i); the server averages the products
P_i Q_i^T. The average of products is not the product of averages: with K clients the
server receives a matrix of rank up to K r, each client's error feedback corrects its own
approximation (not the shared one), and the warm start reuses each client's own Q rather
than a common one. This costs K times the server-side reconstruction and loses the
"compress once, all-reduce linearly" property, but needs no extra round trip. The exact
two-round-trip variant is not built.

Pure: no Flower.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import torch

from fededge.compress._bits import check_body_size, finite_f32s, flat32, local_generator, read_params
from fededge.compress.codec import Codec, CodecConfig, ConfiguredCodec, all_finite, register
from fededge.compress.codecs import BF16, FP16, Raw
from fededge.compress.wire import Header, MalformedPayloadError, pack

__all__ = ["PowerSGDConfig", "PowerSGD", "PowerSGDEncoder", "encode_many", "reconstruct"]

_FALLBACKS: dict[str, type[Codec]] = {"raw": Raw, "fp16": FP16, "bf16": BF16}


@dataclass(frozen=True, kw_only=True)
class PowerSGDConfig(CodecConfig):
    """PowerSGD knobs.

    Parameters
    ----------
    rank : int
        The rank r of the approximation (>= 1). Rank 1-4 is typical; 2 already sends
        about 100x fewer bytes than float32 on large layers. Clamped to min(n, m) per
        tensor, where reconstruction becomes exact.
    seed : int
        Seed of the initial Q of each tensor, derived together with the tensor's name, so
        two runs with the same seed compress identically.
    fallback : str
        How tensors with fewer than two dimensions (biases, norms) or no elements are
        sent: ``"raw"`` (float32, lossless), ``"fp16"`` or ``"bf16"``. They carry no
        error feedback.
    iters : int
        Power iterations per encode (:class:`PowerSGDEncoder`; the stateless codec takes
        one). One, warm-started, is the paper's; more track a changing top-r subspace
        closer at the same bytes, for one more pass over M each.
    lossless : bool
        Follow every payload with the zlib stage.
    """

    rank: int = 2
    seed: int = 0
    fallback: str = "raw"
    iters: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 1 <= self.rank <= 65535:
            raise ValueError(f"rank must be an integer in 1..65535, got {self.rank!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.iters, int) or isinstance(self.iters, bool) or not 1 <= self.iters <= 100:
            raise ValueError(f"iters must be an integer in 1..100, got {self.iters!r}")
        if self.fallback not in _FALLBACKS:
            raise ValueError(f"fallback must be one of {sorted(_FALLBACKS)}, got {self.fallback!r}")


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


def _orthogonalize(p: torch.Tensor) -> torch.Tensor:
    # Householder QR: orthonormal columns even when P is rank-deficient (then they still
    # span a space containing P's columns, which is what exactness at full rank needs).
    # LAPACK's float32 QR squares the entries: a delta of 1e-20 or less underflowed to
    # "zero columns" and came back as the identity's, 1e19 or more overflowed. Scaling by
    # a power of two first brings the largest entry into [0.5, 1) and is exact (every
    # operation of the QR then rounds as before): the same bits wherever nothing under-
    # or overflowed, the wire vectors included.
    amax = float(p.abs().max()) if p.numel() else 0.0
    if amax > 0.0 and math.isfinite(amax):
        shift = math.frexp(amax)[1]
        if shift:
            p = (p.double() * 2.0**-shift).float()
    return torch.linalg.qr(p, mode="reduced").Q


def power_step(m: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power iteration: P = orth(M Q), Q' = M^T P. Returns (P, Q').

    Both products run against a contiguous r x m factor: with M row-major, ``M @ Qt.T``
    and ``(P^T M)^T`` stream M once in memory order, where ``M @ Q`` (Q m x r row-major)
    and ``M^T @ P`` ran 4-6x slower here on 512 x 4608 (benchmarks/bench_codecs.py). The
    returned Q' is the transpose view of that contiguous r x m product.
    """
    p = _orthogonalize(m @ q.T.contiguous().T)
    return p, (p.T @ m).T


def _unit_columns(q: torch.Tensor) -> torch.Tensor:
    """Q with each column's largest entry 1. A warm Q is M^T P, of M's scale: M Q would be
    of M's scale squared, and underflow to zero (P then an arbitrary basis) for deltas of
    1e-20 or less, or overflow for 1e19 and more. Only Q's directions matter for P. (Not
    unit norm: a float32 norm squares, and under- or overflows at those same scales.)

    Q may have leading dimensions (clients x m x r: :func:`encode_many`), each Q its own."""
    amax = q.abs().amax(dim=-2, keepdim=True)
    return q / torch.where(amax > 0, amax, torch.ones_like(amax))


def _contractive(m: torch.Tensor, p: torch.Tensor, q: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, Q) that keep at least ``r / n`` of M's energy, so that error feedback stays bounded.

    One warm-started power step captures ``||P Q^T||^2 = ||Q||^2`` (P has orthonormal
    columns) of ``||M||^2``, and nothing bounds that from below: when Q is (nearly)
    orthogonal to M's row space, ``M Q`` is about zero, P an arbitrary basis, and the new
    Q = M^T P about zero too. The warm start is then dead: every later round sends P Q^T of
    about zero, and the residual (M minus what was sent) grows by each round's update
    without bound. A zero update of one tensor for one round (a frozen layer, a client that
    took no step) is enough to get there.

    The r rows of M with the largest norms always capture at least ``r / n`` of its
    energy (the average row holds ``1 / n``). When the power step captures less, this
    sends those rows exactly (P = their unit vectors, Q = the rows), and their Q warm
    starts the next round. PowerSGD with this rule is a contraction,
    ``||M - P Q^T||^2 <= (1 - r / n) ||M||^2``, which is what error feedback's
    convergence needs (Karimireddy et al., 2019; Stich et al., 2018): the residual stays
    below ``sqrt(1 - d) / (1 - sqrt(1 - d))`` times the largest update, d = r / n.
    """
    n = m.shape[0]
    if r >= n:
        return p, q  # P spans everything: exact
    # Energies in float64: float32 squares underflow below 1e-19 and overflow above 1e19.
    rows = torch.linalg.vector_norm(m, dim=1, dtype=torch.float64)
    total = float(rows.square().sum())
    if float(torch.linalg.vector_norm(q, dtype=torch.float64).square()) >= total * r / n:
        return p, q
    top = torch.topk(rows, r).indices
    p = torch.zeros(n, r, dtype=m.dtype)
    p[top, torch.arange(r)] = 1.0
    return p, m[top].T  # Q = M[top]^T (m x r), a view of a copy: M is the residual's buffer


def _payload(x: torch.Tensor, p: torch.Tensor, q: torch.Tensor, lossless: bool) -> bytes:
    body = p.contiguous().numpy().astype("<f4").tobytes() + q.contiguous().numpy().astype("<f4").tobytes()
    header = Header("powersgd", x.dtype, tuple(int(s) for s in x.shape), struct.pack("<H", p.shape[1]), lossless)
    return pack(header, body)


@register
class PowerSGD(ConfiguredCodec):
    """Stateless PowerSGD: one power step from a random Q, no warm start, no feedback.

    For training use :class:`PowerSGDEncoder`, which keeps the warm-started Q and the
    error-feedback residual per tensor. Tensors must have two or more dimensions.

    Params: ``<H`` r. Body: P (n x r) then Q (m x r), float32 row-major, with (n, m) =
    (shape[0], prod(shape[1:])). Decoded value: :func:`reconstruct`, P Q^T accumulated in
    float64 in the order k = 0 .. r-1 and rounded once to float32, the same bits on every
    machine and in every language (docs/wire-format.md).
    """

    name = "powersgd"
    output_finite_by_construction = True
    biased = True
    Config = PowerSGDConfig

    def encode(self, x, *, generator=None):
        if x.dim() < 2 or x.numel() == 0:
            raise ValueError(f"PowerSGD needs a non-empty tensor of >= 2 dims, got shape {tuple(x.shape)}; "
                             "send it with the fallback codec (PowerSGDEncoder does)")
        n, m = _matrix(tuple(x.shape))
        mat = flat32(x).view(n, m)
        r = min(self.config.rank, n, m)
        q = torch.randn(m, r, generator=local_generator(generator), dtype=torch.float32)
        p, q = power_step(mat, q)
        return _payload(x, p, q, self.config.lossless)

    @classmethod
    def decode_body(cls, header, body):
        (r,) = read_params(header, "<H")
        if len(header.shape) < 2:
            raise MalformedPayloadError(f"powersgd needs >= 2 dimensions, header shape is {header.shape}")
        n, m = _matrix(header.shape)
        if not 1 <= r <= min(n, m):
            raise MalformedPayloadError(f"powersgd rank {r} outside 1..min(n, m) = {min(n, m)}")
        check_body_size(header, body, 4 * r * (n + m))
        p = torch.from_numpy(finite_f32s(body[: 4 * r * n], "powersgd P")).view(n, r)
        q = torch.from_numpy(finite_f32s(body[4 * r * n:], "powersgd Q")).view(m, r)
        # P and Q are finite (checked above); every entry of P Q^T is at most
        # r * max|P| * max|Q|, so below float32's max the product is finite without a
        # pass over it (the generic check is skipped: output_finite_by_construction).
        bound = r * float(p.abs().max()) * float(q.abs().max())
        out = reconstruct(p, q)
        if not bound < 3.0e38 and not bool(torch.isfinite(out).all()):
            # (the bound alone refused finite products near float32's largest value)
            raise MalformedPayloadError(
                f"decoded powersgd tensor holds NaN or Inf: |P Q^T| up to {bound:.3g} overflows float32")
        return out.reshape(header.shape)


def reconstruct(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P Q^T as the wire format defines it: the same float32 bits on every machine.

    Element (i, j) is ``f32(((p[i,0] q[j,0] + p[i,1] q[j,1]) + p[i,2] q[j,2]) + ...)``: each
    product of two float32 values is exact in float64 (48 significant bits of 53), the r
    terms are added in float64 in the order k = 0 .. r-1 (the first term is the product
    itself, so a -0.0 keeps its sign), and the sum is rounded once to float32 (to nearest,
    ties to even). Every step is one IEEE operation on exact inputs, so a fused
    multiply-add, the vector width and the thread count cannot change a bit, where a BLAS
    matmul's summation order and FMA use depend on the CPU (an AVX-512 machine decoded the
    old ``P @ Q^T`` one ulp away from an AVX2 one). At rank 1 the float64 sum is the single
    product and float32's own multiply rounds it the same way, so rank 1 stays in float32.

    Parameters
    ----------
    p : torch.Tensor
        n x r float32.
    q : torch.Tensor
        m x r float32 (as on the wire: row-major, one row per column of the matrix).
    """
    r = p.shape[1]
    if r == 1:
        return torch.outer(p[:, 0], q[:, 0])
    # Rows in blocks of about 2^18 float64 elements (2 MiB): the accumulator stays in cache
    # between the r passes, and memory stays at the float32 output plus one block.
    n, m = p.shape[0], q.shape[0]
    p64, q64 = p.double(), q.T.double().contiguous()  # r x m: each row a contiguous column of Q
    out = torch.empty(n, m, dtype=torch.float32)
    rows = max(1, (1 << 18) // max(m, 1))
    for i in range(0, n, rows):
        blk = p64[i:i + rows]
        acc = torch.outer(blk[:, 0], q64[0])
        for k in range(1, r):
            acc.addcmul_(blk[:, k:k + 1], q64[k])
        out[i:i + rows] = acc  # the one rounding to float32
    return out


def _derived_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class PowerSGDEncoder:
    """Client-side PowerSGD with warm start and error feedback, keyed by tensor name.

    Per call, for a tensor of >= 2 dims: M = x + residual; P = orth(M Q_prev); Q = M^T P
    (or, when that keeps less than r / n of M's energy, M's r largest rows exactly:
    :func:`_contractive`); send (P, Q); residual = M - P Q^T; keep Q for the next call
    (the warm start that lets one power step per round track the top singular space
    over rounds). Q_prev starts as
    a standard normal matrix drawn from a generator seeded by (config.seed, name).

    Tensors of fewer than two dims (or empty ones) go through ``config.fallback``
    (``raw`` by default). See the module docstring for how the single-round-trip star
    version differs from the all-reduce original.

    Parameters
    ----------
    config : PowerSGDConfig
        Rank, seed, fallback codec, lossless stage.

    Examples
    --------
    >>> enc = PowerSGDEncoder(PowerSGDConfig(rank=2, seed=0))
    >>> payload = enc.encode("conv1.weight", torch.randn(16, 3, 3, 3))
    >>> len(payload)  # 31-byte header + 4 * 2 * (16 + 27)
    375
    """

    def __init__(self, config: PowerSGDConfig | None = None) -> None:
        self.config = config if config is not None else PowerSGDConfig()
        if not isinstance(self.config, PowerSGDConfig):
            raise ValueError(f"PowerSGDEncoder needs a PowerSGDConfig, got {type(self.config).__name__}")
        self._fallback = _FALLBACKS[self.config.fallback](lossless=self.config.lossless)
        self.q: dict[str, torch.Tensor] = {}
        self.residual: dict[str, torch.Tensor] = {}

    def encode(self, name: str, x: torch.Tensor) -> bytes:
        """The payload of tensor ``name``'s update ``x``; updates Q and the residual."""
        if x.dim() < 2 or x.numel() == 0:
            return self._fallback.encode(x)
        n, m = _matrix(tuple(x.shape))
        r = min(self.config.rank, n, m)
        # NaN or Inf anywhere in x reaches P and Q through M Q and M^T P: checking those
        # small factors replaces a pass over the whole tensor.
        mat = flat32(x, check_finite=False).view(n, m)
        res = self.residual.get(name)
        owned = False
        if res is not None:
            if res.shape != mat.shape:
                raise ValueError(f"tensor {name!r} changed shape from {tuple(res.shape)} to {(n, m)}; "
                                 "reset() the encoder when the model changes")
            # M = x + residual, in a buffer of its own: added into the residual in place, an
            # update refused below (NaN/Inf) stayed in it, and every later one was refused
            mat = res + mat
            owned = True
        q = self.q.get(name)
        fresh = q is None or q.shape != (m, r)
        if fresh:
            g = torch.Generator().manual_seed(_derived_seed(self.config.seed, name))
            q = torch.randn(m, r, generator=g, dtype=torch.float32)
        for i in range(self.config.iters):
            if i or not fresh:
                q = _unit_columns(q)
            p, q = power_step(mat, q)
        if not (all_finite(p) and all_finite(q)):
            raise ValueError(f"cannot encode tensor {name!r}: its update (plus the residual) holds NaN or Inf")
        p, q = _contractive(mat, p, q, r)
        self.q[name] = q
        # M - P Q^T, fused into one pass over M (addmm) and in place when M is a buffer of
        # our own. BLAS's P Q^T matches the decoder's exact reconstruct() to float32
        # rounding, so x + old residual == decoded + new residual holds to a few ulps (a
        # test checks); the residual is the client's own state, never on the wire, and
        # the exact rule would cost a second pass here.
        qt = q.T.contiguous()
        self.residual[name] = mat.addmm_(p, qt, alpha=-1.0) if owned else torch.addmm(mat, p, qt, alpha=-1.0)
        return _payload(x, p, q, self.config.lossless)

    def reset(self) -> None:
        """Forget every Q and residual."""
        self.q.clear()
        self.residual.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat float32 CPU tensors: ``"q:NAME"`` and ``"residual:NAME"``."""
        out = {f"q:{k}": v.clone(memory_format=torch.contiguous_format) for k, v in self.q.items()}
        out.update({f"residual:{k}": v.clone() for k, v in self.residual.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        q, res = {}, {}
        for key, v in state.items():
            kind, _, name = key.partition(":")
            if kind == "q":
                q[name] = torch.as_tensor(v, dtype=torch.float32).cpu().clone()
            elif kind == "residual":
                res[name] = torch.as_tensor(v, dtype=torch.float32).cpu().clone()
            else:
                raise ValueError(f"unknown PowerSGD state key {key!r}; expected 'q:NAME' or 'residual:NAME'")
        self.q, self.residual = q, res


def encode_many(encoders: list[PowerSGDEncoder], name: str, xs: list[torch.Tensor]) -> list[bytes] | None:
    """``[e.encode(name, x) for e, x in zip(encoders, xs)]`` for clients of one config and
    tensor shape, as one batched program (a cohort's uplinks, fededge/compress/batch.py):
    the power step's products as batched matmuls (``torch.bmm``), the orthogonalisation as
    one batched QR, the rest element-wise over the stack.

    The same rule as :meth:`PowerSGDEncoder.encode` step for step (warm start, unit
    columns, the power-of-two scaling before the QR, :func:`_contractive`'s fallback to
    the largest rows, the residual M - P Q^T), to float32 rounding: a batched matmul sums
    in another order than one matmul per client, so P, Q and the residual agree with the
    per-client path to rounding, not bit for bit (the payloads' sizes are the same).

    None, with no state changed, where the batch does not apply: a tensor of fewer than
    two dimensions, a residual of another shape, or a NaN or Inf anywhere (the caller then
    encodes client by client, which raises the per-client path's errors)."""
    shape = tuple(xs[0].shape)
    if len(shape) < 2 or xs[0].numel() == 0:
        return None
    n, m = _matrix(shape)
    r = min(encoders[0].config.rank, n, m)
    iters = encoders[0].config.iters
    kept = [e.residual.get(name) for e in encoders]
    if any(k is not None and tuple(k.shape) != (n, m) for k in kept):
        return None
    mat = torch.stack([x.detach() for x in xs]).float().cpu().reshape(len(xs), n, m)
    if all(k is not None for k in kept):
        mat = torch.stack(kept).add_(mat)  # type: ignore[arg-type]  # residual + x, as the encoder adds
    elif any(k is not None for k in kept):
        mat = torch.stack([mat[j] if k is None else k + mat[j] for j, k in enumerate(kept)])
    warm = [e.q.get(name) for e in encoders]
    fresh = [q is None or tuple(q.shape) != (m, r) for q in warm]
    q = torch.stack([torch.randn(m, r, generator=torch.Generator().manual_seed(_derived_seed(e.config.seed, name)),
                                  dtype=torch.float32)
                     if f else w for e, w, f in zip(encoders, warm, fresh)])
    is_fresh = torch.tensor(fresh)[:, None, None]
    for i in range(iters):
        scaled = _unit_columns(q)
        q = scaled if i else torch.where(is_fresh, q, scaled)
        p = _orthogonalize_many(torch.bmm(mat, q.transpose(1, 2).contiguous().transpose(1, 2)))
        q = torch.bmm(p.transpose(1, 2), mat).transpose(1, 2)
    if not (all_finite(p) and all_finite(q)):
        return None
    if r < n:  # _contractive, client by client where the power step captured too little
        rows = torch.linalg.vector_norm(mat, dim=2, dtype=torch.float64)
        total = rows.square().sum(dim=1)
        captured = torch.linalg.vector_norm(q, dim=(1, 2), dtype=torch.float64).square()
        short = (captured < total * r / n).nonzero().flatten().tolist()
        if short:
            p, q = p.clone(), q.clone()
            for j in short:
                p[j], q[j] = _contractive(mat[j], p[j], q[j], r)
    residual = torch.baddbmm(mat, p, q.transpose(1, 2).contiguous(), alpha=-1.0)
    out = []
    like = torch.empty(shape, dtype=torch.float32, device="meta")  # the header's dtype and shape
    for j, e in enumerate(encoders):
        e.q[name] = q[j]
        e.residual[name] = residual[j]
        out.append(_payload(like, p[j], q[j], e.config.lossless))
    return out


def _orthogonalize_many(p: torch.Tensor) -> torch.Tensor:
    """:func:`_orthogonalize` of each client's P (clients x n x r): the same power-of-two
    scaling per client, then one batched Householder QR."""
    amax = p.abs().amax(dim=(1, 2))
    shift = torch.frexp(amax.double()).exponent
    scale = torch.where((amax > 0) & torch.isfinite(amax), torch.ldexp(torch.ones_like(amax, dtype=torch.float64),
                                                                      -shift), 1.0)
    if bool((scale != 1.0).any()):
        p = (p.double() * scale[:, None, None]).float()
    return torch.linalg.qr(p, mode="reduced").Q
