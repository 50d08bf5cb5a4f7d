"""The progress line of `isthmus local`: step, loss, tokens/s, MFU, and the cross-site
sync per step: how long its rounds ran and how much of that the step waited for."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from isthmus.deploy.config.sections import TopologySection
from isthmus.deploy.reports.summary import JsonlTail, merge_steps


class Progress:
    """Re-reads the sites' metrics files and redraws one line in place on a terminal;
    elsewhere (CI, a pipe) prints a line every tenth of the run, so logs stay short."""

    def __init__(
        self,
        topology: TopologySection,
        steps: int,
        run_dir: Path,
        out: TextIO,
        enabled: bool = True,
        sites: list[str] | None = None,
    ) -> None:
        self.topology, self.steps = topology, steps
        self.run_dir, self.out, self.enabled = run_dir, out, enabled
        self.sites = sites or topology.site_names
        # Each update reads only new lines: a long run's files are not re-read.
        self._tails = {s: JsonlTail(run_dir / "sites" / s / "metrics.jsonl") for s in self.sites}
        self._rows: dict[str, list[dict]] = {s: [] for s in self.sites}
        self._merged = 0
        self._tokens = 0
        self._val: float | None = None  # the latest held-out loss
        self.tty = enabled and out.isatty()
        self.shown = -1
        self.every = max(1, steps // 10)
        self.width = 0
        if enabled:
            t = topology
            who = "isthmus local" if sites is None else f"isthmus site {', '.join(self.sites)}"
            self._emit(
                f"{who}: {t.sites} site(s) x {t.ranks_per_site} rank(s), "
                f"{steps} steps; starting ranks and joining sites...",
                final=not self.tty,
            )

    def update(self) -> None:
        if not self.enabled:
            return
        for site, tail in self._tails.items():
            self._rows[site].extend(tail.read_new())
        ready = min(len(rows) for rows in self._rows.values())  # steps every site finished
        if ready == 0:
            return
        new = merge_steps({s: rows[:ready] for s, rows in self._rows.items()})
        self._rows = {s: rows[ready:] for s, rows in self._rows.items()}
        self._merged += ready
        n = self._merged
        self._tokens += sum(r["tokens"] for r in new)
        last = new[-1]
        for r in new:
            self._val = r.get("val_loss", self._val)
        if not self.tty and n % self.every and n != self.steps:
            return
        self.shown = n - 1
        tokens_per_s = self._tokens / max(last["elapsed_s"], 1e-9)
        total = self.steps
        filled = int(20 * n / total)
        bar = "#" * filled + "." * (20 - filled)
        line = f"[{bar}] step {n}/{total}  loss {last['loss']:.4f}"
        # A script's steps may count no tokens, and its model's FLOPs are unknown: what
        # is not measured is left out, not shown as 0.
        if self._tokens:
            line += f"  {tokens_per_s:,.0f} tok/s"
        if last["mfu"]:
            line += f"  MFU {last['mfu']:.1%}"
        if self._val is not None:
            line += f"  held-out {self._val:.4f}"
        if len(self.sites) > 1 or self.topology.sites > 1:
            # How long the step's rounds ran, and how much of that the step waited for.
            line += (
                f"  cross-site {last['sync_busy_s']:.3f} s/step"
                f"  exposed {last['exposed_sync_s']:.3f} s/step"
            )
        self._emit(line, final=not self.tty)

    def status(self, text: str) -> None:
        """A line about something other than steps (e.g. waiting for peers)."""
        if self.enabled and self.shown < 0:
            self._emit(text, final=not self.tty)

    def _emit(self, text: str, final: bool) -> None:
        if self.tty:
            pad = max(0, self.width - len(text))
            self.out.write("\r" + text + " " * pad)
            self.width = len(text)
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        # The ranks may have written their last steps after the previous update: show
        # them, so a finished run always ends on its last step.
        self.update()
        if self.tty and self.width:
            self.out.write("\n")
            self.out.flush()
