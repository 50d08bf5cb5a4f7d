"""The layers' import rules (docs/design.md, "Layout"), read from the source with ast.

intra, sim and proto import nothing of ours but themselves; inter imports only proto
and inter; inter/control never imports inter/data (a coordinator moves no tensors);
deploy, the composition root, may import everything, but the data plane only through
the names inter/data/__init__.py exports. Every import counts: at module
level, inside a function, under TYPE_CHECKING, relative ones, and the names handed to
importlib.import_module. A docstring that mentions a module is no import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from helpers import ROOT
from sources import PACKAGES, package_modules, write_tree

# (the importing package, what of ours it may import, what it must not even so); a
# module obeys every rule whose package holds it (inter/control: both inter's and its own).
RULES = (
    ("isthmus.proto", ("isthmus.proto",), ()),
    ("isthmus.intra", ("isthmus.intra",), ()),
    ("isthmus.sim", ("isthmus.sim",), ()),
    ("isthmus.inter", ("isthmus.proto", "isthmus.inter"), ()),
    ("isthmus.inter.control", ("isthmus.proto", "isthmus.inter"), ("isthmus.inter.data",)),
    # The data plane reaches the control plane only as a rank talks to its coordinator
    # (the typed client, the rank's key) and through the shared gRPC channel options.
    (
        "isthmus.inter.data",
        (
            "isthmus.proto",
            "isthmus.inter.data",
            *(
                f"isthmus.inter.{shared}"
                for shared in ("security", "closable", "bounds", "malformed", "metrics", "tcp_info")
            ),
            *(
                f"isthmus.inter.control.{m}"
                for m in ("coordinator_client", "rank_keys", "channels")
            ),
        ),
        (),
    ),
    ("isthmus.deploy", ("isthmus",), ()),
)

# deploy reaches the data plane through its front door only: the names
# inter/data/__init__.py exports (read from its __all__), and the modules run as programs.
DATA_PLANE = "isthmus.inter.data"
DATA_PLANE_PROGRAMS = ("bench",)

# The coordinator hands its helpers (failover, peer loop, admission, witness) what they
# use: the settings, the peers' stubs, the state. None reaches back for the coordinator,
# not even under TYPE_CHECKING: that cycle made it a service locator (issue 37 item 2).
COORDINATOR = "isthmus.inter.control.coordinator"


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _resolve(name: str, level: int, module: str, is_package: bool) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    if not level:
        return name
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _import_module_target(call: ast.Call) -> str | None:
    """The module an ``import_module(...)`` or ``__import__(...)`` call names, as far as
    its first argument tells: a constant, or an f-string's constant head up to its last
    dot, the package the module lands in (f"isthmus.deploy.{name}_cmd": isthmus.deploy)."""
    func = call.func
    called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if called not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value)
        return head[: head.rindex(".") + 1] if "." in head else None
    return None


def imports(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str, str]]:
    """Every (line, imported module, statement) in ``source``, wherever it stands."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, module, is_package)
            # `from isthmus.inter import data` imports isthmus.inter.data.
            names = [base if a.name == "*" else f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and (target := _import_module_target(node)) is not None:
            name = target.lstrip(".")
            names = [_resolve(name.rstrip("."), len(target) - len(name), module, is_package)]
        else:
            continue
        statement = " ".join((ast.get_source_segment(source, node) or "").split())
        for name in names:
            yield node.lineno, name, statement


def data_plane_exports(root: Path) -> set[str]:
    """The names inter/data/__init__.py lists in ``__all__`` (empty without one)."""
    init = root / "inter" / "data" / "__init__.py"
    for node in ast.parse(init.read_text()).body if init.exists() else ():
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


def _broken_rule(module: str, name: str, exports: set[str]) -> str | None:
    """Why ``module`` may not import ``name``, or None if it may."""
    inside = name.removeprefix(DATA_PLANE + ".") if name.startswith(DATA_PLANE + ".") else None
    if _under(module, "isthmus.deploy") and inside not in (None, *exports, *DATA_PLANE_PROGRAMS):
        return f"deploy may import from {DATA_PLANE} only what its __init__ exports"
    if _under(name, COORDINATOR) and _under(module, "isthmus.inter.control") and name != module:
        return f"only {COORDINATOR} itself imports it: hand a helper what it uses"
    for package, allowed, forbidden in RULES:
        if not _under(module, package):
            continue
        if not any(_under(name, a) for a in allowed):
            return f"{package} may import only {', '.join(allowed)} of ours"
        if any(_under(name, f) for f in forbidden):
            return f"{package} must not import {', '.join(forbidden)}"
    return None


def violations(root: Path) -> list[str]:
    """One line per import that breaks a rule: file, line, the statement, and the rule."""
    found, exports = set(), data_plane_exports(root)
    for path, module, is_package in package_modules(root):
        for line, name, statement in imports(path.read_text(), module, is_package):
            if _under(name, "isthmus") and (why := _broken_rule(module, name, exports)):
                found.add((str(path.relative_to(root)), line, f"{statement}  ({why})"))
    return [f"{path}:{line}: {text}" for path, line, text in sorted(found)]


def test_every_layer_imports_only_what_the_layout_allows() -> None:
    scanned = {module.split(".")[1] for _, module, _ in package_modules(ROOT)}
    assert scanned == set(PACKAGES), scanned  # a moved folder must not pass by vanishing
    found = violations(ROOT)
    assert not found, "imports against docs/design.md's Layout:\n" + "\n".join(found)


def test_the_check_sees_imports_wherever_they_stand(tmp_path: Path) -> None:
    # A tree with one of each kind of import the check must catch, and one of each it
    # must let pass, so that the check above cannot pass by seeing nothing.
    files = {
        "proto/__init__.py": "",
        "intra/__init__.py": "from . import model\n",
        "intra/model.py": '"""Uses isthmus.inter.data for nothing."""\nimport torch\n',
        "sim/__init__.py": "def f():\n    import isthmus.deploy.cli\n",
        "inter/__init__.py": "",
        "inter/security.py": "from isthmus.proto import lane_pb2\nfrom isthmus.intra import train\n",
        "inter/data/__init__.py": '__all__ = ["open_rank_sync"]\n',
        "inter/data/lane/server.py": "from isthmus.inter.control import coordinator_client\n",
        "inter/data/round/pipeline.py": "from isthmus.inter.control.failover import Failover\n",
        "inter/control/__init__.py": "",
        "inter/control/coordinator.py": (
            "from typing import TYPE_CHECKING\n"
            "from ..security import SiteSecurity\n"
            "if TYPE_CHECKING:\n"
            "    from ..data.lane import LaneServer\n"
            "def f():\n"
            "    from isthmus.inter import data\n"
            "    import importlib\n"
            "    return importlib.import_module(f'isthmus.inter.data.{name}')\n"
        ),
        "inter/control/failover.py": (
            "from isthmus.inter.control import coordinator_client\n"
            "if TYPE_CHECKING:\n"
            "    from .coordinator import Coordinator\n"
        ),
        "inter/control/lane_pb2.py": "from isthmus.deploy import cli\n",  # generated: skipped
        "deploy/__init__.py": "from isthmus.inter.data.lane.server import LaneServer\n",
        "deploy/rank/program.py": (
            "from isthmus.inter.data import bench, open_rank_sync\n"
            "from isthmus.inter.data import lane\n"
            "import isthmus.inter.data\n"
        ),
    }
    write_tree(tmp_path, files)
    found = violations(tmp_path)
    where = [line.split("  (")[0] for line in found]
    assert where == [
        "deploy/__init__.py:1: from isthmus.inter.data.lane.server import LaneServer",
        "deploy/rank/program.py:2: from isthmus.inter.data import lane",
        "inter/control/coordinator.py:4: from ..data.lane import LaneServer",
        "inter/control/coordinator.py:6: from isthmus.inter import data",
        "inter/control/coordinator.py:8: importlib.import_module(f'isthmus.inter.data.{name}')",
        "inter/control/failover.py:3: from .coordinator import Coordinator",
        "inter/data/round/pipeline.py:1: from isthmus.inter.control.failover import Failover",
        "inter/security.py:2: from isthmus.intra import train",
        "sim/__init__.py:2: import isthmus.deploy.cli",
    ], "\n".join(found)
    assert found[0].endswith(
        "(deploy may import from isthmus.inter.data only what its __init__ exports)"
    )
    assert found[2].endswith("(isthmus.inter.control must not import isthmus.inter.data)")
    assert found[5].endswith(f"(only {COORDINATOR} itself imports it: hand a helper what it uses)")
    assert found[-1].endswith("(isthmus.sim may import only isthmus.sim of ours)")


# deploy's parts: its sub-packages (commands, config, launch, rank, ...) and its top-level
# modules (cli, api). Each imports the parts below it only, so a part reads on its own and
# the folder shows the architecture: config and security at the bottom, the rank's life
# and the launchers above them, the commands and the CLI on top. The CLI dispatches to
# the commands through importlib and no command imports it (issue 37: cli.py was both
# dispatcher and the commands' helper library, a cycle through importlib).
DEPLOY = "isthmus.deploy"
CLI = "isthmus.deploy.cli"


def _part(module: str) -> str | None:
    """The part of deploy ``module`` belongs to (``isthmus.deploy.rank``), else None."""
    if not _under(module, DEPLOY) or module == DEPLOY:
        return None
    return ".".join(module.split(".")[:3])


def deploy_parts(root: Path) -> dict[str, dict[str, str]]:
    """Each deploy part's imports of the other parts: {part: {imported part: where}}."""
    graph: dict[str, dict[str, str]] = {}
    for path, module, is_package in package_modules(root):
        if (part := _part(module)) is None:
            continue
        graph.setdefault(part, {})
        for line, name, statement in imports(path.read_text(), module, is_package):
            if (other := _part(name)) is not None and other != part:
                where = f"{path.relative_to(root)}:{line}: {statement}"
                graph[part].setdefault(other, where)
    return graph


def deploy_cycles(root: Path) -> list[str]:
    """One line per cycle between deploy's parts (and per import of the CLI), naming the
    import that closes it."""
    graph = deploy_parts(root)
    found = [
        f"{where}  (only the console script and tests import {CLI})"
        for part, edges in graph.items()
        for other, where in edges.items()
        if other == CLI
    ]
    for part, edges in sorted(graph.items()):
        for other, where in sorted(edges.items()):
            if other != CLI and part in _reachable(graph, other):
                found.append(f"{where}  ({part} -> {other} -> ... -> {part})")
    return found


def _reachable(graph: dict[str, dict[str, str]], start: str) -> set[str]:
    """The nodes ``start`` reaches through one import or more (itself if on a cycle)."""
    seen: set[str] = set()
    todo = list(graph.get(start, {}))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, {}))
    return seen


def test_deploy_parts_import_downwards_only() -> None:
    parts = deploy_parts(ROOT)
    # The sub-packages the design names; a new one is a design decision, not an accident.
    assert set(parts) == {
        f"{DEPLOY}.{p}"
        for p in (
            "api",
            "batch",
            "chaos",
            "cli",
            "commands",
            "config",
            "launch",
            "rank",
            "reports",
            "security",
        )  # fmt: skip
    }, sorted(parts)
    found = deploy_cycles(ROOT)
    assert not found, "cycles between deploy's parts:\n" + "\n".join(found)


def test_the_cycle_check_sees_a_cycle_and_an_import_of_the_cli(tmp_path: Path) -> None:
    files = {
        "deploy/__init__.py": "",
        "deploy/cli.py": "import importlib\nimportlib.import_module(f'isthmus.deploy.commands.{n}')\n",
        "deploy/commands/__init__.py": "",
        "deploy/commands/local.py": "from isthmus.deploy.cli import EXIT_USAGE\n",
        "deploy/config/__init__.py": "",
        "deploy/config/job.py": "def f():\n    from isthmus.deploy.security import trust\n",
        "deploy/security/__init__.py": "",
        "deploy/security/trust.py": "from ..config.job import JobConfig\n",
        "deploy/launch/__init__.py": "",
        "deploy/launch/local.py": "from isthmus.deploy.config.job import JobConfig\n",
    }
    write_tree(tmp_path, files)
    found = deploy_cycles(tmp_path)
    assert [line.split("  (")[0] for line in found] == [
        "deploy/commands/local.py:1: from isthmus.deploy.cli import EXIT_USAGE",
        "deploy/cli.py:2: importlib.import_module(f'isthmus.deploy.commands.{n}')",
        "deploy/config/job.py:2: from isthmus.deploy.security import trust",
        "deploy/security/trust.py:1: from ..config.job import JobConfig",
    ], "\n".join(found)


# No module reaches itself back through its imports, inside any package of ours, not even
# under TYPE_CHECKING: a cycle makes a helper a part of what it serves (issue 64: the
# lane's server and the helpers it handed itself to). The cycles below predate the rule;
# each is to be cut, and its entry then removed: the list only shrinks.
KNOWN_CYCLES = {
    # The emulated link: its pump moves its streams' bytes and the link's directions,
    # and each of those holds the pump (sim, not the data plane).
    frozenset({"isthmus.sim.link", "isthmus.sim.pump", "isthmus.sim.stream"}),
    # The emulator's control server drives the relays, which report back to it.
    frozenset({"isthmus.sim.control", "isthmus.sim.relay"}),
}


def module_graph(root: Path) -> dict[str, dict[str, str]]:
    """Each module's imports of our modules: {module: {imported module: where}}. A name
    that is no module (``from isthmus.inter.data import crc32``) is its package's."""
    found = {module: (path, is_package) for path, module, is_package in package_modules(root)}
    graph: dict[str, dict[str, str]] = {}
    for module, (path, is_package) in found.items():
        edges = graph.setdefault(module, {})
        for line, name, statement in imports(path.read_text(), module, is_package):
            while name and name not in found:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.setdefault(name, f"{path.relative_to(root)}:{line}: {statement}")
    return graph


def module_cycles(root: Path) -> dict[frozenset[str], list[str]]:
    """Each set of modules that import one another round in a circle, with the imports
    between them."""
    graph = module_graph(root)
    reach = {module: _reachable(graph, module) for module in graph}
    cycles = {frozenset(m for m in reach[v] if v in reach[m]) for v in graph if v in reach[v]}
    return {
        cycle: sorted(where for m in cycle for other, where in graph[m].items() if other in cycle)
        for cycle in cycles
    }


def test_no_package_has_an_import_cycle() -> None:
    found = module_cycles(ROOT)
    new = [
        f"{', '.join(sorted(cycle))}:\n  " + "\n  ".join(lines)
        for cycle, lines in sorted(found.items(), key=lambda item: sorted(item[0]))
        if cycle not in KNOWN_CYCLES
    ]
    assert not new, "import cycles (hand a helper what it uses instead):\n" + "\n".join(new)
    gone = [sorted(cycle) for cycle in KNOWN_CYCLES if cycle not in found]
    assert not gone, f"cut, or changed: update KNOWN_CYCLES (it only shrinks): {gone}"


def test_the_cycle_check_sees_cycles_wherever_their_imports_stand(tmp_path: Path) -> None:
    files = {
        "proto/__init__.py": "",
        "intra/__init__.py": "",
        "sim/__init__.py": "",
        "deploy/__init__.py": "",
        "inter/__init__.py": "",
        "inter/data/__init__.py": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from isthmus.inter.data.sync.rank import RankSync\n",
        # server -> helper -> server, the helper's half under TYPE_CHECKING
        "inter/data/lane/__init__.py": '"""The lane: isthmus.inter.data.lane.server."""\n',
        "inter/data/lane/server.py": "from .helper import Helper\n",
        "inter/data/lane/helper.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from isthmus.inter.data.lane.server import LaneServer\n"
        ),
        # pipeline -> tasks -> pull -> pipeline, one inside a function
        "inter/data/round/__init__.py": "",
        "inter/data/round/pipeline.py": "from isthmus.inter.data.round import tasks\n",
        "inter/data/round/tasks.py": "from .pull import pull_intact\n",
        "inter/data/round/pull.py": "def f():\n    from .pipeline import RoundPipeline\n",
        # through the package's face: rank -> data's __init__ -> rank
        "inter/data/sync/__init__.py": "",
        "inter/data/sync/rank.py": "from isthmus.inter.data import crc32\n",
        # no cycle: a chain, an import of a package's face, a name of a module
        "sim/a.py": "from isthmus.sim import b\nimport isthmus.sim\n",
        "sim/b.py": "from isthmus.sim.c import C\nimport isthmus.proto.lane_pb2\n",
        "sim/c.py": "import importlib\nimportlib.import_module('isthmus.deploy')\n",
    }
    write_tree(tmp_path, files)
    found = module_cycles(tmp_path)
    assert found == {
        frozenset({"isthmus.inter.data.lane.server", "isthmus.inter.data.lane.helper"}): [
            "inter/data/lane/helper.py:3: from isthmus.inter.data.lane.server import LaneServer",
            "inter/data/lane/server.py:1: from .helper import Helper",
        ],
        frozenset({f"isthmus.inter.data.round.{m}" for m in ("pipeline", "tasks", "pull")}): [
            "inter/data/round/pipeline.py:1: from isthmus.inter.data.round import tasks",
            "inter/data/round/pull.py:2: from .pipeline import RoundPipeline",
            "inter/data/round/tasks.py:1: from .pull import pull_intact",
        ],
        frozenset({"isthmus.inter.data", "isthmus.inter.data.sync.rank"}): [
            "inter/data/__init__.py:3: from isthmus.inter.data.sync.rank import RankSync",
            "inter/data/sync/rank.py:1: from isthmus.inter.data import crc32",
        ],
    }, found
