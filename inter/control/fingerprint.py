"""The job fingerprint check: every site (and rank) of a job must agree on the keys
that shape training; a mismatch is refused with a message naming what differs."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MAX_FINGERPRINT_KEYS", "fingerprint_diff", "fingerprint_problem"]

MAX_FINGERPRINT_KEYS = 512


def fingerprint_diff(ours: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """Keys whose values differ, rendered as "key: OURS here vs THEIRS there".

    Args:
        ours: this side's flattened fingerprint.
        theirs: the other side's.
    Returns:
        One string per differing key, sorted; empty when they agree.
    """
    missing = "<unset>"

    def short(text: str) -> str:  # a peer's keys and values may be huge: keep errors readable
        return text if len(text) <= 80 else f"{text[:64]}...({len(text)} chars)"

    return [
        f"{short(key)}={short(ours.get(key, missing))} vs {short(theirs.get(key, missing))}"
        for key in sorted(set(ours) | set(theirs))
        if ours.get(key) != theirs.get(key)
    ]


def fingerprint_problem(
    ours: Mapping[str, str],
    theirs: Mapping[str, str],
    here: str,
    who: str,
    *,
    values: bool = True,
) -> str | None:
    """Why `theirs` (sent by `who`) cannot join `here`'s job, or None when they agree.

    With ``values=False`` only the differing keys are named: the answer to a caller
    who may not belong to the job tells it nothing of the job's configuration (the
    refusing side logs the full message)."""
    if len(theirs) > MAX_FINGERPRINT_KEYS:
        return f"{who} sent a fingerprint with {len(theirs)} keys (max {MAX_FINGERPRINT_KEYS})"
    diff = fingerprint_diff(ours, theirs)
    if not diff:
        return None
    if not values:
        diff = [line.split("=", 1)[0] for line in diff]
    return (
        f"job fingerprint differs between {here} and {who}"
        + ("" if values else f" in these keys ({here}'s log has both values)")
        + ": "
        + "; ".join(diff[:8])
        + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")
    )
