"""Link traces: a direction's bandwidth, latency and loss as a step function of time, read
from a CSV file and replayed on a live link (docs/wan.md, "Traces").

The file has a header, then one row per change: `t_s` (seconds since the link started; 0
first, strictly increasing) and any of `COLUMNS`. A row holds until the next, the last
for good; an empty cell leaves its key as it is. `Replay` applies each row at its time on
a thread of its own, through the link's `update` (bytes in flight keep their times)."""

from __future__ import annotations

import csv
import dataclasses
import math
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from .impairments import Impairment, Loss
from .spec import DirectionSpec, LinkSpec, Trace

COLUMNS = {
    "bandwidth_mbit": ("bandwidth_bps", 1e6),  # 0 = unlimited
    "latency_ms": ("latency_s", 1e-3),  # one way
    "per_flow_mbit": ("per_flow_bps", 1e6),  # 0 = no cap
    "loss": ("impairments", 1.0),  # the rate of the direction's `loss` (per segment, 0..1)
}
"""Trace columns besides `t_s`: the DirectionSpec field each sets, and its factor."""
DIRECTIONS = ("a_to_b", "b_to_a")


def load_trace(path: str | Path) -> Trace:
    """Read a trace file; ValueError naming the file, its line and column."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # a spreadsheet's BOM too
            lines = [(n, row) for n, row in enumerate(csv.reader(f), 1) if any(row)]
    except FileNotFoundError:
        raise ValueError(f"trace file not found: {path}") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"trace file {path} cannot be read: {exc}") from None
    if not lines:
        raise ValueError(f"trace file {path} is empty; its first line names the columns")
    header = [name.strip() for name in lines[0][1]]
    for name in header:
        if name != "t_s" and name not in COLUMNS:
            known = ", ".join(("t_s", *COLUMNS))
            raise ValueError(f"{path}, line 1: unknown column {name!r}; columns: {known}")
    if "t_s" not in header or len(set(header)) < len(header):
        raise ValueError(f"{path}, line 1: name t_s and each other column once, got {header}")
    if len(lines) < 2:
        raise ValueError(f"trace file {path} has no rows under its header")
    times: list[float] = []
    rows = []
    for n, cells in lines[1:]:
        if len(cells) != len(header):
            raise ValueError(f"{path}, line {n}: {len(cells)} cells, the header has {len(header)}")
        row = {}
        for name, cell in zip(header, cells, strict=True):
            if cell.strip() or name == "t_s":
                row[name] = _value(cell, f"{path}, line {n}, column {name}")
        t = row.pop("t_s")
        if times and t <= times[-1] or not times and t != 0:
            expected = "starts at 0" if not times else f"increases (the line before: {times[-1]:g})"
            raise ValueError(f"{path}, line {n}, column t_s: {t:g}, but t_s {expected}")
        if row.get("loss", 0) > 1:
            raise ValueError(f"{path}, line {n}, column loss: {row['loss']:g} is not in 0..1")
        times.append(t)
        rows.append(tuple(row.items()))
    return Trace(path=str(path), times=tuple(times), rows=tuple(rows))


def _value(cell: str, where: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise ValueError(f"{where}: {cell.strip()!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {cell.strip()!r} must be a finite number >= 0")
    return value


def at_row(spec: DirectionSpec, row: int) -> DirectionSpec:
    """`spec` with the keys that row `row` of its trace names changed."""
    assert spec.trace is not None
    changes: dict[str, Any] = {}
    for name, value in spec.trace.rows[row]:
        field, factor = COLUMNS[name]
        changes[field] = _with_loss(spec.impairments, value) if name == "loss" else value * factor
    return dataclasses.replace(spec, **changes)


def _with_loss(chain: tuple[Impairment, ...], rate: float) -> tuple[Impairment, ...]:
    """The chain with its first `loss` at `rate` (a new one last if it has none): the
    same chain when the rate is unchanged, so that the impairments do not restart."""
    for i, imp in enumerate(chain):
        if isinstance(imp, Loss):
            return (*chain[:i], dataclasses.replace(imp, rate=rate), *chain[i + 1 :])
    return (*chain, Loss(rate=rate)) if rate > 0 else chain


class Traced(Protocol):
    """What a replay changes: a `sim.relay.Link`."""

    name: str
    lock: Any  # held while `spec` is read and changed

    @property
    def spec(self) -> LinkSpec: ...

    def update(self, spec: LinkSpec) -> None: ...


class Replay:
    """Applies the rows of a link's traces at their times, on a thread, until `close` or
    the last row. Made by `follow`."""

    def __init__(self, link: Traced, traces: dict[str, Trace]) -> None:
        self.traces = traces  # direction ("a_to_b", "b_to_a") -> its trace
        self.started = time.monotonic()  # the traces' time 0
        self._link = link
        self._rows = dict.fromkeys(traces, 0)  # the row each direction is at
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"isthmus-trace-{link.name}", daemon=True
        )
        self._thread.start()

    def position(self) -> dict[str, dict[str, Any]]:
        """Per traced direction: its file, the row in force (0 = the first under the
        header), the rows, and when the next one applies (seconds since the link started;
        None after the last), with the seconds since then (`now_s`)."""
        now_s = time.monotonic() - self.started
        return {
            name: {
                "file": trace.path,
                "row": self._rows[name],
                "rows": len(trace.times),
                "next_s": self._next_s(name),
                "now_s": round(now_s, 3),
            }
            for name, trace in self.traces.items()
        }

    def close(self) -> None:
        """Stop replaying and join the thread (idempotent)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _next_s(self, name: str) -> float | None:
        times, row = self.traces[name].times, self._rows[name]
        return times[row + 1] if row + 1 < len(times) else None

    def _run(self) -> None:
        while True:
            due = [t for t in map(self._next_s, self.traces) if t is not None]
            if not due or self._stop.wait(self.started + min(due) - time.monotonic()):
                return
            with self._link.lock:
                if self._stop.is_set():
                    return  # replaced by a new trace while this row waited for the lock
                spec, rows = self._link.spec, dict(self._rows)
                for name in self.traces:
                    if self._next_s(name) == min(due):
                        rows[name] += 1
                        direction = at_row(getattr(spec, name), rows[name])
                        spec = dataclasses.replace(spec, **{name: direction})
                try:
                    self._link.update(spec)
                except (RuntimeError, OSError):
                    return  # the link closed under this row
                self._rows = rows  # shown once the pipes have it


def follow(replay: Replay | None, spec: LinkSpec, link: Traced) -> tuple[Replay | None, LinkSpec]:
    """The replay of `spec`'s traces on `link`, and the spec to apply now: `replay` and
    `spec` while the traces are those `replay` plays; else a new replay and `spec` at each
    trace's first row (`replay` is stopped; its thread ends once the caller lets go of
    `link.lock`)."""
    traces = {name: t for name in DIRECTIONS if (t := getattr(spec, name).trace) is not None}
    if replay is not None and replay.traces == traces:
        return replay, spec
    if replay is not None:
        replay._stop.set()
    for name in traces:
        spec = dataclasses.replace(spec, **{name: at_row(getattr(spec, name), 0)})
    return (Replay(link, traces) if traces else None), spec
