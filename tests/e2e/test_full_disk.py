"""A run folder on a full disk (issue 33, row 12): the job's last line names the errno
and the file, no ``.partial`` checkpoint folder is left, and a rank whose log cannot
take its error still gets its failure to the launcher. The disk is a real one: a small
tmpfs (tests/tmpfs.py), filled by the job itself or by the test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import run_cli
from tmpfs import fill, small_tmpfs

from isthmus.deploy.launch.ranks import RankProcess, SiteRanks


@pytest.mark.slow
def test_isthmus_local_on_a_full_disk_names_the_errno_and_the_file(tmp_path: Path) -> None:
    """The red team's 40 MB tmpfs, scaled to the tiny preset: 3 MB hold the run's
    first checkpoint of both sites (~1 MB each) but not the second."""
    with small_tmpfs(tmp_path / "disk", "3m") as disk:
        run_dir = disk / "run"
        result = run_cli(
            "local",
            *("--set", "model.preset=tiny", "--set", "train.seq_len=64"),
            *("--set", "run.tensorboard=false", "--set", "run.eval_batches=0"),
            *("--steps", "6", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=0"),
            *("--run-dir", str(run_dir), "--quiet"),
            timeout=240,
        )
        assert result.returncode == 1, result.stdout + result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: site"), result.stderr
        assert f"no space left on device (ENOSPC) writing {run_dir}/" in last, last
        # Mostly the second checkpoint fills the disk; on a slow machine the logs may have
        # taken the last bytes first, and then the next write there names its own file.
        if ".partial/" in last:
            assert f"{run_dir}/checkpoints/site" in last, last
            assert "not saved (its .partial folder removed)" in last, last
        assert "Traceback" not in result.stderr, result.stderr
        leftovers = [str(p) for p in run_dir.rglob("*.partial")]
        assert leftovers == [], leftovers
        # Every rank of the site that failed said why in its own log.
        site = last.split()[1]
        for log in sorted((run_dir / "logs").glob(f"{site}-rank*.log")):
            assert "(ENOSPC)" in log.read_text(), log
        # The reserves each rank held back for its last words are gone.
        assert list((run_dir / "logs").glob(".*.reserve")) == []


_RANK = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from isthmus.deploy.rank.program import LastWords
    from isthmus.deploy.rank.startup import RankEnv

    env = RankEnv(site="site0", rank=1, world_size=2, run_dir=Path(sys.argv[1]),
                  coordinator="", proxies={})
    words = LastWords(env)
    print("reserved", flush=True)
    sys.stdin.readline()  # the test fills the disk meanwhile
    sys.exit(words.say(sys.argv[2]))
    """
)


@pytest.mark.slow  # a Python that imports torch and grpc: 5-8 s on 2 busy cores
def test_a_rank_on_a_full_disk_still_writes_its_error_line(tmp_path: Path) -> None:
    """A rank's log on a full disk was 0 bytes: its error line is written in the space
    the rank held back at start."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        (disk / "logs").mkdir()
        log = disk / "logs" / "site0-rank1.log"
        line = "no space left on device (ENOSPC) writing /run/metrics.jsonl"
        with log.open("w") as out:
            rank = subprocess.Popen(
                [sys.executable, "-c", _RANK, str(disk), line],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                text=True,
            )
        try:
            assert rank.stdout.readline() == "reserved\n"
            fill(disk)
            with pytest.raises(OSError, match="No space left"):  # the disk is full indeed
                (disk / "probe").write_bytes(b"x" * 4096)
            rank.stdin.write("\n")
            rank.stdin.flush()
            assert rank.wait(timeout=30) == 1
        finally:
            rank.kill()
        assert f"error: [site0/1] {line}" in log.read_text()
        assert not (disk / "logs" / ".site0-rank1.reserve").exists()


def test_the_launcher_names_a_full_disk_when_a_rank_could_not_say_why(tmp_path: Path) -> None:
    """A rank that exits with an error and an empty log on a full disk: the job's line
    says ENOSPC and names the log (it was an empty reason)."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        log = disk / "site1-rank0.log"
        with log.open("w") as out:
            silent = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"], stderr=out)
        silent.wait(timeout=30)
        failed = RankProcess("site1", 0, silent, log)
        # Room on the disk: the rank's (empty) reason stands, nothing is guessed.
        assert "ENOSPC" not in SiteRanks.describe_failure(failed)
        fill(disk)
        reason = SiteRanks.describe_failure(failed)
    assert reason.startswith("site1 rank 0 exited with code 1: no space left on device (ENOSPC)")
    assert str(log) in reason
