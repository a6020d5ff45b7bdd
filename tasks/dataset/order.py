"""The order in which training problems are visited.

"fixed" (the reference's way): one seeded permutation of the training instances,
the same in every epoch. "shuffled": a new seeded permutation per epoch. Both
depend only on the set of ids, the seed and the epoch, never on table row order,
so a resumed run visits the same problems in the same order.
"""

from __future__ import annotations

import random

ORDERS = ("fixed", "shuffled")


def training_order(instance_ids, epoch: int = 0, seed: int = 0, order: str = "fixed") -> list[str]:
    """All training instance ids in the order epoch `epoch` visits them."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    ids = sorted(set(instance_ids))
    rng = random.Random(f"order:{seed}" if order == "fixed" else f"order:{seed}:epoch:{epoch}")
    rng.shuffle(ids)
    return ids


def training_batch(instance_ids, step: int, batch_size: int, seed: int = 0, order: str = "fixed") -> list[str]:
    """The problems of training step `step` (0-based): the next `batch_size` ids, continuing across epochs."""
    ids = sorted(set(instance_ids))
    if not ids or batch_size < 1:
        raise ValueError("need at least one training instance and batch_size >= 1")
    pos = step * batch_size
    epoch, offset = divmod(pos, len(ids))
    out: list[str] = []
    while len(out) < batch_size:
        seq = training_order(ids, epoch, seed, order)
        out += seq[offset: offset + batch_size - len(out)]
        epoch, offset = epoch + 1, 0
    return out
