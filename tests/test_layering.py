"""The packages' layering: every import points down, and no packages import each other in a circle.

Every ``.py`` file of every package (``setup.py``'s ``SUBPACKAGES`` and the root package
``tpfuse/``) is parsed; every import statement counts, at module level or inside a function:
``import x``, ``from x import y`` and relative imports (resolved against the file's own module
path). An import of ``tpfuse.<package>...`` from a file of another package is an edge between the
two.

Ranks (bottom up); a package may import only packages of a LOWER rank, so packages of one rank
("beside each other") do not import each other::

    0  tpfuse          the root package's own modules: ``tpfuse/__init__.py`` (version),
                       ``tpfuse._lazy`` (the lazy-export helper every package's __init__ uses)
                       ``tpfuse._optional`` (optional dependencies: import or fail naming
                       the pip extra) and ``tpfuse._shadow`` (a root folder imported under its
                       bare name hands it to the installed distribution); they import no tpfuse
                       package
    1  parallel        ParallelState, rank arithmetic, groups, validators
    2  kernels data
    3  tp_layers
    4  moe
    5  models pipeline pipeline beside models, never importing them
    6  checkpoint      the checkpoint format, verification, I/O, resharding
       runtime         process start-up: torch.distributed initialisation, the local launcher
    7  training inference convert
                       inference and convert use models and checkpoint, never the trainer
    8  megatron_compat the one Megatron boundary
       tpfuse.pretrain_gpt
                       the entry script: the trainer plus the callbacks it is given (the
                       model, the datasets, the end-of-training sample from inference)

A package ``setup.py`` installs that is missing here fails the test: every new package is given
a rank.
"""
from __future__ import annotations

import ast
import os
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RANKS = {
    "tpfuse": 0, "tpfuse._lazy": 0, "tpfuse._shadow": 0, "tpfuse._optional": 0,
    "parallel": 1,
    "kernels": 2, "data": 2,
    "tp_layers": 3,
    "moe": 4,
    "models": 5, "pipeline": 5,
    "checkpoint": 6, "runtime": 6,
    "training": 7, "inference": 7, "convert": 7,
    "megatron_compat": 8, "tpfuse.pretrain_gpt": 8,
}
ROOT_MODULES = ("_lazy", "_shadow", "_optional", "pretrain_gpt")   # tpfuse/<name>.py: own units


def subpackages(root: str) -> list[str]:
    """``SUBPACKAGES`` of ``root``/setup.py that exist as folders with an ``__init__.py``."""
    tree = ast.parse(open(os.path.join(root, "setup.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "SUBPACKAGES" for t in node.targets):
            names = ast.literal_eval(node.value)
            return [n for n in names if os.path.exists(os.path.join(root, n, "__init__.py"))]
    raise AssertionError(f"{root}/setup.py defines no SUBPACKAGES list")


def unit_of(module: str) -> str | None:
    """The ranked unit a dotted ``tpfuse...`` module belongs to (None: not tpfuse's)."""
    parts = module.split(".")
    if parts[0] != "tpfuse":
        return None
    if len(parts) == 1:
        return "tpfuse"
    if parts[1] in ROOT_MODULES:
        return f"tpfuse.{parts[1]}"
    return parts[1]


def source_files(root: str):
    """(unit, module name, path) of every .py file of every package."""
    for package in subpackages(root):
        for folder, dirs, files in os.walk(os.path.join(root, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, root)[:-len(".py")].split(os.sep)
                yield package, ".".join(["tpfuse", *rel]), path
    for name in sorted(os.listdir(os.path.join(root, "tpfuse"))):
        if name.endswith(".py"):
            module = "tpfuse" if name == "__init__.py" else f"tpfuse.{name[:-3]}"
            yield unit_of(module), module, os.path.join(root, "tpfuse", name)


def imported_modules(tree: ast.AST, module: str, is_package: bool):
    """(dotted module, line) of every import in ``tree`` (function bodies included), relative
    imports resolved; ``from a import b`` yields ``a.b`` (b may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                yield f"{base}.{alias.name}" if alias.name != "*" else base, node.lineno


def import_edges(root: str) -> dict[tuple[str, str], list[str]]:
    """{(importing unit, imported unit): ["file:line", ...]} across units."""
    edges = defaultdict(list)
    for unit, module, path in source_files(root):
        tree = ast.parse(open(path).read(), path)
        is_package = os.path.basename(path) == "__init__.py"
        for target, line in imported_modules(tree, module, is_package):
            target_unit = unit_of(target)
            place = f"{os.path.relpath(path, root)}:{line}"
            if target_unit is not None and target_unit != unit \
                    and place not in edges[(unit, target_unit)]:
                edges[(unit, target_unit)].append(place)
    return dict(edges)


def upward_imports(root: str) -> list[str]:
    """One line per import of a package that is not below the importing one."""
    found = []
    for (unit, target), places in sorted(import_edges(root).items()):
        if target not in RANKS or RANKS[target] >= RANKS[unit]:
            where = "beside" if RANKS.get(target) == RANKS[unit] else "above"
            found += [f"{place}: {unit} (rank {RANKS[unit]}) imports {target} "
                      f"(rank {RANKS.get(target)}, {where} it)" for place in places]
    return found


def package_cycles(root: str) -> list[list[str]]:
    """Every cycle of the unit import graph (each as its units, first repeated at the end)."""
    graph = defaultdict(set)
    for unit, target in import_edges(root):
        graph[unit].add(target)
    cycles, seen = [], set()

    def walk(node, path):
        for successor in sorted(graph[node]):
            if successor == path[0]:
                cycle = path + [successor]
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    cycles.append(cycle)
            elif successor not in path and successor > path[0]:
                walk(successor, path + [successor])

    for start in sorted(graph):
        walk(start, [start])
    return cycles


def test_every_package_has_a_rank():
    missing = [p for p in subpackages(ROOT) if p not in RANKS]
    assert not missing, f"packages without a layer in tests/test_layering.py RANKS: {missing}"


def test_no_package_imports_one_above_or_beside_it():
    found = upward_imports(ROOT)
    assert not found, "imports that do not point down:\n" + "\n".join(found)


def test_no_package_cycle():
    cycles = package_cycles(ROOT)
    edges = import_edges(ROOT)
    lines = []
    for cycle in cycles:
        lines.append(" -> ".join(cycle))
        lines += [f"    {a} -> {b}: {', '.join(edges[(a, b)][:3])}"
                  for a, b in zip(cycle, cycle[1:])]
    assert not cycles, "package cycles:\n" + "\n".join(lines)


def test_the_scan_sees_imports_inside_functions_and_relative_ones():
    # the scan's own reference: a tiny tree with every import form, resolved by hand
    source = ("import tpfuse.models\nfrom tpfuse import _lazy\nfrom . import sibling\n"
              "from ..training import pretrain\ndef f():\n    from tpfuse.inference.sample "
              "import training_sample\n")
    found = sorted(imported_modules(ast.parse(source), "tpfuse.checkpoint.format", False))
    assert found == [("tpfuse._lazy", 2), ("tpfuse.checkpoint.sibling", 3),
                     ("tpfuse.inference.sample.training_sample", 6), ("tpfuse.models", 1),
                     ("tpfuse.training.pretrain", 4)]
    assert [unit_of(m) for m, _ in found] == ["tpfuse._lazy", "checkpoint", "inference",
                                              "models", "training"]


def test_nested_packages_rank_with_their_top_folder():
    # training/plan/ (tpfuse.training.plan, the planner) is scanned file by file as training's
    scanned = {module: unit for unit, module, _ in source_files(ROOT)}
    planner = {module: unit for module, unit in scanned.items()
               if module.startswith("tpfuse.training.plan.")}
    expected = {f"tpfuse.training.plan.{name}" for name in
                ("__init__", "memory", "activations", "comm", "report", "search", "cli")}
    assert expected <= set(planner), sorted(expected - set(planner))
    assert set(planner.values()) == {"training"}
    assert unit_of("tpfuse.training.plan.memory") == "training"


# ----------------------------------------------------------------------------- module circles
# No two modules import each other, directly or through others: the graph of module imports (every
# import anywhere in a file, function bodies included) has no cycle. A target ``a.b.c`` is the
# longest dotted prefix that is a tpfuse module, so ``from pkg import name`` is an edge to the
# submodule ``pkg.name`` when there is one and to ``pkg/__init__.py`` otherwise (a package that
# re-exports ``a`` while ``a`` imports from the package is a circle: import from the defining
# module). Nothing is left out. Only the packages an import initialises on its way (``import
# a.b.c`` runs ``a`` and ``a.b`` first) are not edges of their own: with them, a package whose
# __init__ imports its submodule ``a`` would be in a circle with ``a`` as soon as ``a`` imports any
# sibling, although ``a`` only ever runs while that package is already initialising.

def module_import_graph(root: str) -> dict[str, dict[str, str]]:
    """{module: {imported tpfuse module: "file:line" of its first import}}, self-imports left out."""
    paths = {module.removesuffix(".__init__"): path for _, module, path in source_files(root)}

    def defining_module(target):
        parts = target.split(".")
        while parts and ".".join(parts) not in paths:
            parts.pop()
        return ".".join(parts) or None

    graph = {}
    for module, path in paths.items():
        tree = ast.parse(open(path).read(), path)
        is_package = os.path.basename(path) == "__init__.py"
        graph[module] = {}
        for target, line in imported_modules(tree, module, is_package):
            imported = defining_module(target)
            if imported is not None and imported != module:
                graph[module].setdefault(imported, f"{os.path.relpath(path, root)}:{line}")
    return graph


def strongly_connected(graph: dict) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def shortest_cycle(graph: dict, component: list[str]) -> list[str]:
    """The shortest cycle through the component's first module (breadth first, inside it), as
    its modules with the first repeated at the end."""
    start, members = component[0], set(component)
    came_from, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node]):
                if successor == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
                if successor in members and successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def module_cycles(root: str) -> list[str]:
    """One line per circle of module imports (a cycle through each strongly connected group),
    then each edge of it with the file and line of the import."""
    graph = module_import_graph(root)
    lines = []
    for component in strongly_connected(graph):
        cycle = shortest_cycle(graph, component)
        lines.append(" -> ".join(cycle) + (f"  (a group of {len(component)} modules: "
                                           f"{', '.join(component)})"
                                           if len(component) > len(cycle) - 1 else ""))
        lines += [f"    {a} -> {b}: {graph[a][b]}" for a, b in zip(cycle, cycle[1:])]
    return lines


def test_no_module_imports_itself_through_others():
    lines = module_cycles(ROOT)
    assert not lines, "module import circles:\n" + "\n".join(lines)


def _write_tree(root, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# a tiny installed tree: a -> b (in a function) -> c -> a is a circle, d only imports a; the
# package __init__ re-exports e, which imports a name from the package: a circle too
TREE_WITH_CIRCLES = {
    "setup.py": 'SUBPACKAGES = ["pkg"]\n',
    "tpfuse/__init__.py": "",
    "pkg/__init__.py": "from .e import thing\n",
    "pkg/a.py": "from . import b\n",
    "pkg/b.py": "def f():\n    import tpfuse.pkg.c\n",
    "pkg/c.py": "import os\nfrom tpfuse.pkg.a import name\n",
    "pkg/d.py": "import tpfuse.pkg.a\n",
    "pkg/e.py": "from tpfuse.pkg import other\nthing = 1\n",
}


def test_the_circle_check_finds_circles_in_a_small_tree(tmp_path):
    _write_tree(tmp_path, TREE_WITH_CIRCLES)
    assert strongly_connected(module_import_graph(str(tmp_path))) == [
        ["tpfuse.pkg", "tpfuse.pkg.e"], ["tpfuse.pkg.a", "tpfuse.pkg.b", "tpfuse.pkg.c"]]
    assert module_cycles(str(tmp_path)) == [
        "tpfuse.pkg -> tpfuse.pkg.e -> tpfuse.pkg",
        f"    tpfuse.pkg -> tpfuse.pkg.e: {os.path.join('pkg', '__init__.py')}:1",
        f"    tpfuse.pkg.e -> tpfuse.pkg: {os.path.join('pkg', 'e.py')}:1",
        "tpfuse.pkg.a -> tpfuse.pkg.b -> tpfuse.pkg.c -> tpfuse.pkg.a",
        f"    tpfuse.pkg.a -> tpfuse.pkg.b: {os.path.join('pkg', 'a.py')}:1",
        f"    tpfuse.pkg.b -> tpfuse.pkg.c: {os.path.join('pkg', 'b.py')}:2",
        f"    tpfuse.pkg.c -> tpfuse.pkg.a: {os.path.join('pkg', 'c.py')}:2",
    ]


def test_the_circle_check_passes_a_tree_without_circles(tmp_path):
    # the same tree with the circles cut: c no longer imports a, e imports from d, not the package
    _write_tree(tmp_path, {**TREE_WITH_CIRCLES, "pkg/c.py": "import os\n",
                           "pkg/d.py": "import tpfuse.pkg.a\nother = 2\n",
                           "pkg/e.py": "from tpfuse.pkg.d import other\nthing = 1\n"})
    graph = module_import_graph(str(tmp_path))
    assert graph["tpfuse.pkg.e"] == {"tpfuse.pkg.d": f"{os.path.join('pkg', 'e.py')}:1"}
    assert module_cycles(str(tmp_path)) == []
