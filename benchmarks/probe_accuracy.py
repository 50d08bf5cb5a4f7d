"""`isthmus probe` against emulated links whose spec is known: RTT, 1-flow and N-flow
throughput, the per-flow cap and loss, measured against the spec, with the error in %.

The relay (sim/relay.py) runs in this process, one link changed live for each spec;
`isthmus probe serve` and `isthmus probe` run as processes of their own, as at two
sites. A spec is RTT_MS:GBIT[:CAP_GBIT[:LOSS]] (CAP 0 = none).

    python3 benchmarks/probe_accuracy.py [--specs 10:1,50:1:0.25] [--seconds 3] [--json out.json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import parser, stamped, write_json

from isthmus.sim import LinkSpec, RelayServer
from isthmus.sim.impairments.loss import Loss

CLI = [sys.executable, "-m", "isthmus.deploy.cli", "probe"]
SPECS = "1:1,10:5,10:5:1,50:1,50:2:0.5,10:1:0:0.01,50:1:0:0.01,10:10:2.5"


def _spec(text: str) -> dict[str, float]:
    rtt, gbit, cap, loss = ([float(x) for x in text.split(":")] + [0.0, 0.0])[:4]
    return {"rtt_ms": rtt, "gbit": gbit, "cap_gbit": cap, "loss": loss}


def _link(spec: dict[str, float]) -> LinkSpec:
    return LinkSpec.symmetric(
        latency_s=spec["rtt_ms"] / 2e3,
        bandwidth_bps=spec["gbit"] * 1e9,
        per_flow_bps=spec["cap_gbit"] * 1e9,
        impairments=(Loss(rate=spec["loss"]),) if spec["loss"] else (),
    )


def _errors(spec: dict[str, float], got: dict) -> dict[str, float | None]:
    """Measured against spec, in % of the spec; None where the spec has no figure."""
    one = min(spec["cap_gbit"] or spec["gbit"], spec["gbit"])
    pairs = {
        "rtt_ms": (got["rtt_ms"], spec["rtt_ms"]),
        "gbit_1flow": (got["gbit_1flow"], one),
        "gbit_nflows": (got["gbit_nflows"], spec["gbit"]),
        "per_flow_cap_gbit": (got["per_flow_cap_gbit"] or 0.0, spec["cap_gbit"]),
        "loss": (got["loss"], spec["loss"]),
    }
    return {k: (100 * (m - s) / s if s else None) if s or m else 0.0 for k, (m, s) in pairs.items()}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--specs", default=SPECS, help="comma-separated RTT_MS:GBIT[:CAP[:LOSS]]")
    p.add_argument("--seconds", type=float, default=3.0, help="length of each probe phase")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [*CLI, "serve", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True, env=env
    )
    rows = []
    try:
        address = server.stdout.readline().split()[-1]
        host, port = address.rsplit(":", 1)
        with RelayServer() as relay, tempfile.TemporaryDirectory() as tmp:
            specs = [_spec(s) for s in args.specs.split(",")]
            link = relay.add_link("a-b", _link(specs[0]))
            forward = ":".join(map(str, link.add_forward(host, int(port))))
            for spec in specs:
                link.update(_link(spec))
                out = Path(tmp, "probe.json")
                cmd = [*CLI, forward, "--seconds", str(args.seconds), "--json", str(out)]
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                got = json.loads(out.read_text())["links"][0]
                got.pop("audit", None)
                rows.append({"spec": spec, "measured": got, "error_pct": _errors(spec, got)})
                _print_row(rows[-1])
    finally:
        server.terminate()
        server.wait(10)
    if args.json:
        write_json(args.json, stamped({"seconds": args.seconds, "rows": rows}))
    if out_dir := os.environ.get("OUT"):
        write_json(Path(out_dir, "probe_accuracy.json"), stamped({"rows": rows}))
    return 0


def _print_row(row: dict) -> None:
    s, m, e = row["spec"], row["measured"], row["error_pct"]
    if not _print_row.__dict__.get("headed"):
        print(
            f"{'spec (RTT ms, Gbit/s, cap, loss)':<34} {'RTT ms':>13} {'1 flow':>14} "
            f"{'N flows':>14} {'cap':>14} {'loss':>16}"
        )
        _print_row.headed = True

    def cell(key: str, value: float | None, width: int, fmt: str = ".3f") -> str:
        err = e[key]
        text = "-" if value is None else format(value, fmt)
        return f"{text + ('' if err is None else f' ({err:+.0f}%)'):>{width}}"

    spec = f"{s['rtt_ms']:g} ms, {s['gbit']:g}, {s['cap_gbit'] or '-'}, {s['loss']:.1%}"
    print(
        f"{spec:<34} {cell('rtt_ms', m['rtt_ms'], 13, '.2f')} "
        f"{cell('gbit_1flow', m['gbit_1flow'], 14)} {cell('gbit_nflows', m['gbit_nflows'], 14)} "
        f"{cell('per_flow_cap_gbit', m['per_flow_cap_gbit'], 14)} "
        f"{cell('loss', m['loss'], 16, '.3%')}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
