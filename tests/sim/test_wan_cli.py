"""`isthmus wan` as a user runs it: up in the foreground, set and show from another shell.

The commands run as `python -m isthmus.deploy.commands.wan`, the same code as `isthmus wan`
without the torch import of the rest of the CLI (seconds on a loaded machine).
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ISTHMUS, assert_one_line_error, port_is_free, start_wan_up
from measured import HostLag
from sockets import Server, Sink, connect, send_timed

WAN = [sys.executable, "-m", "isthmus.deploy.commands.wan"]
MBIT = 1e6


def _wan(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*WAN, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def _topology(tmp_path: Path, text: str) -> str:
    path = tmp_path / "topology.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.timeout(60)  # a deadline: 17 s at a load of 10, ~4 s idle
@pytest.mark.parametrize("mode", [[], ["--processes"]], ids=["threads", "processes"])
def test_set_changes_a_running_link(tmp_path, mode) -> None:
    topology = _topology(
        tmp_path,
        'sites = ["a", "b"]\n[links."a-b"]\nlatency_ms = 5\nbandwidth_mbit = 40\n',
    )
    sink = Sink()
    server = Server(sink)
    target = f"127.0.0.1:{server.address[1]}"
    up, lines = start_wan_up(topology, "--forward", f"a:b={target}", *mode)
    try:
        forward = next(line.split()[1] for line in lines if line.startswith("forward"))
        control = next(line.split()[1] for line in lines if line.startswith("control"))
        assert any(line.startswith("proxy   http://127.0.0.1:") for line in lines)
        host, port = forward.split(":")
        with connect((host, int(port))) as s:
            with HostLag() as lag_before:
                before = send_timed(s, sink, 4 << 20, 0.005)
            changed = _wan("set", "--control", control, "a-b", "bandwidth_mbit=160")
            assert changed.returncode == 0, changed.stderr
            assert "160 Mbit/s" in changed.stdout
            with HostLag() as lag_after:
                after = send_timed(s, sink, 16 << 20, 0.005)
        lags = f"host lag {lag_before.late_s * 1e3:.2f}, {lag_after.late_s * 1e3:.2f} ms"
        print(f"wan set: 40 -> {before / MBIT:.1f}, 160 -> {after / MBIT:.1f} Mbit/s; {lags}")
        # The link's fidelity is test_relay's (in one process, +-10 %); here, through
        # the CLI: the cap holds before and after whatever the load (a cap not applied
        # passes it). The lower bounds only on a quiet host (tests/sim/measured.py):
        # other jobs took `before` to 32.5 and, at a load of 10, 16 of 40 Mbit/s, and
        # `after` with it; the raise then shows in the spec the link reports below.
        assert before < 1.10 * 40 * MBIT and after < 1.10 * 160 * MBIT
        if not lag_before.busy:
            assert before > 0.5 * 40 * MBIT, lags
        if not (lag_before.busy or lag_after.busy):
            assert after > 2 * before, lags

        refused = _wan("set", "--control", control, "a-b", "a_to_b.bandwidth_mbit=-1")
        assert_one_line_error(refused, "links.a-b.a_to_b.bandwidth_mbit")
        refused = _wan("set", "--control", control, "a-b", "impairments=[{kind='gremlin'}]")
        assert_one_line_error(refused, "kind must be one of")
        shown = _wan("show", "--control", control, "--json")
        link = json.loads(shown.stdout)["a-b"]
        assert link["spec"]["a_to_b"]["bandwidth_mbit"] == 160  # the refusals changed nothing
        assert link["stats"]["a_to_b"]["bytes_delivered"] == 20 << 20
        assert "a -> b" in _wan("show", "--control", control).stdout
        # A queue shallower than 2 ms of the rate is shown as the one the link keeps.
        fast = _wan("set", "--control", control, "a-b", "bandwidth_mbit=25000")
        assert "queue 6104 KiB (2 ms of the rate; 256 asked)" in fast.stdout, fast.stdout
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(10)
        server.close()
    assert code == 130, up.stderr.read()  # interrupted, as Ctrl-C
    assert port_is_free(int(port))


@pytest.mark.timeout(60)  # a deadline: 17 s at a load of 10, ~4 s idle
def test_bad_input_fails_with_one_line(tmp_path) -> None:
    bad = _topology(tmp_path, 'sites = ["a", "b"]\n[links."a-b"]\nlatency_ms = 5\nbandwith = 1\n')
    assert_one_line_error(_wan("up", bad), "unknown key 'bandwith'", "topology.toml")
    assert_one_line_error(_wan("up", str(tmp_path / "missing.toml")), "not found")
    good = _topology(
        tmp_path, 'sites = ["a", "b"]\n[defaults]\ndistance_km = 10\nbandwidth_mbit = 1\n'
    )
    assert_one_line_error(_wan("up", good, "--forward", "a:c=127.0.0.1:9"), "'c' is not a site")
    assert_one_line_error(_wan("up", good, "--control", "10.0.0.1:80"), "loopback")
    assert_one_line_error(_wan("set", "--control", "127.0.0.1:1", "a-b", "x=1"), "no `isthmus wan")
    assert_one_line_error(_wan("set", "--control", "127.0.0.1:1", "a-b", "nonsense"), "KEY=VALUE")


@pytest.mark.timeout(60)  # imports torch for the help formatter: seconds on a busy machine
def test_help_lists_options_with_defaults() -> None:
    import argparse

    from isthmus.deploy.commands import wan as wan_cmd
    from isthmus.deploy.commands.arguments import HelpFormatter

    result = subprocess.run([*ISTHMUS, "wan", "up", "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    helps = [result.stdout]
    parser = argparse.ArgumentParser(prog="isthmus")
    wan_cmd.register(parser.add_subparsers(dest="command"), HelpFormatter)
    for name in ("set", "show"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            parser.parse_args(["wan", name, "--help"])
        helps.append(out.getvalue())
    for text in helps:
        assert "--control HOST:PORT" in text
        assert "(default: 127.0.0.1:7407)" in " ".join(text.split())
