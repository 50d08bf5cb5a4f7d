"""The worker side of benchmarks/torchft_diloco.py: torchft 0.2's lighthouse and one
DiLoCo replica group, each run inside a site's network namespace by the driver
(`torchft_diloco.py --worker ...`). Only these import torchft, from --torchft-path."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta

DEFAULT_TORCHFT_PATH = "/opt/torchft-site"
SITE_PORT = 29500  # each site's one-rank torch.distributed world (loopback)
STORE_PORT = 29510  # torchft: each replica group's TCPStore (its namespace address)
MANAGER_PORT = 29511  # torchft: each replica group's ManagerServer
LIGHTHOUSE_PORT = 29520  # torchft: the lighthouse, in site 0's namespace
COORDINATOR_PORT = 7070  # isthmus: each site's coordinator (its namespace address)


def die_with_parent() -> None:
    """SIGKILL this worker when the benchmark dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def job_overrides(args: argparse.Namespace) -> list[str]:
    """The `--set` overrides both sides build their job config from."""
    return [
        "sync.mode=diloco",
        f"sync.inner_steps={args.inner_steps}",
        f"sync.outer_lr={args.outer_lr}",
        f"sync.outer_momentum={args.outer_momentum}",
        f"sync.codec={args.codec}",
        f"model.preset={args.preset}",
        f"train.batch_size={args.batch_size}",
        f"train.seq_len={args.seq_len}",
        f"job.seed={args.seed}",
        f"wan.distance_km={args.distance_km}",
        f"wan.bandwidth_mbit={args.bandwidth_mbit}",
        "topology.device=cpu",
        "run.tensorboard=false",
        "run.digest_every=0",  # digests only after the last step (torchft: the same)
        "run.metrics_port=-1",
        *args.set,
    ]


# -- torchft workers (inside the namespaces) -------------------------------------------


def lighthouse_worker(args: argparse.Namespace) -> None:
    die_with_parent()
    sys.path.append(args.torchft_path)
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{LIGHTHOUSE_PORT}", min_replicas=2)
    print(json.dumps({"lighthouse": server.address()}), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()


def torchft_worker(args: argparse.Namespace) -> None:
    die_with_parent()
    site, addresses = args.site, args.addresses
    address = addresses[site]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(SITE_PORT),
        RANK="0",
        WORLD_SIZE="1",
        # gloo (the site's world and torchft's cross-replica group) binds and
        # announces this interface's address, not what the hostname resolves to.
        GLOO_SOCKET_IFNAME="isthmus0",
    )
    sys.path.append(args.torchft_path)  # after site-packages: the installed torch wins
    import torch
    import torch.distributed as dist
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from isthmus.deploy.config.job import load_config
    from isthmus.deploy.rank.program import build_trainer
    from isthmus.intra.corpus.batches import ShardedBatches
    from isthmus.intra.corpus.tokens import stdlib_corpus
    from isthmus.intra.layout import ParallelLayout
    from isthmus.intra.topology import build_site_mesh

    torch.set_num_threads(args.threads)
    config = load_config(
        overrides=job_overrides(args),
        flags={"job.steps": args.steps, "topology.sites": 2, "topology.ranks_per_site": 1},
    )
    timeout = timedelta(seconds=args.timeout_s)

    class NamespaceHTTPTransport(HTTPTransport):
        """torchft's checkpoint server advertises http://<gethostname()>:port; in a
        namespace the hostname resolves to an address the other site cannot reach,
        so advertise the namespace's own address instead (the server binds [::])."""

        def address(self) -> str:
            return f"http://{address}:{self._server.socket.getsockname()[1]}/checkpoint/"

    # The inner trainer `isthmus site` builds for diloco (deploy/rank/program.py).
    dist.init_process_group("gloo", timeout=timeout)
    layout = ParallelLayout.for_ranks(1, pp=1, tp=1)
    mesh = build_site_mesh(layout, "cpu")
    trainer = build_trainer(config, mesh, layout, 2, cuda=False)
    batches = ShardedBatches(
        stdlib_corpus(config.data.max_bytes),
        seq_len=config.train.seq_len,
        batch_size=config.train.batch_size,
        seed=config.job.seed,
        shard_index=site,
        num_shards=2,
    )

    def state_dict() -> dict:
        return {"model": trainer.model.state_dict(), "inner_optim": trainer.optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        trainer.model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["inner_optim"])

    # torchft's replica group: its own TCPStore on the namespace address (the
    # lighthouse hands the primary's to the other group to rendezvous the gloo group).
    store = dist.TCPStore(address, STORE_PORT, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=2,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=address,
        store_port=STORE_PORT,
        lighthouse_addr=f"http://{addresses[0]}:{LIGHTHOUSE_PORT}",
        replica_id=f"replica{site}",
        port=MANAGER_PORT,
        # What the lighthouse hands to the other group (torchft's default: the host
        # name, which resolves to loopback here, unreachable from the other namespace).
        hostname=socket.gethostname() if args.torchft_hostname else address,
        checkpoint_transport=(HTTPTransport if args.torchft_hostname else NamespaceHTTPTransport)(
            timeout=timeout, num_chunks=0
        ),
        init_sync=args.init_sync,
    )
    outer_optimizer = torch.optim.SGD(
        trainer.model.parameters(),
        lr=config.sync.outer_lr,
        momentum=config.sync.outer_momentum,
        nesterov=config.sync.outer_momentum > 0,
    )
    phases: dict[str, list[float]] = {"quorum_s": [], "prepare_s": [], "perform_s": []}

    def timed(fn, key: str):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phases[key].append(time.perf_counter() - t0)

        return wrapper

    records = []
    commits = []
    try:
        with DiLoCo(
            manager,
            [trainer.model],
            trainer.optimizer,
            outer_optimizer,
            sync_every=config.sync.inner_steps,
            backup_device=torch.device("cpu"),
            pin_memory=False,
            use_bucketization=args.torchft_bucketize,
        ) as diloco:
            # Time the phases of each outer step (private attributes of torchft 0.2).
            manager.start_quorum = timed(manager.start_quorum, "quorum_s")
            fragment = diloco._fragments[0]
            fragment.prepare_sync = timed(fragment.prepare_sync, "prepare_s")
            perform = fragment.perform_sync

            def perform_sync() -> bool:
                t0 = time.perf_counter()
                ok = perform()
                phases["perform_s"].append(time.perf_counter() - t0)
                commits.append(bool(ok))
                return ok

            fragment.perform_sync = perform_sync
            started = time.perf_counter()
            for step in range(config.job.steps):
                t0 = time.perf_counter()
                stats = trainer.step(step, *batches.batch(step))  # the sync runs in its hook
                now = time.perf_counter()
                records.append(
                    {
                        "step": step,
                        "loss": stats.loss,
                        "step_s": now - t0,
                        "elapsed_s": now - started,
                    }
                )
        digest = trainer.parameter_digest()
        result = {
            "site": site,
            "records": records,
            "phases": phases,
            "commits": commits,
            "manager_step": manager.current_step(),
            "errored": str(manager.errored()) if manager.errored() else None,
            "digest": digest,
            "threads": args.threads,
        }
        print(json.dumps(result), flush=True)
    finally:
        manager.shutdown(wait=False)
        dist.destroy_process_group()
        del store
