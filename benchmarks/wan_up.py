"""`isthmus wan up` in a child process, for the WAN benchmarks (wan_probe.py,
wan_throughput.py): its links, forwards, proxies and control endpoint, read from what
it prints."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


class Emulator:
    """One `isthmus wan up` child: `sites` sites, a forward to each target on `links`."""

    def __init__(self, workdir: Path, sites: int, links: list[str], targets: list[int]) -> None:
        names = [f"s{i}" for i in range(sites)]
        topology = workdir / f"wan{id(self)}.toml"
        topology.write_text(
            f"sites = {json.dumps(names)}\n[defaults]\nlatency_ms = 0.5\nbandwidth_mbit = 1000\n"
        )
        cmd = [sys.executable, "-m", "isthmus.deploy.commands.wan", "up", str(topology)]
        cmd += ["--control", "127.0.0.1:0"]
        for link in links:
            a, b = link.split("-")
            cmd += [arg for port in targets for arg in ("--forward", f"{a}:{b}=127.0.0.1:{port}")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.links = links
        self.forwards: dict[tuple[str, int], tuple[str, int]] = {}  # (link, target) -> addr
        self.proxies: dict[str, str] = {}  # link -> proxy URL of its a -> b direction
        self.control = ""
        assert self.proc.stdout is not None
        link = src = ""
        for line in self.proc.stdout:
            if m := re.match(r"link (\S+)", line):
                link = m.group(1)
            elif m := re.match(r"\s+(\S+) -> (\S+)\s", line):
                src = m.group(1)
            elif (m := re.match(r"\s+proxy\s+(\S+)", line)) and src == link.split("-")[0]:
                self.proxies[link] = m.group(1)
            elif m := re.match(r"\s+forward (\S+):(\d+) -> \S+:(\d+)", line):
                self.forwards[(link, int(m.group(3)))] = (m.group(1), int(m.group(2)))
            elif m := re.match(r"control (\S+)", line):
                self.control = m.group(1)
            elif line.startswith("ready"):
                break
        if not self.control:
            self.close()
            raise RuntimeError("isthmus wan up did not start")

    def set(self, **changes: float) -> float:
        """Change every link used (topology-file keys); returns how long the control
        endpoint took to answer, in seconds."""
        from isthmus.sim import control_request

        t0 = time.monotonic()
        for link in self.links:
            control_request(self.control, "POST", f"/links/{link}", changes)
        return time.monotonic() - t0

    def cpu_s(self) -> dict[str, tuple[float, float]]:
        """(user, system) seconds so far of each thread of the `wan up` process."""
        out = {}
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            with contextlib.suppress(OSError):  # a thread that just ended
                stat = Path(f"/proc/{self.proc.pid}/task/{tid}/stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                out[f"{self.proc.pid}/{tid}"] = (int(fields[11]) / TICKS, int(fields[12]) / TICKS)
        return out

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
