"""The per-rank training program: one process of one site.

Started by a launcher (`isthmus local`, later torchrun or srun) with torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) describing the
*site's* world, plus:

    ISTHMUS_CONFIG       path of the resolved job config (TOML)
    ISTHMUS_SITE         this site's name
    ISTHMUS_COORDINATOR  host:port of this site's coordinator (multi-site jobs)
    ISTHMUS_PROXIES      JSON {peer site: HTTP CONNECT proxy URL} of the emulated links
    ISTHMUS_RUN_DIR      where metrics and results go
    ISTHMUS_SLOWDOWN, ISTHMUS_STEP_FLOOR_S   fault injection (`isthmus chaos`)

`run` is the rank's three phases: `set_up` (deploy/rank/startup.py) builds the mesh,
model, trainer and, for a multi-site job, its lane and sync; `train` and
`StepLoop.finish` (deploy/rank/loop.py) run the steps and the end. This module is the
process around them: a script run instead of the loop, the rank's death with its
launcher, its one error line, and a script's error told to the site's coordinator, which
stops the job at every site."""

from __future__ import annotations

import gc

if __name__ == "__main__":
    # The imports below (torch, DTensor, gRPC: ~2 s) leave ~400,000 objects that live as
    # long as the rank, and the cyclic collector's full passes over them while they load
    # (four or five, up to 0.2 s each) cost a rank ~0.5 s of CPU before its first step
    # (2-core machine). Off while they load; back on below with them frozen out of its
    # passes: cycles made later are collected, the imports' few thousand stay.
    gc.disable()

import contextlib
import ctypes
import errno
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

import grpc

from isthmus.deploy.config.job import JobConfig, load_config
from isthmus.deploy.rank.contract import SCRIPT_ENV
from isthmus.deploy.rank.loop import StepLoop, train
from isthmus.deploy.rank.reporting import DivergenceError
from isthmus.deploy.rank.startup import RankEnv, build_trainer, script_ended, security_of, set_up
from isthmus.inter.data import ModelMismatch, NonFiniteGradient, QuorumLost
from isthmus.intra.checkpoint_errors import CheckpointError, describe_os_error

__all__ = ["RankEnv", "build_trainer", "main", "run", "run_as_process"]

log = logging.getLogger("isthmus.rank")

RESERVE_BYTES = 64 << 10
"""Disk space a rank holds back, in a file beside its log, for its last words: on a
full disk its error line would not reach the log, where the launcher reads it, and
the job would stop with an empty reason (issue 33, row 12)."""
ABORT_CALL_S = 5.0
"""Deadline of the rank's call that tells its coordinator the script raised."""
JOB_FAILURES = (DivergenceError, QuorumLost, NonFiniteGradient, CheckpointError, ModelMismatch)
"""How isthmus itself stops a rank, in one line: raised inside a script's ``ctx.step``
too, where they are not the script's errors (they never abort the job)."""
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})
"""Failures of the rank's storage, reported in one line rather than as a traceback."""


TERMINATED = threading.Event()  # the launcher stopped this rank (SIGTERM)


def _terminate(*_: object) -> None:
    TERMINATED.set()
    sys.exit(143)


def run(env: RankEnv, config: JobConfig) -> None:
    """One rank's life: setup, the step loop, teardown."""
    loop = StepLoop(set_up(env, config))
    train(loop)
    loop.finish()


class ScriptError(Exception):
    """The user's script raised: its traceback is in the rank's log, its last line here.
    ``aborts_job`` is False when its call into the site's torch.distributed world failed
    (a site-mate died): the site's loss, which failover handles, not the script's error."""

    def __init__(self, message: str, *, aborts_job: bool = True) -> None:
        super().__init__(message)
        self.aborts_job = aborts_job


def in_collective(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) came out of torch.distributed: a
    collective whose peer rank is gone fails with a plain RuntimeError from gloo
    ("Connection closed by peer"), named only by where it was raised."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ in ("DistError", "DistBackendError", "DistNetworkError"):
            return True
        tb = current.__traceback__
        while tb is not None:
            if f"{os.sep}torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename:
                return True
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return False


def seed_rngs(seed: int) -> None:
    """Seeds Python's, numpy's and torch's RNGs with the job's seed, alike at every rank
    of every site, before the user's script runs: a script that never seeds builds the
    same model everywhere, and one that seeds does so after this. Not offset by rank:
    the model must be equal at every rank; their data differs (``ctx.data_shard()``)."""
    import random

    import numpy
    import torch

    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_script(argv: list[str]) -> None:
    """Runs the user's script (``--script PATH ARGS``) as this rank, as torchrun would:
    ``__main__``, ``sys.argv`` its own; it trains through ``isthmus.deploy.api``. What
    it raises ends the rank with the traceback's last line (the job's one error line);
    a script that returns without ``ctx.finish()`` is torn down here."""
    import runpy
    import traceback

    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            # Stopped by its launcher (SIGTERM): the site's end, not the script's error.
            stopped = TERMINATED.is_set()
            raise ScriptError(f"{argv[0]} exited with {exc.code}", aborts_job=not stopped) from None
    except (*JOB_FAILURES, grpc.RpcError):
        raise  # isthmus's own, from inside ctx.step: said in one line, never an abort
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            raise  # the rank's storage failed, not the script
        traceback.print_exc()
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        raise ScriptError(f"{argv[0]}: {last}", aborts_job=not in_collective(exc)) from None
    script_ended()


def abort_job(env: RankEnv, config: JobConfig, error: Exception) -> None:
    """The script raised, or the sites' models differ: tell the site's coordinator, which
    stops the job at every site (inter/control/abort.py). Best effort: a coordinator that
    cannot be told leaves this site's failure to the other sites' failover."""
    if not env.coordinator:
        return
    from isthmus.inter.control.coordinator_client import CoordinatorClient

    try:
        client = CoordinatorClient.connect(env.coordinator, security_of(env, config))
    except (OSError, ValueError) as exc:  # its certificate or token cannot be read now
        log.warning("could not tell the coordinator to stop the job: %s", exc)
        return
    try:
        client.abort_job(site=env.site, rank=env.rank, reason=str(error), timeout_s=ABORT_CALL_S)
    except grpc.RpcError as exc:
        log.warning("could not tell the coordinator to stop the job: %s", exc.details())
    finally:
        client.close()


def die_with_launcher() -> None:
    """Ask Linux to SIGKILL this rank when its launcher dies: no orphans, ever."""
    launcher = os.environ.get("ISTHMUS_LAUNCHER_PID")
    if not launcher:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != int(launcher):  # the launcher died before the prctl took hold
        sys.exit(143)


class LastWords:
    """The rank's one error line, delivered to its log even when the disk is full: a
    reserve of ``RESERVE_BYTES`` taken at start is given back just before the line is
    written (and at exit). Where the run folder has no ``logs/`` (a launcher of its
    own), nothing is reserved."""

    def __init__(self, env: RankEnv) -> None:
        self.prefix = f"[{env.site}/{env.rank}]"
        self.reserve: Path | None = env.run_dir / "logs" / f".{env.site}-rank{env.rank}.reserve"
        try:
            self.reserve.write_bytes(bytes(RESERVE_BYTES))  # zeros: real blocks, not a hole
        except OSError:  # no logs/ here, or already full: nothing held back
            self.release()
            self.reserve = None

    def say(self, text: str) -> int:
        """Print ``error: [site/rank] text`` to stderr (the rank's log); returns 1."""
        line = f"error: {self.prefix} {text}"
        try:
            print(line, file=sys.stderr, flush=True)
        except OSError:  # the log's disk is full: free the reserve, then say it once more
            self.release()
            with contextlib.suppress(OSError):
                print(line, file=sys.stderr, flush=True)
        return 1

    def release(self) -> None:
        if self.reserve is not None:
            with contextlib.suppress(OSError):
                self.reserve.unlink(missing_ok=True)


def main() -> int:
    die_with_launcher()
    env = RankEnv.from_environ()
    config = load_config(os.environ["ISTHMUS_CONFIG"])
    logging.basicConfig(
        level=config.run.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{env.site}/{env.rank}] %(name)s: %(message)s",
    )
    # The launcher stops ranks with SIGTERM; exit quietly rather than with a traceback.
    signal.signal(signal.SIGTERM, _terminate)
    # `kill -USR1` prints every thread's stack to the rank's log: how a stuck rank is read.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # A crash in native code (SIGSEGV, SIGABRT) leaves every thread's Python stack in the
    # log rather than only the exit code -11.
    faulthandler.enable(all_threads=True)
    last_words = LastWords(env)
    script = os.environ.get(SCRIPT_ENV)
    try:
        if script:
            seed_rngs(config.job.seed)
            run_script(json.loads(script))
        else:
            run(env, config)
    except ScriptError as exc:
        if exc.aborts_job:
            abort_job(env, config, exc)
        return last_words.say(str(exc))
    except grpc.RpcError as exc:
        return last_words.say(str(exc.details()))
    except (ModelMismatch, DivergenceError) as exc:
        # No site can go on (the others see the same): the job stops everywhere, at
        # once, with this line, rather than dropping one site and training on alone.
        abort_job(env, config, exc)
        return last_words.say(str(exc))
    except JOB_FAILURES as exc:
        return last_words.say(str(exc))
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS:
            raise
        # "no space left on device (ENOSPC) writing /run/x": a failed write() names no
        # file, so then the run folder.
        return last_words.say(describe_os_error(exc, f"a file under {env.run_dir}"))
    finally:
        last_words.release()
    return 0


def run_as_process() -> NoReturn:
    """The rank as a process (``python -m``, or a child of the launcher's zygote): ``main``,
    then out at once."""
    code = main()
    # Everything the rank owes is written and closed (its result file, metrics, lanes,
    # process group). Python's own teardown of torch, gloo and gRPC state took ~2 s
    # more per rank on a 2-core machine, and every launcher waited for it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    gc.freeze()  # what the imports made (see gc.disable above)
    gc.enable()
    run_as_process()
