"""The house rules the lint session checks, reading the source (nothing is imported).

1. No import circle among the modules of any package under ``packages/*/src`` or among the
   scripts of ``benchmarks/``; imports inside functions count too (an import moved into a
   function hides a circle, it does not open it).
2. dcp-load's layers import one way: cli -> conversion, saving -> ``_load`` -> run -> plan ->
   layouts -> ``_errors``; no module imports a layer above its own.
3. Only ``dcp_reader/storage/`` asks whether a path is a URI: elsewhere no call of
   ``is_uri`` and no test of a string for ``"://"``.
4. At most 14 modules directly in each package's import folder.
5. Every relative import names a module of its package (a module moved to another folder
   with a function-level import left behind fails only when that function runs).
6. No function or method under ``packages/*/src`` is longer than 60 lines, from its ``def``
   to its last line (docstring included, decorators not): one that needs more does several things.

Exit 1 listing every offence, 0 when the tree keeps the rules. ``python .ci/check_house.py``.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_TOP_MODULES = 14
MAX_FUNCTION_LINES = 60
#: dcp-load's layers, lowest first; a module may import its own layer and those below it.
LAYERS = ["_errors", "layouts", "plan", "run", "_load", "saving", "transferring", "conversion", "cli"]
#: The modules of dcp-load outside the layer order: the package's fronts (itself and torch_compat), its
#: version, the demo.
UNLAYERED = {"__init__", "_version", "demo", "torch_compat"}


def modules(src: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every ``.py`` under ``src`` (a package ``__init__`` by its package)."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imported(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``name``) imports anywhere in its body."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            candidates = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for cand in candidates:
            while cand and cand not in known:
                cand = cand.rpartition(".")[0]
            # a package's __init__ that only re-exports is not an edge to its own modules
            if cand and cand != name and not (name.startswith(cand + ".") and known[cand].name == "__init__.py"):
                found.add(cand)
                break
    return found


def broken_relative(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> list[str]:
    """Relative imports of ``path`` whose module is none of ``known`` (nor a name in a package)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            if base not in known:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {base}, which does not exist")
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_of(name: str) -> str | None:
    """dcp-load's layer of a module (``dcp_load.plan._owners`` -> ``plan``), None outside the order."""
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "dcp_load" or parts[1] in UNLAYERED:
        return None
    return parts[1] if parts[1] in LAYERS else "?"


def layer_offences(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        mine = layer_of(mod)
        if mine is None:
            continue
        if mine == "?":
            out.append(f"{mod}: in no layer of dcp-load ({', '.join(LAYERS)}); put it in one")
            continue
        for dep in sorted(deps):
            theirs = layer_of(dep)
            if theirs not in (None, "?") and LAYERS.index(theirs) > LAYERS.index(mine):
                out.append(f"{mod} ({mine}) imports {dep} ({theirs}), a layer above it")
    return out


def uri_tests(path: pathlib.Path) -> list[str]:
    """Lines of ``path`` that call ``is_uri`` or test a string for ``"://"``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname == "is_uri" or (fname in ("startswith", "find", "index", "split", "partition")
                                     and any(_has_scheme(a) for a in node.args)):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if _has_scheme(node.left):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return out


def long_functions(path: pathlib.Path) -> list[str]:
    """Functions and methods of ``path`` longer than ``MAX_FUNCTION_LINES``, each named with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: function {node.name} is {lines} lines long "
                           f"(at most {MAX_FUNCTION_LINES}): split it by what its parts do")
    return out


def _has_scheme(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and "://" in node.value


def main() -> int:
    problems: list[str] = []
    trees = [p for p in sorted((ROOT / "packages").glob("*/src"))] + [ROOT / "benchmarks"]
    for src in trees:
        known = modules(src)
        graph = {name: imported(name, path, known) for name, path in known.items()}
        problems += [f"import circle in {src.relative_to(ROOT)}: {' <-> '.join(c)}" for c in circles(graph)]
        problems += layer_offences(graph)
        for name, path in known.items():
            problems += broken_relative(name, path, known)
        if src.name == "src":
            for pkg in sorted(p for p in src.iterdir() if (p / "__init__.py").exists()):
                top = [p for p in pkg.glob("*.py") if p.stem not in ("__init__", "_version")]
                if len(top) > MAX_TOP_MODULES:
                    problems.append(f"{pkg.relative_to(ROOT)}: {len(top)} modules directly in it "
                                    f"(at most {MAX_TOP_MODULES}): move them into the sub-package of their layer")
            for name, path in known.items():
                problems += long_functions(path)
                if not name.startswith("dcp_reader.storage"):
                    problems += [f"{hit}: only dcp_reader.storage asks whether a path is a URI; ask the "
                                 "Storage instead" for hit in uri_tests(path)]
    for line in problems:
        print(line)
    print(f"check_house: {len(problems)} problem(s)" if problems else "check_house: the house keeps its rules")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
