"""The user's script in the job fingerprint (run.script_sha256, run.script_args): real
coordinators on loopback refuse a join between sites whose `--script` differs in content
or arguments, naming the key, and admit equal ones; a built-in job's fingerprint, and
what the witness compares, are as they were."""

from __future__ import annotations

import argparse
import os

import grpc
import pytest
from coordinators import coordinator, rank_key
from helpers import register_rank

from isthmus.deploy.commands.local import use_script
from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.deploy.rank.contract import SCRIPT_ENV
from isthmus.inter.control.coordinator import CoordinatorError
from isthmus.inter.control.witness import WitnessServer
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _restore_script_env():
    # use_script sets it in this process's environment, which later tests' launchers
    # hand their ranks (monkeypatch.delenv of an unset name would restore nothing).
    before = os.environ.pop(SCRIPT_ENV, None)
    yield
    os.environ.pop(SCRIPT_ENV, None)
    if before is not None:
        os.environ[SCRIPT_ENV] = before


def pinned(script, *args: str) -> dict[str, str]:
    """The fingerprint of a job run with ``--script script -- args``."""
    config = load_config(None, ["topology.device=cpu"])
    use_script(argparse.Namespace(script=str(script), script_args=list(args)), config)
    return config.fingerprint()


def join(fingerprints: list[dict[str, str]]) -> str | None:
    """Two sites, one rank each, joined with these fingerprints: the refusal, or None."""
    names = ["site0", "site1"]
    coords = [
        coordinator(n, names, fingerprint=fp) for n, fp in zip(names, fingerprints, strict=True)
    ]
    for c in coords:
        c.set_peers({o.site: o.address for o in coords if o is not c})
        c.start()
    try:
        for i, (c, fp) in enumerate(zip(coords, fingerprints, strict=True)):
            register_rank(c.address, c.site, fp, key=rank_key(c), lane=f"127.0.0.1:{2000 + i}")
        for c in coords:
            c.wait_ready(15)
        return None
    except CoordinatorError as exc:
        return str(exc)
    finally:
        for c in coords:
            c.stop(grace_s=0.2)


def test_sites_running_other_scripts_are_refused_at_join_naming_the_key(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("print('a')\n")
    b.write_text("print('b')\n")
    assert "run.script_sha256" in join([pinned(a), pinned(b)])
    refused = join([pinned(a, "--lr", "1"), pinned(a, "--lr", "2")])
    assert "run.script_args" in refused and "run.script_sha256" not in refused
    # The same bytes under another path, with the same arguments: the same job.
    same = tmp_path / "elsewhere" / "a.py"
    same.parent.mkdir()
    same.write_bytes(a.read_bytes())
    assert join([pinned(a, "--lr", "1"), pinned(same, "--lr", "1")]) is None


def test_the_builtin_trainer_keeps_its_fingerprint_and_the_witness_ignores_the_script(tmp_path):
    config = load_config(None, ["topology.device=cpu"])
    builtin = config.fingerprint()
    use_script(argparse.Namespace(script=None, script_args=[]), config)
    assert config.fingerprint() == builtin
    assert not any(key.startswith("run.") for key in builtin)
    script = tmp_path / "a.py"
    script.write_text("pass\n")
    witness = WitnessServer(site_names=["site0", "site1"], fingerprint=builtin, failure_timeout_s=5)
    witness.start()
    try:
        with grpc.insecure_channel(witness.address) as channel:
            ping = pb.WitnessPingRequest(
                site="site0", fingerprint=pb.JobFingerprint(fields=pinned(script))
            )
            pb_grpc.WitnessStub(channel).Ping(ping, timeout=5)  # not refused
    finally:
        witness.stop()


def test_a_pinned_script_refuses_another_and_a_job_without_one(tmp_path):
    script = tmp_path / "a.py"
    script.write_text("pass\n")
    other = load_config(None, ["run.script_sha256=" + "0" * 64])
    with pytest.raises(ConfigError, match="run.script_sha256: the job pins 0000"):
        use_script(argparse.Namespace(script=str(script), script_args=[]), other)
    with pytest.raises(ConfigError, match="pin a script: add --script"):
        use_script(argparse.Namespace(script=None, script_args=[]), other)
    with pytest.raises(ConfigError, match="run.script_sha256 must be empty or 64"):
        load_config(None, ["run.script_sha256=abc"])
