"""Folding a non-power-of-two group onto a power-of-two one (Thakur, Rabenseifner & Gropp, 2005).

With ``p`` ranks, ``p2`` the largest power of two not above ``p`` and ``rem = p - p2``, the first
``2 * rem`` ranks pair up: each even rank hands its data to the odd rank after it and sits out,
the ``p2`` remaining ranks run the power-of-two algorithm as "virtual" ranks, and the odd ranks
hand the result back at the end. Virtual rank ``v`` stands for real ranks ``2v, 2v+1`` when
``v < rem`` and for real rank ``v + rem`` otherwise, so the real chunks a virtual rank owns are
contiguous, which lets the halving and doubling steps address whole ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fold"]


@dataclass(frozen=True)
class Fold:
    world: int

    @property
    def p2(self) -> int:
        return 1 << (self.world.bit_length() - 1)

    @property
    def rem(self) -> int:
        return self.world - self.p2

    def sits_out(self, rank: int) -> bool:
        """True for the even ranks of the first ``2*rem`` that hand their data over."""
        return rank < 2 * self.rem and rank % 2 == 0

    def is_host(self, rank: int) -> bool:
        """True for the odd ranks of the first ``2*rem`` that take a partner's data."""
        return rank < 2 * self.rem and rank % 2 == 1

    def virtual(self, rank: int) -> int:
        assert not self.sits_out(rank)
        return rank // 2 if rank < 2 * self.rem else rank - self.rem

    def real(self, v: int) -> int:
        """The real rank that acts for virtual rank ``v``."""
        return 2 * v + 1 if v < self.rem else v + self.rem

    def first_real(self, v: int) -> int:
        """The lowest real rank virtual rank ``v`` stands for (``v == p2`` gives ``world``)."""
        return 2 * v if v < self.rem else v + self.rem
