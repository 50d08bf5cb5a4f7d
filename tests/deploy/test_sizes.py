"""The house stops growing (issue 64): the package's size, its modules' and functions'
sizes, and the code written twice, each held to a ceiling that only comes down."""

from __future__ import annotations

import ast
import itertools
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from helpers import ROOT
from sources import package_modules, write_tree

# No module over 450 lines and a new one at most 400, no function or method over 80. The
# modules and functions below were larger when the rule came; each is to be cut, and its
# entry then removed: the lists only shrink.
MODULE_LINES, NEW_MODULE_LINES, FUNCTION_LINES = 450, 400, 80
KNOWN_LARGE_MODULES = {
    "deploy/api.py",
    "inter/control/agent_socket.py",
    "inter/control/coordinator.py",
    "inter/control/failover.py",
    "inter/data/bench.py",
    "inter/data/transport/bulk.py",
    "inter/data/transport/bulk_peer.py",
}
KNOWN_LONG_FUNCTIONS: set[str] = set()  # every function is within 80 lines now


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """Each function and method, by its qualified name, with its length in lines."""
    for node in ast.iter_child_nodes(tree):
        name = f"{prefix}{getattr(node, 'name', '')}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield name, node.end_lineno - node.lineno + 1  # type: ignore[operator]
        yield from _functions(node, f"{name}." if isinstance(node, ast.ClassDef) else prefix)


def size_breaches(root: Path, large: set[str], long: set[str]) -> list[str]:
    """One line per module or function over its size that its list does not name, and per
    entry of a list that no longer needs to be there."""
    found, seen = [], set()
    for path, _, _ in package_modules(root):
        where, source = str(path.relative_to(root)), path.read_text()
        lines = len(source.splitlines())
        limit = MODULE_LINES if where in large else NEW_MODULE_LINES
        if where in large and lines > NEW_MODULE_LINES:
            seen.add(where)
        if lines > limit:
            found.append(f"{where}: {lines} lines (at most {limit})")
        for function, length in _functions(ast.parse(source)):
            if f"{where}:{function}" in long and length > FUNCTION_LINES:
                seen.add(f"{where}:{function}")
            elif length > FUNCTION_LINES:
                found.append(f"{where}:{function}: {length} lines (at most {FUNCTION_LINES})")
    found += [f"{entry}: within its limit now, or gone" for entry in sorted((large | long) - seen)]
    return found


def test_no_module_or_function_is_over_its_size() -> None:
    found = size_breaches(ROOT, KNOWN_LARGE_MODULES, KNOWN_LONG_FUNCTIONS)
    assert not found, "split it, or remove the entry (the lists only shrink):\n" + "\n".join(found)


def test_the_size_check_sees_long_modules_and_functions_and_stale_entries(
    tmp_path: Path,
) -> None:
    long_body = "def f():\n" + "    x = 1\n" * 80  # 81 lines
    method = "class C:\n    def g(self):\n" + "        x = 1\n" * 80
    files = {
        "proto/__init__.py": "",
        "intra/new.py": "x = 1\n" * 401,
        "intra/old.py": "x = 1\n" * 420,
        "intra/shrunk.py": "x = 1\n" * 400,
        "inter/big.py": "x = 1\n" * 451,
        "inter/lane_pb2.py": "x = 1\n" * 900,  # generated: skipped
        "sim/f.py": long_body,
        "sim/known.py": long_body + method,
        "deploy/short.py": "def f():\n    pass\n",
    }
    write_tree(tmp_path, files)
    found = size_breaches(
        tmp_path,
        {"intra/old.py", "intra/shrunk.py", "inter/big.py"},
        {"sim/known.py:f", "deploy/short.py:f"},
    )
    assert sorted(found) == [
        "deploy/short.py:f: within its limit now, or gone",
        "inter/big.py: 451 lines (at most 450)",
        "intra/new.py: 401 lines (at most 400)",
        "intra/shrunk.py: within its limit now, or gone",
        "sim/f.py:f: 81 lines (at most 80)",
        "sim/known.py:C.g: 81 lines (at most 80)",
    ], found


# The package's lines (every module of the five packages, generated code excepted), and a
# ceiling: issue 64's base, which only comes down (lower it when the house shrinks), plus one
# named allowance per feature added since, each its exact growth, so that what a feature
# costs is on record and nothing else may grow in its shadow.
PACKAGE_LINES_BASE = 37_141  # 37,140 lines at 4c4d548
GROWTH = {
    "issue 61: TCP_INFO read from a socket (inter/tcp_info.py)": 89,
    "issue 61: link traces replayed by the emulator (sim/trace.py)": 232,
    "issue 62: a dead site found from its own heartbeats' arrivals (arrivals.py)": 146,
    "issue 62: goodput and the time lost by cause (deploy/reports/goodput.py)": 157,
    "issue 62: the soak scenario against a fault-free run (isthmus chaos --only soak)": 81,
    "issue 61: egress by link, priced, against a budget (deploy/reports/egress.py)": 122,
    "issue 61: isthmus probe": 752,
    "issue 61: links watched live (TCP_INFO per peer, per step)": 380,
}
PACKAGE_LINES_CEILING = PACKAGE_LINES_BASE + sum(GROWTH.values())


def test_the_package_is_no_larger_than_its_ceiling() -> None:
    total = sum(len(path.read_text().splitlines()) for path, _, _ in package_modules(ROOT))
    assert total < PACKAGE_LINES_CEILING, (
        f"the package has {total} lines, the ceiling is {PACKAGE_LINES_CEILING}: "
        "delete, merge or cut prose before adding"
    )


# Code written twice: runs of RUN identical lines (blank lines, comments and imports
# aside) in two places of the tracked Python files, tests and benchmarks included. A run
# found in more than MOST_PLACES places is an idiom, not a copy. The ceiling only comes
# down.
RUN, MOST_PLACES, REPEATED_RUNS_CEILING = 6, 8, 5


def repeated_runs(sources: dict[str, str]) -> list[str]:
    """'a.py:L ~ b.py:M (N lines)' for each pair of places sharing RUN or more identical
    lines, overlapping windows of one pair merged into one entry."""
    windows: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    numbers: dict[str, list[int]] = {}
    for name, text in sources.items():
        kept = [
            (number, line.strip())
            for number, line in enumerate(text.splitlines(), 1)
            if line.strip() and not line.strip().startswith(("#", "import ", "from "))
        ]
        numbers[name] = [number for number, _ in kept]
        for k in range(len(kept) - RUN + 1):
            windows[tuple(line for _, line in kept[k : k + RUN])].append((name, k))
    starts: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    for places in windows.values():
        if not 2 <= len(places) <= MOST_PLACES:
            continue
        for (a, ka), (b, kb) in itertools.combinations(sorted(places), 2):
            if a != b or abs(ka - kb) >= RUN:  # a run overlapping itself is no copy
                starts[(a, b, ka - kb)].append(ka)
    found = []
    for (a, b, shift), ks in sorted(starts.items()):
        for _, group in itertools.groupby(enumerate(sorted(ks)), lambda t: t[1] - t[0]):
            first = [k for _, k in group]
            found.append(
                f"{a}:{numbers[a][first[0]]} ~ {b}:{numbers[b][first[0] - shift]} "
                f"({len(first) + RUN - 1} lines)"
            )
    return found


def test_code_written_twice_stays_under_its_ceiling() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    sources = {name: (ROOT / name).read_text() for name in tracked if "_pb2" not in name}
    found = repeated_runs(sources)
    assert len(found) <= REPEATED_RUNS_CEILING, (
        f"{len(found)} pairs of places share {RUN} lines (at most {REPEATED_RUNS_CEILING}): "
        "make one of them call the other\n" + "\n".join(found)
    )


def test_the_repeat_check_sees_copies_but_not_idioms_or_imports() -> None:
    body = [f"value_{i} = compute({i})" for i in range(7)]
    idiom = [f"common_{i}()" for i in range(6)]
    imports = [f"from package import name_{i}" for i in range(6)]
    sources = {
        "a.py": "\n".join(["import os", *body, "", *idiom, *imports]),
        "b.py": "\n".join(["x = 1", "# a comment", *body[:3], "", *body[3:], *imports]),
        **{f"idiom_{i}.py": "\n".join(idiom) for i in range(MOST_PLACES)},
    }
    assert repeated_runs(sources) == ["a.py:2 ~ b.py:3 (7 lines)"]
