"""The layout's rules, read from the source: who may import whom, and no import circles.

Rules (docs/ARCHITECTURE.md):

* ``storage`` imports nothing of ours;
* ``transport`` imports nothing of ``actors``;
* ``actors.runtime`` imports no daemon (``actors.broker``, later ``actors.lookupd``, ...);
* a daemon imports no other daemon: daemons talk over the wire;
* no two of our modules import each other, directly or through others
  (``TYPE_CHECKING`` imports count: a circle for the type checker is a circle
  in the design).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "transport", "storage")
RUNTIME = "actors.runtime"
NOT_DAEMONS = {RUNTIME, "actors.ctl", "actors.cli", "actors.pytest_plugin"}  # (tools over daemons)


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours that importing ``name`` names, or None if it is not ours."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """Every module of ours that ``module`` imports, at any depth of its code."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            # ``from pkg import sub`` imports the submodule when there is one.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        else:
            continue
        for name in names:
            resolved = _resolve(name)
            if resolved is not None and resolved != module:
                targets.add(resolved)
    return targets


GRAPH = {module: _imports(module) for module in MODULES}


def _daemon(module: str) -> str | None:
    """``actors.<daemon>`` for a module inside a daemon package, else None."""
    parts = module.split(".")
    if parts[0] != "actors" or len(parts) < 2:
        return None
    top = ".".join(parts[:2])
    return None if top in NOT_DAEMONS else top


def test_the_layout_has_the_packages_the_docs_name():
    for package in ("actors.runtime", "actors.broker", "transport.mailbox", "transport.nsq",
                    "transport.zmq", "transport.http", "transport.protocol", "storage"):
        assert package in MODULES, package


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("storage")))
def test_storage_imports_nothing_of_ours(module):
    assert {t for t in GRAPH[module] if not t.startswith("storage")} == set()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("transport")))
def test_transport_imports_nothing_of_actors(module):
    assert {t for t in GRAPH[module] if t.startswith("actors")} == set()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(RUNTIME)))
def test_the_runtime_imports_no_daemon(module):
    assert {t for t in GRAPH[module] if _daemon(t)} == set()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _daemon(m)))
def test_a_daemon_imports_no_other_daemon(module):
    own = _daemon(module)
    assert {t for t in GRAPH[module] if _daemon(t) not in (None, own)} == set()


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_ours_imports_itself_through_others():
    assert _cycles() == []


def test_the_checker_sees_a_circle_and_a_forbidden_import(monkeypatch):
    # Given a graph with a circle and a storage module importing the runtime
    monkeypatch.setitem(GRAPH, "storage.meta", {*GRAPH["storage.meta"], "actors.runtime.actor"})
    monkeypatch.setitem(GRAPH, "actors.runtime.actor",
                        {*GRAPH["actors.runtime.actor"], "storage.meta"})
    # Then both are found
    assert ["actors.runtime.actor", "storage.meta"] in _cycles()
    with pytest.raises(AssertionError):
        test_storage_imports_nothing_of_ours("storage.meta")
