"""Learning-rate schedules over rounds: the arithmetic, pure (no torch, no Flower).

:func:`scheduled_lr` is the local learning rate of a round; fededge's ClientApp applies
it (``lr-schedule``, ``lr-warmup-rounds``), and :mod:`fededge.config` checks the names
against :data:`LR_SCHEDULES` without importing the client side.
"""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULES", "scheduled_lr"]

#: The schedules ``lr-schedule`` may name.
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine", "step")


def scheduled_lr(base: float, rnd: int, num_rounds: int, *, schedule: str = "constant",
                 warmup_rounds: int = 0) -> float:
    """The learning rate of round ``rnd`` (1-based) of ``num_rounds`` under a schedule.

    The rate is constant within a round (all K local steps of round ``rnd`` use it); with
    K = 1 a round is one iteration and the schedule is per iteration.

    - **Warm-up** (``warmup_rounds = W > 0``): round t <= W uses ``base * t / W``, a linear
      ramp that reaches ``base`` at round W (Goyal et al., 2017).
    - ``"constant"``: ``base`` after the warm-up.
    - ``"cosine"``: ``base * (1 + cos(pi * (t - W - 1) / (T - W))) / 2`` for t > W: ``base``
      at round W + 1, falling to nearly 0 at round T (Loshchilov and Hutter, 2017).
    - ``"step"``: ``base``, times 0.1 from round ``ceil(T/2) + 1`` and 0.01 from round
      ``ceil(3T/4) + 1``: the classic ResNet/CIFAR schedule (decays at 50% and 75%).

    A round past ``num_rounds`` (an asynchronous strategy's model version can be) keeps
    the last round's rate.

    Examples
    --------
    >>> [round(scheduled_lr(0.1, t, 4, schedule="cosine"), 4) for t in (1, 2, 3, 4)]
    [0.1, 0.0854, 0.05, 0.0146]
    >>> scheduled_lr(0.1, 1, 10, warmup_rounds=4)
    0.025
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule must be one of {', '.join(LR_SCHEDULES)}; got {schedule!r}")
    if not 0 <= warmup_rounds < num_rounds:
        raise ValueError(f"need num_rounds >= 1 and 0 <= warmup_rounds < num_rounds, got "
                         f"num_rounds={num_rounds}, warmup_rounds={warmup_rounds}")
    if rnd < 1:
        raise ValueError(f"rounds count from 1, got {rnd}")
    t = min(rnd, num_rounds)
    if t <= warmup_rounds:
        return base * t / warmup_rounds
    if schedule == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * (t - warmup_rounds - 1) / (num_rounds - warmup_rounds)))
    if schedule == "step":
        passed = (t > math.ceil(num_rounds / 2)) + (t > math.ceil(3 * num_rounds / 4))
        return base * (1.0, 0.1, 0.01)[passed]
    return base
