"""The floors (README, "Dive into the code"): each part of the package imports only from the
floors below it, and the parallelisms (floor 3) not from each other, so each is usable alone.
Every import counts, also one inside a function."""
import ast
from pathlib import Path

import fastpar

ROOT = Path(fastpar.__file__).resolve().parent
FLOORS = {"kernels": 1, "extension": 1, "_C": 1, "mesh": 2, "split_backward": 2,
          "tensor_parallel": 3, "data_parallel": 3, "pipeline": 3, "context_parallel": 3,
          "models": 4,
          "data": 5, "train": 5, "plan": 5, "cli": 5, "__main__": 5}
PARALLELISMS = {"tensor_parallel", "data_parallel", "pipeline", "context_parallel"}


def _part(module: str) -> str | None:
    """The top-level part of fastpar a dotted module name lies in."""
    parts = module.split(".")
    return parts[1] if parts[0] == "fastpar" and len(parts) > 1 else None


def _files():
    """(path inside fastpar/, file) for every module; fastpar/kernels is a link to kernels/."""
    yield from ((p.relative_to(ROOT), p) for p in sorted(ROOT.rglob("*.py")))
    yield from ((Path("kernels") / p.name, p) for p in sorted((ROOT / "kernels").glob("*.py")))


def _imports(rel: Path, path: Path):
    """(line, fastpar module imported) for every import in a file."""
    here = ["fastpar", *rel.with_suffix("").parts]
    if here[-1] == "__init__":
        here = here[:-1] + ["__init__"]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            base = here[:-node.level] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            if node.module is None or not node.level and not node.module.startswith("fastpar"):
                names = [f"{mod}.{a.name}" for a in node.names] if node.level else [mod]
            else:
                names = [mod]
            yield from ((node.lineno, n) for n in names)


def test_every_import_goes_down_a_floor():
    wrong = []
    for rel, path in _files():
        mine = rel.parts[0].removesuffix(".py")
        if mine not in FLOORS:              # fastpar/__init__.py, testing.py: above every floor
            continue
        for line, module in _imports(rel, path):
            other = _part(module)
            if other is None or other == mine or other not in FLOORS:
                continue
            if FLOORS[other] > FLOORS[mine] or (mine in PARALLELISMS and other in PARALLELISMS):
                wrong.append(f"fastpar/{rel}:{line} ({mine}, floor {FLOORS[mine]}) imports "
                             f"{module} ({other}, floor {FLOORS[other]})")
    assert not wrong, "\n".join(wrong)


def _module_of(name: str, modules: set[str]) -> str | None:
    """The fastpar module (a file) an imported dotted name lies in: the longest prefix that is
    one (``fastpar.data.sources.load_tokens`` -> ``fastpar.data.sources``)."""
    parts = name.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def test_no_import_cycle_between_modules():
    """No two modules import each other, directly or round a loop, not even through an import
    inside a function (a package's ``__init__`` re-exporting its modules aside)."""
    files = {("fastpar." + ".".join(rel.with_suffix("").parts)).removesuffix(".__init__"):
             (rel, path) for rel, path in _files()}
    graph = {}
    for mod, (rel, path) in files.items():
        if rel.name == "__init__.py":
            continue
        graph[mod] = {m for _, name in _imports(rel, path)
                      if (m := _module_of(name, set(files))) and m != mod
                      and files[m][0].name != "__init__.py"}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):               # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "modules that import each other: " + "; ".join(map(str, cycles))
