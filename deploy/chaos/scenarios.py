"""The chaos suite's scenarios (`isthmus chaos`; the runner is deploy/chaos/suite.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["SCENARIOS", "Fault", "Scenario"]


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault: what, where, and at which step of the job (read from its metrics)."""

    kind: str
    """kill, restart, partition, corrupt, slow, flood, forge, forge-rejoin (calls in
    another site's name while site1 restarts), lane-threads (the lane's
    codec threads shut down mid-round, at the round of step ``at_step``), stall-flow
    (the link holds the first bulk flow each way for ``duration_s``: a flow black-holed
    on the way, while the link's others carry on), node-silent (the second node of a
    site on two is frozen for ``duration_s``, SIGSTOP to all its processes: open
    connections stay open, nothing is answered, no reset is sent) or agent-kill (the
    second node's host agent stops serving while its ranks run on)."""
    site: str = ""
    """The site killed, restarted or slowed."""
    link: tuple[str, str] = ("site0", "site1")
    """The link partitioned, corrupted or with a flow stalled."""
    at_step: int = 0
    """Inject once the job has completed this many steps (0 = from the start)."""
    duration_s: float = 0.0
    """How long a partition or a flood lasts; for restart, the pause after the kill."""
    rate: float = 0.0
    """Corrupt: probability that a piece (<= 64 KiB read) gets a flipped bit.
    Slow: the slowdown factor."""


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    description: str
    steps: int
    faults: tuple[Fault, ...]
    sites: int = 2
    survivors: tuple[str, ...] = ("site0", "site1")
    """Sites that must finish the job with equal digests."""
    quick: bool = False
    """Part of the quick subset (CI)."""
    expect_generations: bool = True
    """The membership must have changed (a site left or came back)."""
    pace_s: float = 0.0
    """No step of any site is shorter than this (ISTHMUS_STEP_FLOOR_S), so the job
    still runs when a restarted or cut-off site comes back, on any hardware."""
    witness: bool = False
    """The job has a witness (`isthmus witness`, failover.witness) that breaks even splits."""
    settings: tuple[str, ...] = ()
    """``KEY=VALUE`` job settings of the scenario, given to every site (``--set``)."""
    expect_rebalance: bool = False
    """The slowed site must end with fewer micro-batches per step than it began with
    (train.balance_every moved them to the others)."""
    fault_free_baseline: bool = False
    """Run the job once more without its faults and set goodput and final loss against it."""
    two_nodes: tuple[str, ...] = ()
    """Sites run as two node launchers (`isthmus site --nodes 2`, one rank each, as
    deploy/slurm and deploy/k8s run a site); every site then has two ranks."""


# One scenario a row: its shape on the first lines, what it shows in its description.
SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        name="kill",
        steps=14,
        faults=(Fault(kind="kill", site="site1", at_step=4),),
        survivors=("site0",),
        quick=True,
        description="SIGKILL site1 at step 4 of 2; site0 (the tie-breaker) carries on alone",
    ),
    Scenario(
        name="kill-restart",
        steps=60,
        quick=True,
        pace_s=0.3,
        faults=(Fault(kind="restart", site="site1", at_step=4, duration_s=1.0),),
        description="SIGKILL site1 at step 4 and start it again: it pulls the state from "
        "site0 and rejoins",
    ),
    Scenario(
        name="kill-first",
        steps=14,
        faults=(Fault(kind="kill", site="site0", at_step=4),),
        survivors=("site1",),
        quick=True,
        witness=True,
        description="2 sites and a witness; SIGKILL site0 (the tie-breaker) at step 4: with "
        "the witness's grant site1 carries on alone (without one it would stop)",
    ),
    Scenario(
        name="kill-leader",
        sites=3,
        steps=14,
        faults=(Fault(kind="kill", site="site0", at_step=4),),
        survivors=("site1", "site2"),
        description="3 sites; SIGKILL site0 (the leader) at step 4: site1 takes over",
    ),
    Scenario(
        name="partition",
        steps=60,
        quick=True,
        pace_s=0.3,
        faults=(Fault(kind="partition", at_step=4, duration_s=6.0),),
        description="cut the site0-site1 link for 8 s at step 4: site0 (quorum by "
        "tie-break) goes on, site1 waits, then pulls the state and rejoins",
    ),
    Scenario(
        name="corrupt",
        steps=10,
        expect_generations=False,
        faults=(Fault(kind="corrupt", rate=0.02),),
        description="flip a bit in 2% of the bulk pieces (>= 16 KiB reads) crossing the "
        "link, both ways, all run; every corrupt chunk is pulled again",
    ),
    Scenario(
        name="flood",
        steps=30,
        expect_generations=False,
        pace_s=0.3,
        faults=(Fault(kind="flood", site="site0", at_step=4, duration_s=6.0),),
        description="at step 4, 20 health watches and 40 long polls held open for 6 s at "
        "site0's coordinator and 40 silent PushChunks streams at its lane (issue 14: they "
        "once froze the job); nobody is excluded",
    ),
    Scenario(
        name="forge",
        steps=30,
        quick=True,
        expect_generations=False,
        pace_s=0.3,
        faults=(Fault(kind="forge", site="site0", at_step=4, duration_s=6.0),),
        description="from step 4, for 6 s, calls in site1's name at site0's coordinator: a "
        "heartbeat with a wrong digest, a join claiming a restart with other lanes, votes "
        "without the rank's key, a reordered proposal (issue 14, rows 1-4); and at its "
        "lane: ResendChunk, OpenBulk and NaN or finite chunks for the coming steps (issue "
        "33, rows 7-8); nobody leaves",
    ),
    Scenario(
        name="forge-rejoin",
        steps=60,
        quick=True,
        pace_s=0.3,
        faults=(
            Fault(kind="restart", site="site1", at_step=4, duration_s=1.0),
            Fault(kind="forge-rejoin", site="site0", at_step=4, duration_s=15.0),
        ),
        description="SIGKILL site1 at step 4 and start it again while a token holder tells "
        "it, in site0's name, that site0 ran its last step, and pulls the state offered to "
        "site1 from site0's lane in site1's name (issue 63, rows 1-2): site1 asks site0, "
        "rejoins, and the forger is served nothing",
    ),
    Scenario(
        name="slow",
        steps=8,
        expect_generations=False,
        faults=(Fault(kind="slow", site="site1", rate=5.0),),
        description="site1 runs 5x slower; nobody is excluded, the job waits for it",
    ),
    Scenario(
        name="slow-balance",
        steps=32,
        expect_generations=False,
        expect_rebalance=True,
        faults=(Fault(kind="slow", site="site1", rate=4.0, at_step=8),),
        settings=("train.accumulate=3", "train.balance_every=4"),
        description="site1 slows 4x at step 8 of a job whose sites re-balance every 4 "
        "steps (3 micro-batches each to begin): micro-batches move to site0, the global "
        "batch held",
    ),
    Scenario(
        name="stall-flow",
        steps=14,
        quick=True,
        expect_generations=False,
        faults=(Fault(kind="stall-flow", at_step=4, duration_s=60.0),),
        description="at step 4, the link black-holes one bulk flow each way for 60 s (a "
        "dead ECMP path): each lane leaves its stalled connection past a frame's deadline "
        "and sends its frames on a new one; no step is retried, nobody leaves",
    ),
    Scenario(
        name="lane-threads",
        steps=14,
        quick=True,
        expect_generations=False,
        faults=(Fault(kind="lane-threads", site="site1", at_step=4),),
        description="at step 4, site1's rank loses its lane's codec threads in the middle "
        "of a round (shut down after its first tasks): the round fails in one line, new "
        "threads take over, the step is tried again; nobody leaves",
    ),
    # Paced at 0.3 s: site0 alone holds 36 s for site1 to be found silent (~3 s),
    # thawed (6 s), restarted and admitted (its imports: ~10-20 s on 2 loaded cores).
    Scenario(
        name="node-silent",
        steps=120,
        quick=True,
        pace_s=0.3,
        two_nodes=("site1",),
        faults=(Fault(kind="node-silent", site="site1", at_step=4, duration_s=6.0),),
        description="site1 on two nodes; at step 4 its second node goes silent for 6 s "
        "(frozen: no reset, no answer): its rank is declared dead, site1 leaves the job and "
        "site0 goes on; site1's node launchers end, are started again (as a scheduler "
        "restarts them) once the node is back, and site1 rejoins with site0's state",
    ),
    Scenario(
        name="agent-kill",
        steps=14,
        quick=True,
        expect_generations=False,
        two_nodes=("site1",),
        faults=(Fault(kind="agent-kill", site="site1", at_step=4),),
        description="site1 on two nodes; at step 4 its second node's host agent stops: the "
        "node's rank votes and watches at the coordinator itself; nobody leaves",
    ),
)


# The soak scenario (issue 62): a seeded schedule of faults over a long streaming job of
# three sites, judged as any scenario and then set against the same job without faults.
SOAK_STEPS = 64
STREAMING = ("sync.mode=streaming", "sync.inner_steps=4", "sync.fragments=2", "sync.outer_delay=1")


def soak(seed: int = 0) -> Scenario:
    """The soak scenario; ``seed`` draws where each fault falls (each in its own part of
    the run, so that one has healed before the next) and which site it hits."""
    rng = random.Random(seed)
    third = SOAK_STEPS // 4
    restarted, slowed = rng.sample(["site1", "site2"], 2)
    faults = (
        Fault(kind="restart", site=restarted, at_step=rng.randrange(4, third), duration_s=1.0),
        Fault(
            kind="partition",
            link=("site0", restarted),
            at_step=rng.randrange(third + 8, 2 * third),
            duration_s=1.5,
        ),
        Fault(kind="slow", site=slowed, rate=2.0, at_step=rng.randrange(2 * third + 4, 3 * third)),
    )
    schedule = ", ".join(
        f"{f.kind} {f.site or '-'.join(f.link)} at step {f.at_step}" for f in faults
    )
    return Scenario(
        name="soak",
        sites=3,
        steps=SOAK_STEPS,
        pace_s=0.3,
        survivors=("site0", "site1", "site2"),
        settings=STREAMING,
        faults=faults,
        fault_free_baseline=True,
        description=f"3 sites in Streaming DiLoCo, seed {seed}: {schedule}; then the same "
        "job without faults, against which its goodput and final loss are set",
    )


SCENARIOS += (soak(),)
