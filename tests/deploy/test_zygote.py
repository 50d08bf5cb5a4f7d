"""The rank zygote (deploy/launch/zygote.py): real processes forked from a real zygote."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers import pid_alive

from isthmus.deploy.launch import zygote as zygote_module
from isthmus.deploy.launch.zygote import Zygote, ZygoteError, shared_zygote

TESTS = str(Path(__file__).resolve().parents[1])


def _env(**more: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **more}


@pytest.fixture
def zygote():
    z = Zygote(_env(ONLY_THE_ZYGOTE="yes"), preload=("json",), entry="zygote_target:main")
    yield z
    z.close()


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not pid_alive(pid)


def test_a_child_runs_with_the_rank_s_env_cwd_and_log_and_its_code_is_told(zygote, tmp_path):
    log = tmp_path / "rank.log"
    log.write_text("the last run's lines\n")
    rank = zygote.start(_env(TARGET_SAY="hello", TARGET_CODE="7"), log, cwd=str(tmp_path))
    assert rank.wait(timeout=30) == 7
    line = log.read_text()
    assert "the last run" not in line  # made anew, as open(path, "w") would
    zygote_pid = zygote.process.pid
    assert f"say=hello cwd={tmp_path} ppid={zygote_pid} launcher={zygote_pid} leaked=\n" == line
    assert rank.poll() == 7


def test_signals_reach_the_child_and_its_code_says_which(zygote, tmp_path):
    ranks = [
        zygote.start(_env(TARGET_MODE="sleep"), tmp_path / f"r{i}.log", cwd=str(tmp_path))
        for i in range(2)
    ]
    with pytest.raises(subprocess.TimeoutExpired):
        ranks[0].wait(timeout=0.2)
    assert ranks[0].poll() is None
    ranks[0].terminate()
    ranks[1].kill()
    assert ranks[0].wait(timeout=10) == -signal.SIGTERM
    assert ranks[1].wait(timeout=10) == -signal.SIGKILL
    ranks[1].kill()  # after its end: nothing is sent, nothing raised


def test_what_the_child_raises_is_in_its_log_and_its_code_is_1(zygote, tmp_path):
    rank = zygote.start(_env(TARGET_MODE="raise"), tmp_path / "r.log", cwd=str(tmp_path))
    assert rank.wait(timeout=30) == 1
    text = (tmp_path / "r.log").read_text()
    assert "ValueError: the target raised" in text and "Traceback" in text


def test_the_children_die_with_the_zygote_and_it_says_so(zygote, tmp_path):
    rank = zygote.start(_env(TARGET_MODE="sleep"), tmp_path / "r.log", cwd=str(tmp_path))
    zygote.process.kill()
    assert rank.wait(timeout=10) == -signal.SIGKILL
    assert _gone(rank.pid)
    assert not zygote.alive
    with pytest.raises(ZygoteError, match="gone"):
        zygote.start(_env(), tmp_path / "r2.log")


def test_the_zygote_and_its_children_die_with_the_launcher(tmp_path):
    """A launcher killed with SIGKILL leaves no zygote and no rank behind."""
    launcher = textwrap.dedent(
        f"""
        import os, sys, time
        from isthmus.deploy.launch.zygote import Zygote
        env = {{**os.environ, "TARGET_MODE": "sleep"}}
        z = Zygote(env, preload=("json",), entry="zygote_target:main")
        rank = z.start(env, {str(tmp_path / "r.log")!r})
        print(z.process.pid, rank.pid, flush=True)
        time.sleep(3600)
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", launcher], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        zygote_pid, rank_pid = (int(x) for x in process.stdout.readline().split())
        assert not _gone(rank_pid, within_s=0.3)
        process.kill()
        process.wait()
        assert _gone(zygote_pid) and _gone(rank_pid)
    finally:
        process.kill()


def test_a_zygote_that_cannot_import_is_an_error_at_once(tmp_path):
    started = time.monotonic()
    with pytest.raises(ZygoteError, match="exited with code 1 before it was ready"):
        Zygote(_env(), preload=("no_such_module_here",), entry="zygote_target:main")
    assert time.monotonic() - started < 30


def test_no_zygote_when_ranks_are_not_forked(monkeypatch):
    monkeypatch.setenv("ISTHMUS_FORK_RANKS", "0")
    assert shared_zygote(os.environ) is None


def test_a_shared_zygote_that_failed_is_not_tried_again(monkeypatch):
    calls = []

    def failing(env):
        calls.append(env)
        raise ZygoteError("cannot start here")

    monkeypatch.setattr(zygote_module, "Zygote", failing)
    monkeypatch.setattr(zygote_module, "_shared", None)
    monkeypatch.setattr(zygote_module, "_shared_failed", False)
    monkeypatch.delenv("ISTHMUS_FORK_RANKS", raising=False)
    assert shared_zygote(os.environ) is None
    assert shared_zygote(os.environ) is None
    assert len(calls) == 1


def test_a_zygote_started_by_a_thread_outlives_the_thread(tmp_path):
    """Linux's PR_SET_PDEATHSIG fires when the thread that started a process ends; the
    zygote is started from a thread of its own, so the launcher's other ranks keep it."""
    made: list[Zygote] = []
    thread = threading.Thread(
        target=lambda: made.append(Zygote(_env(), preload=("json",), entry="zygote_target:main"))
    )
    thread.start()
    thread.join()
    z = made[0]
    try:
        time.sleep(0.3)
        assert z.alive
        assert z.start(_env(TARGET_CODE="3"), tmp_path / "r.log").wait(timeout=30) == 3
    finally:
        z.close()
    assert z.process.poll() is not None


def test_the_rank_s_own_pythonpath_is_honoured(zygote, tmp_path):
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "only_for_the_rank.py").write_text("VALUE = 41 + 1\n")
    env = _env(TARGET_MODE="import", TARGET_IMPORT="only_for_the_rank")
    env["PYTHONPATH"] = os.pathsep.join([str(extra), env["PYTHONPATH"]])
    rank = zygote.start(env, tmp_path / "r.log", cwd=str(tmp_path))
    assert rank.wait(timeout=30) == 0
    assert "imported=42" in (tmp_path / "r.log").read_text()


def test_ctrl_c_and_stack_requests_are_for_the_children_not_the_zygote(zygote, tmp_path):
    """A terminal's Ctrl-C (SIGINT) and a hung job's SIGUSR1 reach the whole process
    group; the zygote's death would SIGKILL every rank first, so it ignores both."""
    ranks = [
        zygote.start(_env(TARGET_MODE="sleep"), tmp_path / f"r{i}.log", cwd=str(tmp_path))
        for i in range(2)
    ]
    os.kill(zygote.process.pid, signal.SIGINT)
    os.kill(zygote.process.pid, signal.SIGUSR1)
    time.sleep(0.3)
    assert zygote.alive and ranks[0].poll() is None
    ranks[0].send_signal(signal.SIGUSR1)  # a child takes it as a fresh process would
    assert ranks[0].wait(timeout=10) == -signal.SIGUSR1
    ranks[1].send_signal(signal.SIGINT)  # Python's KeyboardInterrupt
    assert ranks[1].wait(timeout=10) != 0
    assert "KeyboardInterrupt" in (tmp_path / "r1.log").read_text()


def test_the_launcher_waits_for_its_zygote_so_the_ranks_cpu_is_counted(tmp_path):
    """The shared zygote is ended and waited for as its launcher exits: the CPU time of
    the ranks it reaped then reaches whoever waits for the launcher (``time``, a
    benchmark's rusage). Killed with the launcher instead, it took that time along."""
    launcher = textwrap.dedent(
        f"""
        import functools, os
        from isthmus.deploy.launch import zygote
        zygote.Zygote = functools.partial(
            zygote.Zygote, preload=("json",), entry="zygote_target:main"
        )
        env = {{**os.environ, "TARGET_MODE": "burn", "TARGET_BURN_S": "1.0"}}
        rank = zygote.shared_zygote(env).start(env, {str(tmp_path / "r.log")!r})
        assert rank.wait(timeout=60) == 0
        """
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", launcher], env=_env(), check=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert cpu >= 0.9, cpu
