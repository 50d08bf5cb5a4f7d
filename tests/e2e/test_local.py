"""End to end: the real `isthmus local` CLI, sites as process groups over emulated links."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from helpers import ISTHMUS, listening_on, pid_alive, port_is_free, run_cli

pytestmark = pytest.mark.slow

SUMMARY_KEYS = {
    "steps",
    "loss_first",
    "loss_last",
    "tokens_per_s",
    "compute_s",
    "cross_site_s",
    "exposed_sync_s",
    "sync_busy_s",
    "overlap",
    "steady_tokens_per_s",
    "exposed_sync_s_per_step",
    "cross_site_bytes",
    "compression_ratio",
    "digests",
}


ONE_EVAL_BATCH = ("--set", "run.eval_batches=1")
"""For jobs whose tests read no held-out loss: the measurement after the last step still
runs, on one batch instead of 16 (16 cost each site seconds of forward passes on 2
cores, in every run)."""


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def losses(run_dir: Path) -> list[float]:
    return [
        json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.timeout(400)
def test_default_job_trains_two_sites_to_identical_replicas(tmp_path):
    """The README's first command: 2 sites x 2 ranks, default small model, 20 steps."""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = run_cli("local", "--steps", "20", "--run-dir", str(run_dir), timeout=400)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    # The budget for this command on a 2-core machine.
    assert elapsed < 180, f"isthmus local --steps 20 took {elapsed:.0f}s"

    summary = read_summary(run_dir)
    assert set(summary) >= SUMMARY_KEYS
    assert summary["steps"] == 20
    assert summary["loss_last"] < summary["loss_first"] - 0.5, summary
    # Every site, and within it every rank, holds the same parameters...
    assert set(summary["digests"]) == {"site0", "site1"}
    assert len(set(summary["digests"].values())) == 1
    # ...and the rank at each coordinate holds the same shard in both sites.
    shards = summary["shard_digests"]
    assert shards["site0"] == shards["site1"] and len(set(shards["site0"])) == 2
    assert summary["cross_site_bytes"] > 0 and summary["compression_ratio"] > 1.0
    assert summary["cross_site_s"] > 0 and summary["compute_s"] > 0
    assert summary["sync_busy_s"] > 0 and 0 <= summary["overlap"] <= 1
    # The rounds ran for some time; what the steps waited of it is the exposed part.
    assert 0 < summary["exposed_sync_s_per_step"] < 10
    assert summary["steady_steps"] == 20 - summary["steady_after"]
    assert len(losses(run_dir)) == 20
    assert (run_dir / "config.toml").read_text().startswith("[job]")
    # The four ranks were forked from one zygote, which imported them once.
    job = json.loads((run_dir / "job.json").read_text())
    parents = {r["parent_pid"] for r in job["ranks"]}
    assert len(job["ranks"]) == 4 and len(parents) == 1, job["ranks"]
    assert parents != {job["launcher_pid"]}
    # Each site's two ranks voted and watched through their host agent: one message to
    # the coordinator for both ranks' votes on a step, and one poll for their watches.
    for site in ("site0", "site1"):
        agent = summary["host_agents"][site]
        assert agent["ranks"] == 2 and agent["votes"] >= 2 * 20, agent
        assert agent["vote_messages"] <= agent["votes"] * 3 // 4, agent
        assert 0 < agent["watch_polls"] < agent["watches"], agent

    # The progress line and the summary a user sees.
    assert "step 20/20" in result.stderr and "tok/s" in result.stderr
    assert "cross-site" in result.stderr and "exposed" in result.stderr
    for label in (
        "loss",
        "tokens/s",
        "steady tokens/s",
        "cross-site sync",
        "exposed sync",
        "bytes across sites",
        "digest site1",
    ):
        assert label in result.stdout
    assert "replicas            identical" in result.stdout


@pytest.mark.timeout(300)
def test_two_sites_match_one_site_over_the_same_global_batch(tmp_path):
    """2 sites x 1 rank with lossless sync against 1 site x 2 ranks.

    The global batch is the same (data shards are numbered site-major), the model
    starts from the same seed, and the average is the same math: one site sums two
    rank gradients in gloo's reduce-scatter and divides by 2; two sites each hold
    one rank's gradient and the cross-site all-reduce sums the two in site order
    and divides by 2. Only the order of fp32 additions may differ, an error of a
    few ulps per step (~1e-7 relative) that AdamW's normalisation can amplify for
    near-zero gradients; over 6 steps the loss agrees to well under 1e-4 relative.
    """
    common = ["--steps", "6", "--set", "model.preset=tiny", "--set", "train.seq_len=64"]
    common += ONE_EVAL_BATCH
    two, one = tmp_path / "two", tmp_path / "one"
    r2 = run_cli("local", *common, "--sites", "2", "--ranks-per-site", "1", "--run-dir", str(two))
    assert r2.returncode == 0, r2.stderr[-3000:]
    r1 = run_cli("local", *common, "--sites", "1", "--ranks-per-site", "2", "--run-dir", str(one))
    assert r1.returncode == 0, r1.stderr[-3000:]
    assert losses(two) == pytest.approx(losses(one), rel=1e-4)
    assert losses(two)[-1] < losses(two)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["step", "diloco"])
def test_offloaded_sites_train_bit_for_bit_like_sites_on_the_device(tmp_path, mode):
    """`parallel.offload` keeps the sharded parameters, gradients and AdamW state in
    host memory; FSDP2 then hands the optimizer host copies of the reduced gradients,
    so per-step sync runs after backward on those copies (intra/train.py), and the
    outer modes average host parameters. With the lossless codec the job must end bit
    for bit where the same job without offload ends: every value crosses the sites
    once, summed in site order."""
    common = [
        *("--steps", "4", "--set", "model.preset=tiny", "--set", "train.seq_len=64"),
        *("--set", "sync.codec=raw", "--sites", "2", "--ranks-per-site", "2"),
        *("--set", f"sync.mode={mode}", "--set", "sync.inner_steps=2"),
        *ONE_EVAL_BATCH,
    ]
    runs = {}
    for name, offload in (("device", "false"), ("offload", "true")):
        run_dir = tmp_path / name
        r = run_cli(
            "local", *common, "--set", f"parallel.offload={offload}", "--run-dir", str(run_dir)
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = json.loads((run_dir / "summary.json").read_text())
    device, offload = runs["device"], runs["offload"]
    assert len(set(offload["digests"].values())) == 1
    assert offload["digests"] == device["digests"]
    assert losses(tmp_path / "offload") == losses(tmp_path / "device")


@pytest.mark.timeout(120)
def test_a_one_site_job_outlasts_the_join_timeout_and_reports_its_progress(tmp_path):
    """A job of one site joins nobody: its coordinator must not time out waiting for
    lanes it will never have (sync.timeout_s), and its rank registers its key so that
    the coordinator takes its progress reports (Prometheus, the job's last step)."""
    run_dir = tmp_path / "run"
    result = run_cli(
        "local", "--sites", "1", "--ranks-per-site", "1", "--steps", "16",
        "--set", "model.preset=tiny", "--set", "sync.timeout_s=2", "--run-dir", str(run_dir),
        *ONE_EVAL_BATCH,
        env={**os.environ, "ISTHMUS_STEP_FLOOR_S": "0.25"},  # 4 s of steps: past the 2 s
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "joining the job" not in result.stderr
    log = (run_dir / "logs" / "site0-rank0.log").read_text()
    assert "progress report to the coordinator failed" not in log, log[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 16


@pytest.mark.timeout(300)
def test_three_sites_stay_identical(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(
        "local",
        "--sites",
        "3",
        "--ranks-per-site",
        "1",
        "--steps",
        "4",
        "--set",
        "model.preset=tiny",
        "--set",
        "sync.codec=raw",
        "--set",
        "sync.chunk_bytes=65536",
        *ONE_EVAL_BATCH,
        "--run-dir",
        str(run_dir),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(run_dir)
    assert len(set(summary["digests"].values())) == 1 and len(summary["digests"]) == 3
    assert summary["compression_ratio"] == pytest.approx(1.0)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "layout",
    [
        ("topology.tp=2", "model.preset=tiny"),
        ("topology.cp=2", "model.preset=tiny"),
        ("topology.ep=2", "model.preset=moe-tiny"),
    ],
    ids=["tp2xdp2", "dp2xcp2", "moe-dp4-ep2"],
)
def test_two_sites_of_four_model_parallel_ranks_stay_identical(tmp_path, layout):
    """Each site is 4 ranks as tp=2 x dp=2, dp=2 x cp=2 (every sequence split over two
    ranks, FSDP over all four), or a mixture of experts on dp=4 with the experts split
    over pairs of ranks (ep=2); lanes pair ranks by mesh coordinate, so an expert shard
    is averaged with the same one at the other site. (A mixture of experts with cp and
    the other layouts: tests/intra/test_intra_parallel.py, against one process.)"""
    run_dir = tmp_path / "run"
    sets = [arg for key in layout for arg in ("--set", key)]
    result = run_cli(
        "local",
        *("--ranks-per-site", "4", "--steps", "3", "--run-dir", str(run_dir)),
        *sets,
        *("--set", "train.seq_len=32", *ONE_EVAL_BATCH),
        timeout=380,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(run_dir)
    assert len(set(summary["digests"].values())) == 1
    # Every coordinate holds its own shard, equal to the same coordinate's in the other site.
    shards = summary["shard_digests"]
    assert shards["site0"] == shards["site1"] and len(set(shards["site0"])) == 4
    # The sites saw different data: their losses differ while the weights agree.
    losses = {
        site: [
            json.loads(line)["loss"] for line in (run_dir / "sites" / site / "metrics.jsonl").open()
        ]
        for site in ("site0", "site1")
    }
    assert losses["site0"] != losses["site1"] and len(losses["site0"]) == 3
    # A mixture of experts reports its load-balancing loss (1 when balanced, at most
    # n_experts = 4); a dense model has none.
    lines = [json.loads(line) for line in (run_dir / "sites" / "site0" / "metrics.jsonl").open()]
    aux = [line.get("moe_aux_loss") for line in lines]
    if "moe" in layout[1]:
        assert all(a is not None and 1.0 <= a < 4.0 for a in aux), aux
    else:
        assert aux == [None] * 3


def start_job(run_dir: Path, *extra: str) -> tuple[subprocess.Popen, dict]:
    """Start a long `isthmus local` and wait until every site has trained a step."""
    process = subprocess.Popen(
        [
            *ISTHMUS,
            "local",
            "--steps",
            "500",
            "--set",
            "model.preset=tiny",
            "--run-dir",
            str(run_dir),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    metrics = [run_dir / "sites" / site / "metrics.jsonl" for site in ("site0", "site1")]
    while not all(m.exists() and m.read_text().strip() for m in metrics):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no step within 120 s"
        time.sleep(0.2)
    return process, json.loads((run_dir / "job.json").read_text())


def assert_nothing_left(job: dict) -> None:
    deadline = time.monotonic() + 10
    # The ranks, and the zygote they were forked from (deploy/launch/zygote.py).
    pids = [r["pid"] for r in job["ranks"]] + [r["parent_pid"] for r in job["ranks"]]
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if pid_alive(pid)], "orphan rank processes"
    ports = [int(a.rsplit(":", 1)[1]) for a in job["coordinators"].values()]
    ports += [
        int(url.rsplit(":", 1)[1]) for site in job["proxies"].values() for url in site.values()
    ]
    assert [p for p in ports if not port_is_free(p)] == [], "ports left bound"
    assert [s for s in job["stores"] if os.path.exists(s)] == [], "store folders left"


@pytest.mark.timeout(200)
def test_ctrl_c_tears_everything_down(tmp_path):
    process, job = start_job(tmp_path / "run")
    # Nothing of a local job listens beyond loopback: not the coordinators, not the
    # link proxies, not torch's unauthenticated TCPStore (issue 14, row 11).
    ports = [int(a.rsplit(":", 1)[1]) for a in job["coordinators"].values()]
    ports += [int(u.rsplit(":", 1)[1]) for site in job["proxies"].values() for u in site.values()]
    # The ranks' store is a FileStore in a 0700 folder: no port at all (issue 33, row 11).
    assert all(stat.S_IMODE(os.stat(store).st_mode) == 0o700 for store in job["stores"])
    for port in ports:
        assert listening_on(port) == {"127.0.0.1"}, (port, listening_on(port))
    # Loopback is every local user's: the job made itself a token, readable by its owner.
    token = Path(job["token_file"])
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text().strip()) >= 32
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert_nothing_left(job)
    assert not token.exists()


@pytest.mark.timeout(200)
def test_a_dying_rank_fails_the_job_with_one_line_and_no_orphans(tmp_path):
    process, job = start_job(tmp_path / "run")
    victim = job["ranks"][1]
    subprocess.run(["kill", "-9", str(victim["pid"])], check=True)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    # Either the killed rank is named, or a peer that lost it reports first.
    assert "exited with code" in errors[0], errors[0]
    assert_nothing_left(job)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ranks_started_as_interpreters_of_their_own_train_like_forked_ones(tmp_path):
    """``ISTHMUS_FORK_RANKS=0``: each rank is ``python -m isthmus.deploy.rank.program``
    of its own, a child of the launcher; the losses and the replicas are bit for bit
    those of ranks forked from the zygote (the default)."""
    common = ["--steps", "4", "--set", "model.preset=tiny", "--set", "train.seq_len=64"]
    runs = {}
    for how, fork in (("forked", "1"), ("own", "0")):
        run_dir = tmp_path / how
        env = {**os.environ, "ISTHMUS_FORK_RANKS": fork}
        result = run_cli("local", *common, "--run-dir", str(run_dir), timeout=300, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        job = json.loads((run_dir / "job.json").read_text())
        runs[how] = (read_summary(run_dir)["digests"], losses(run_dir), job)
    own_job = runs["own"][2]
    assert {r["parent_pid"] for r in own_job["ranks"]} == {own_job["launcher_pid"]}
    assert {r["parent_pid"] for r in runs["forked"][2]["ranks"]} != {
        runs["forked"][2]["launcher_pid"]
    }
    assert runs["own"][:2] == runs["forked"][:2]
