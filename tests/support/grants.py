"""The rate limiter's bound on grants, checked exactly on the Redis times it admitted calls at.

With rate r and burst B, every window of length t holds at most B + r*t grants (the bucket holds
at most B tokens when the window opens, gains at most r*t during it, never goes below zero, and
each grant takes one token). Times are compared in whole microseconds, the limiter's own unit.
"""

from __future__ import annotations


def most_in_window(grants: list[float], window: float) -> int:
    """The largest number of grants in any closed window [t, t + window], in whole microseconds."""
    micros = [round(t * 1_000_000) for t in sorted(grants)]
    span = round(window * 1_000_000)
    most, first = 0, 0
    for last, t in enumerate(micros):
        while t - micros[first] > span:
            first += 1
        most = max(most, last - first + 1)
    return most


def assert_within_rate(grants: list[float], rate: float, burst: float) -> None:
    """B + r*t holds for every window length at once: grants i..j span g_j - g_i."""
    micros = [round(t * 1_000_000) for t in sorted(grants)]
    for i, first in enumerate(micros):
        for j in range(i, len(micros)):
            assert j - i + 1 <= burst + rate * (micros[j] - first) / 1_000_000 + 1e-9, (
                f"{j - i + 1} grants within {(micros[j] - first) / 1e6:.6f} s"
            )
