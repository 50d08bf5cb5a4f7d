"""The package's own source files, as the layering and size tests read them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

# Where each folder lives in the import namespace (pyproject's [tool.setuptools.package-dir]).
PACKAGES = {
    "proto": "isthmus.proto",
    "intra": "isthmus.intra",
    "inter": "isthmus.inter",
    "sim": "isthmus.sim",
    "deploy": "isthmus.deploy",
}


def package_modules(root: Path) -> Iterator[tuple[Path, str, bool]]:
    """Each source file with its module name and whether it is a package's __init__."""
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            if "_pb2" in path.name:  # generated (proto/generate.py), never edited
                continue
            parts = path.relative_to(root / folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            yield path, ".".join((package, *parts[: -1 if is_package else None])), is_package


def write_tree(root: Path, files: dict[str, str]) -> None:
    """A small source tree for a check's self-test: {relative path: text}."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
