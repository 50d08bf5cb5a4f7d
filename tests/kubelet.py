"""A kubelet for tests: the pods of rendered Kubernetes manifests run as processes on this
machine, as a cluster would run them (tests/deploy/test_k8s_pods.py).

No cluster can be installed here. What a kubelet gives a container is taken from the
manifests themselves, and a field this module does not know how to honour fails the
test (:class:`ManifestError`) instead of being left out:

- the pods of a StatefulSet, NAME-0 .. NAME-(replicas-1), with the template's labels and
  the two its controller adds (``statefulset.kubernetes.io/pod-name``,
  ``apps.kubernetes.io/pod-index``);
- a network namespace per pod (`isthmus.sim.netns`: a site's first node, then its further
  nodes), whose address is the pod's IP;
- the container's command and arguments after Kubernetes' ``$(VAR)`` expansion, and its
  ``env`` (values, and downward-API ``fieldRef``s filled in from the pod) over the
  image's environment (this process's); service links are not emulated, so a pod spec
  must turn them off;
- its volumes at their mount paths, in a mount namespace of the pod's own: a ConfigMap's
  or Secret's keys as files in the kubelet's atomic-writer layout (each key a link to
  ``..data/KEY``, the files of mode ``defaultMode``, read-only), an emptyDir (tmpfs for
  ``medium: Memory``), and a folder per pod for each volumeClaimTemplate;
- /etc/hosts as the kubelet writes it (the pod's own name at its IP), plus what cluster
  DNS would answer: the site's pods under its headless Service, and every site's other
  Services at the pods they select. A ClusterIP Service forwards its port to those pods;
  here the name leads to the pod's IP, so a Service's port must equal its targetPort;
- its own host name (a UTS namespace).

A mount path whose parent is missing on this machine (/etc/isthmus/...) is made inside an
overlay of its nearest existing ancestor (/etc), in the pod's mount namespace: nothing is
written outside the test's folder. ``ip netns exec`` gives each pod that mount namespace
and keeps its mounts from reaching the machine's.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from isthmus.sim.netns import SiteNet

NAMESPACE = "default"
"""The Kubernetes namespace the objects are applied in (the manifests name none)."""
INDEX_LABEL = "apps.kubernetes.io/pod-index"
NAME_LABEL = "statefulset.kubernetes.io/pod-name"
DEFAULT_MODE = 0o644
"""A ConfigMap's or Secret's files without ``defaultMode`` (the Kubernetes API's default)."""
_DATA_DIR = "..2026_12_07_00_00_00.000000000"  # the atomic writer's timestamped folder
_EXPANSION = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ManifestError(AssertionError):
    """A manifest asks for what this kubelet does not do, or Kubernetes would refuse."""


def objects(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d and d["kind"] == kind]


def only(docs: list[dict], kind: str, name: str | None = None) -> dict:
    """The one object of ``kind`` (called ``name``, if given)."""
    found = [d for d in objects(docs, kind) if name is None or d["metadata"]["name"] == name]
    if len(found) != 1:
        raise ManifestError(f"{len(found)} {kind} objects named {name or 'anything'}, want one")
    return found[0]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of command, args and env values: ``$(VAR)`` is VAR's value
    where the container's env defines VAR and stays as written where it does not; ``$$``
    is one ``$`` (k8s.io/kubernetes third_party/forked/golang/expansion)."""

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _EXPANSION.sub(one, text)


def selects(service: dict, pod: Pod) -> bool:
    selector = service["spec"].get("selector") or {}
    return bool(selector) and all(pod.labels.get(k) == v for k, v in selector.items())


@dataclass(frozen=True, eq=False)
class Pod:
    site: str
    name: str
    index: int
    ip: str
    """status.podIP: the address of the pod's network namespace."""
    netns: str
    labels: dict[str, str]
    spec: dict
    """The StatefulSet's pod template spec."""
    claims: tuple[str, ...]
    """The StatefulSet's volumeClaimTemplates' names."""
    folder: Path
    """Where this kubelet keeps the pod's volumes, /etc/hosts and overlays."""

    @property
    def container(self) -> dict:
        containers = self.spec["containers"]
        if len(containers) != 1 or self.spec.get("initContainers"):
            raise ManifestError(f"{self.name}: one container, no init containers, please")
        return containers[0]


@dataclass(frozen=True)
class Mount:
    path: str
    source: Path | None
    """The folder bound there; None for a tmpfs."""
    read_only: bool


@dataclass
class Kubelet:
    """The pods of each site's manifests on the namespaces of ``nets``.

    Args:
        manifests: site name -> that site's rendered objects.
        nets: the sites' namespaces (`TransparentWan(..., nodes=[...]).sites`): node k of
            a site is its StatefulSet's pod k.
        folder: where the pods' files go.
    """

    manifests: dict[str, list[dict]]
    nets: list[SiteNet]
    folder: Path
    pods: dict[str, list[Pod]] = field(init=False, default_factory=dict)
    mounts_written: dict[str, list[Mount]] = field(init=False, default_factory=dict)
    """Pod name -> its mounts, once started."""

    def __post_init__(self) -> None:
        for net in self.nets:
            statefulset = only(self.manifests[net.site], "StatefulSet")
            spec, name = statefulset["spec"], statefulset["metadata"]["name"]
            labels = spec["template"]["metadata"]["labels"]
            match = spec["selector"]["matchLabels"]
            if any(labels.get(k) != v for k, v in match.items()):
                raise ManifestError(f"{name}: the selector does not select its own pods")
            hosts = [(net.namespace, net.address), *((n.namespace, n.address) for n in net.nodes)]
            if spec["replicas"] != len(hosts):
                raise ManifestError(f"{name}: {spec['replicas']} replicas on {len(hosts)} nodes")
            claims = tuple(c["metadata"]["name"] for c in spec.get("volumeClaimTemplates", []))
            self.pods[net.site] = [
                Pod(
                    site=net.site,
                    name=f"{name}-{i}",
                    index=i,
                    ip=ip,
                    netns=netns,
                    labels={**labels, NAME_LABEL: f"{name}-{i}", INDEX_LABEL: str(i)},
                    spec=spec["template"]["spec"],
                    claims=claims,
                    folder=self.folder / f"{name}-{i}",
                )
                for i, (netns, ip) in enumerate(hosts)
            ]

    # -- what the pod sees ------------------------------------------------------------

    def names(self, site: str) -> dict[str, str]:
        """Name -> address, as a pod of ``site`` looks them up: its site's pods under the
        headless Service its StatefulSet names, and every site's other Services."""
        docs = self.manifests[site]
        statefulset = only(docs, "StatefulSet")
        headless = only(docs, "Service", statefulset["spec"]["serviceName"])
        if headless["spec"].get("clusterIP") != "None":
            raise ManifestError("the StatefulSet's serviceName must name a headless Service")
        subdomain = headless["metadata"]["name"]
        names = {f"{p.name}.{subdomain}": p.ip for p in self.pods[site] if selects(headless, p)}
        for other, other_docs in self.manifests.items():
            for service in objects(other_docs, "Service"):
                if service["spec"].get("clusterIP") == "None":
                    continue  # a headless Service's names are its own cluster's
                chosen = [p.ip for p in self.pods[other] if selects(service, p)]
                if len(chosen) != 1:
                    raise ManifestError(
                        f"Service {service['metadata']['name']} selects {len(chosen)} pods: "
                        "this kubelet names one pod's IP for a Service"
                    )
                for port in service["spec"]["ports"]:
                    if port.get("targetPort", port["port"]) != port["port"]:
                        raise ManifestError(f"{service['metadata']['name']}: port != targetPort")
                names[service["metadata"]["name"]] = chosen[0]
        return names

    def hosts(self, pod: Pod) -> str:
        subdomain = only(self.manifests[pod.site], "StatefulSet")["spec"]["serviceName"]
        fqdn = f"{pod.name}.{subdomain}.{NAMESPACE}.svc.cluster.local"
        lines = [
            "# Kubernetes-managed hosts file.",
            "127.0.0.1\tlocalhost",
            f"{pod.ip}\t{fqdn}\t{pod.name}",
            "# What cluster DNS answers this pod (tests/kubelet.py).",
            *(f"{ip}\t{name}" for name, ip in self.names(pod.site).items()),
        ]
        return "\n".join(lines) + "\n"

    def environment(self, pod: Pod) -> dict[str, str]:
        """The container's ``env``, as the kubelet resolves it (in order, each value
        expanded against those before it)."""
        if pod.spec.get("enableServiceLinks", True):
            raise ManifestError(f"{pod.name}: service links are on; this kubelet sets none")
        container = pod.container
        if container.get("envFrom"):
            raise ManifestError(f"{pod.name}: envFrom is not emulated")
        env: dict[str, str] = {}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = expand(var["value"], env)
            elif "fieldRef" in var.get("valueFrom", {}):
                env[var["name"]] = self._field(pod, var["valueFrom"]["fieldRef"]["fieldPath"])
            else:
                raise ManifestError(f"{pod.name}: env {var['name']} is not emulated")
        return env

    @staticmethod
    def _field(pod: Pod, path: str) -> str:
        """A downward-API field of the pod (a label it lacks is "", as Kubernetes gives)."""
        label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
        if label:
            return pod.labels.get(label.group(1), "")
        fields = {
            "metadata.name": pod.name,
            "metadata.namespace": NAMESPACE,
            "status.podIP": pod.ip,
        }
        if path not in fields:
            raise ManifestError(f"{pod.name}: fieldRef {path} is not emulated")
        return fields[path]

    def argv(self, pod: Pod) -> list[str]:
        """The container's command and args, expanded."""
        container, env = pod.container, self.environment(pod)
        if not container.get("command"):
            raise ManifestError(f"{pod.name}: no command (the image's entrypoint is not emulated)")
        return [expand(a, env) for a in (*container["command"], *container.get("args", []))]

    def mounts(self, pod: Pod) -> list[Mount]:
        """The container's volumeMounts, their volumes written under the pod's folder."""
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        out = []
        for mount in pod.container.get("volumeMounts", []):
            if mount.get("subPath") or mount.get("subPathExpr"):
                raise ManifestError(f"{pod.name}: subPath is not emulated")
            name, read_only = mount["name"], bool(mount.get("readOnly"))
            where = pod.folder / "volumes" / name
            volume = volumes.get(name, {})
            if name in pod.claims and name not in volumes:
                where.mkdir(parents=True)  # the pod's own claim: state kept per pod
                source: Path | None = where
            elif "configMap" in volume or "secret" in volume:
                self._project(pod, volume, where)
                source, read_only = where, True  # the kubelet mounts both read-only
            elif "emptyDir" in volume:
                memory = volume["emptyDir"].get("medium") == "Memory"
                source = None if memory else where
                if source is not None:
                    source.mkdir(parents=True)
            else:
                raise ManifestError(f"{pod.name}: volume {name} is of no kind emulated here")
            out.append(Mount(mount["mountPath"], source, read_only))
        return out

    def _project(self, pod: Pod, volume: dict, where: Path) -> None:
        """A ConfigMap's or Secret's keys as files, in the atomic writer's layout."""
        if "configMap" in volume:
            ref, kind, name = volume["configMap"], "ConfigMap", volume["configMap"]["name"]
        else:
            ref, kind, name = volume["secret"], "Secret", volume["secret"]["secretName"]
        if ref.get("items"):
            raise ManifestError(f"{pod.name}: items of {kind} {name} are not emulated")
        source = only(self.manifests[pod.site], kind, name)
        if kind == "ConfigMap":  # data is text, binaryData base64
            files = {k: v.encode() for k, v in (source.get("data") or {}).items()}
            files |= {k: base64.b64decode(v) for k, v in (source.get("binaryData") or {}).items()}
        else:  # data is base64, stringData text (and wins, as the API server merges them)
            files = {k: base64.b64decode(v) for k, v in (source.get("data") or {}).items()}
            files |= {k: v.encode() for k, v in (source.get("stringData") or {}).items()}
        data = where / _DATA_DIR
        data.mkdir(parents=True)
        for key, content in files.items():
            (data / key).write_bytes(content)
            (data / key).chmod(ref.get("defaultMode", DEFAULT_MODE))
            (where / key).symlink_to(f"..data/{key}")
        (where / "..data").symlink_to(_DATA_DIR)

    def on_host(self, pod: Pod, path: str) -> Path:
        """Where a path inside the pod lies on this machine (in one of its volumes)."""
        inside = PurePosixPath(path)
        for mount in self.mounts_written[pod.name]:
            root = PurePosixPath(mount.path)
            if mount.source is not None and (inside == root or root in inside.parents):
                return mount.source / inside.relative_to(root)
        raise ManifestError(f"{pod.name}: {path} is in none of its volumes")

    # -- running it -------------------------------------------------------------------

    def start(self, pod: Pod, log: Path, wrap: tuple[str, ...] = ()) -> subprocess.Popen:
        """Start the pod's container (its process group of its own); ``wrap`` runs
        before its command, in the same pod (a dry run of it)."""
        pod.folder.mkdir(parents=True)
        mounts = self.mounts_written[pod.name] = self.mounts(pod)
        hosts = pod.folder / "hosts"
        hosts.write_text(self.hosts(pod))
        script = self._sandbox(pod, mounts, hosts)
        env = {**os.environ, **self.environment(pod), "HOSTNAME": pod.name}
        argv = ["ip", "netns", "exec", pod.netns, "unshare", "--uts", "--", "sh", "-c", script]
        with open(log, "w") as out:
            return subprocess.Popen(
                [*argv, pod.name, *wrap, *self.argv(pod)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=pod.folder,
                start_new_session=True,
            )

    @staticmethod
    def _sandbox(pod: Pod, mounts: list[Mount], hosts: Path) -> str:
        """The shell that sets up the pod's host name and mounts, then execs "$@"."""
        q = shlex.quote
        lines = ["set -eu", f"hostname {q(pod.name)}"]
        bases: list[Path] = []
        for mount in mounts:
            path = Path(mount.path)
            if not path.exists():
                base = next(p for p in path.parents if p.exists())
                if base == Path("/"):
                    raise ManifestError(f"{pod.name}: {path}: only / is above it to lay over")
                if base not in bases:
                    bases.append(base)
        for i, base in enumerate(bases):
            upper, work = pod.folder / "layers" / f"{i}-upper", pod.folder / "layers" / f"{i}-work"
            upper.mkdir(parents=True)
            work.mkdir(parents=True)
            assert "," not in f"{base}{upper}{work}", "overlay options are comma-separated"
            options = f"lowerdir={base},upperdir={upper},workdir={work}"
            lines.append(f"mount -t overlay overlay -o {q(options)} {q(str(base))}")
        for mount in sorted(mounts, key=lambda m: len(Path(m.path).parts)):
            lines.append(f"mkdir -p {q(mount.path)}")
            if mount.source is None:
                lines.append(f"mount -t tmpfs tmpfs {q(mount.path)}")
            else:
                lines.append(f"mount --bind {q(str(mount.source))} {q(mount.path)}")
            if mount.read_only:
                lines.append(f"mount -o remount,bind,ro {q(mount.path)}")
        lines += [f"mount --bind {q(str(hosts))} /etc/hosts", 'exec "$@"']
        return "\n".join(lines)
