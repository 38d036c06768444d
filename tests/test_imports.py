"""The import rules of zfunc's packages, read from the source with ``ast`` (nothing is imported; ~1 s).

- **No cycle**: no two zfunc modules import each other, directly or through others. Every import
  counts: a function's lazy ``import`` and one under ``if TYPE_CHECKING:`` too (they hide a cycle from
  the interpreter, not from the reader). A package's ``__init__`` is a module like any other:
  ``from zfunc.dist import Mesh`` imports ``zfunc/dist/__init__.py``. Importing ``zfunc.a.b`` also
  runs ``zfunc/__init__.py`` and ``zfunc/a/__init__.py``; those implied imports are left out, or every
  module would import the root, which imports nearly everything.
- **No private name crosses a package**: a name ``_x`` defined in a module of package (folder) ``P``
  is used only by modules of ``P`` itself, not by a sibling, a parent or a subpackage: neither
  ``from zfunc.P.m import _x`` nor ``m._x`` on a module bound by an import. Dunder names are not private.
- **Every package folder has an ``__init__.py``**: setuptools' ``find_packages`` leaves a folder
  without one out of the wheel, and the checks here would not see its modules as imported.
- **The library stands alone**: nothing under ``zfunc/`` imports ``recipes``, ``benchmarks`` or
  ``tests``, by ``import`` or by ``importlib.import_module`` / ``__import__`` with a literal name.

A failure names each offending file and line, the module and the names.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = ("recipes", "benchmarks", "tests")



@dataclass(frozen=True)
class Import:
    """One import in ``path`` (relative to the root): module ``target``, and ``name`` when a
    from-import binds a name that is not a module; ``how``: "" at module level, "lazy" inside a
    function, "type checking" under ``if TYPE_CHECKING:``."""

    path: str
    line: int
    target: str
    name: str | None
    how: str

    def where(self) -> str:
        return f"{self.path}:{self.line}" + (f" ({self.how})" if self.how else "")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library(root: Path) -> dict[str, Path]:
    """Every zfunc module under ``root`` by dotted name (a package by its ``__init__.py``)."""
    return {module_name(p, root): p for p in sorted((root / "zfunc").rglob("*.py"))}


def package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def literal_prefix(node: ast.expr) -> str | None:
    """The module an ``importlib.import_module`` argument names, up to its first placeholder."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value).rstrip(".") or None
    return None


def type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class Reader(ast.NodeVisitor):
    """The imports of one module, and its reads ``m._x`` of private names on modules it bound."""

    def __init__(self, module: str, path: Path, root: Path, known: dict[str, Path]):
        self.known = known
        self.package = package_of(module, path)
        self.rel = str(path.relative_to(root))
        self.how: list[str] = []
        self.imports: list[Import] = []
        self.aliases: dict[str, str] = {}  # a local name -> the module it is bound to
        self.attributes: list[tuple[int, str, str]] = []  # (line, module, private name)

    def add(self, node: ast.AST, target: str, name: str | None) -> None:
        self.imports.append(Import(self.rel, node.lineno, target, name, self.how[-1] if self.how else ""))

    def inside(self, how: str, nodes: list[ast.AST]) -> None:
        self.how.append(how)
        for n in nodes:
            self.visit(n)
        self.how.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.inside(self.how[-1] if self.how else "lazy", [*node.decorator_list, *node.body])

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if type_checking(node.test):
            self.inside("type checking", node.body)
            self.inside(self.how[-1] if self.how else "", node.orelse)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.add(node, a.name, None)
            root = a.name.split(".")[0]
            self.aliases[a.asname or root] = a.name if a.asname else root

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        for a in node.names:
            sub = f"{base}.{a.name}"
            if sub in self.known:
                self.add(node, sub, None)
                self.aliases[a.asname or a.name] = sub
            else:
                self.add(node, base, a.name)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        named = (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
            isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))
        if named and node.args and (target := literal_prefix(node.args[0])):
            self.add(node, target, None)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in self.aliases:
            dotted = [self.aliases[value.id], *reversed(chain)]
            for i in range(len(dotted) - 1, 0, -1):
                owner = ".".join(dotted[:i])
                if owner in self.known:
                    if private(dotted[i]):
                        self.attributes.append((node.lineno, owner, dotted[i]))
                    break
            return  # the chain's inner attributes are part of this read
        self.generic_visit(node)


def read_all(root: Path = ROOT) -> tuple[dict[str, Path], dict[str, Reader]]:
    known = library(root)
    readers = {}
    for module, path in known.items():
        reader = Reader(module, path, root, known)
        reader.visit(ast.parse(path.read_text(), str(path)))
        readers[module] = reader
    return known, readers


def cycles(known: dict[str, Path], readers: dict[str, Reader]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    edges = {m: sorted({i.target for i in r.imports} & known.keys() - {m}) for m, r in readers.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def cycle_report(known: dict[str, Path], readers: dict[str, Reader]) -> list[str]:
    lines = []
    for component in cycles(known, readers):
        lines.append("import cycle among " + ", ".join(component) + ":")
        inside, seen = set(component), {}
        for m in component:
            for i in readers[m].imports:
                if i.target in inside and i.target != m:
                    seen.setdefault((i.where(), i.target), []).extend([i.name] if i.name else [])
        lines += [f"  {where} imports {target}" + (f" ({', '.join(names)})" if names else "")
                  for (where, target), names in seen.items()]
    return lines


def private_report(known: dict[str, Path], readers: dict[str, Reader]) -> list[str]:
    lines = []
    for r in readers.values():
        uses = [(i.line, i.target, i.name) for i in r.imports if i.name and private(i.name)]
        for line, owner, name in sorted(uses + r.attributes):
            if owner in known and (home := package_of(owner, known[owner])) != r.package:
                lines.append(f"{r.rel}:{line} uses {owner}.{name}, private to package {home}")
    return lines


def outside_report(readers: dict[str, Reader]) -> list[tuple[str, str, str]]:
    """``(path, outside package, the line saying where and what)`` for each import of one."""
    return [(i.path, i.target.split(".")[0], f"{i.where()} imports {i.target}" + (f" ({i.name})" if i.name else ""))
            for r in readers.values() for i in r.imports if i.target.split(".")[0] in OUTSIDE]


def test_no_import_cycle():
    found = cycle_report(*read_all())
    assert not found, "zfunc modules import each other:\n" + "\n".join(found)


def test_no_private_name_crosses_a_package():
    found = private_report(*read_all())
    assert not found, (f"{len(found)} private names used outside their package (make each public, with a "
                       "docstring, or move it):\n" + "\n".join(found))


def test_every_package_folder_has_an_init():
    folders = {p.parent for p in (ROOT / "zfunc").rglob("*.py")}
    bare = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file())
    assert not bare, f"folders of zfunc modules without an __init__.py (not packages): {bare}"


def test_the_library_imports_no_recipes_benchmarks_or_tests():
    found = outside_report(read_all()[1])
    assert not found, "zfunc/ imports outside the library:\n" + "\n".join(line for _, _, line in found)


def test_each_rule_fails_on_a_tree_that_breaks_it(tmp_path):
    """The checks themselves, on a small tree: a cycle through a lazy and a type-checking import, a
    private name taken by a from-import and by an attribute, and a literal importlib import."""
    files = {
        "zfunc/__init__.py": "",
        "zfunc/a/__init__.py": "from zfunc.a.m import public\n",
        "zfunc/a/m.py": "def public():\n    from zfunc.b import n\n\n\ndef _hidden():\n    pass\n",
        "zfunc/a/inner/__init__.py": "",
        "zfunc/a/inner/k.py": "from zfunc.a import m\n\nm._hidden()\n",
        "zfunc/b/__init__.py": "",
        "zfunc/b/n.py": ("from typing import TYPE_CHECKING\n\nfrom zfunc.a.m import _hidden, public\n\n"
                         "if TYPE_CHECKING:\n    from zfunc.a import m\n"),
        "zfunc/b/o.py": "import importlib\n\nimportlib.import_module(f'recipes.{1}')\nfrom zfunc.b import n\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    known, readers = read_all(tmp_path)
    assert cycle_report(known, readers) == [
        "import cycle among zfunc.a.m, zfunc.b.n:",
        "  zfunc/a/m.py:2 (lazy) imports zfunc.b.n",
        "  zfunc/b/n.py:3 imports zfunc.a.m (_hidden, public)",
        "  zfunc/b/n.py:6 (type checking) imports zfunc.a.m"]
    assert private_report(known, readers) == [
        "zfunc/a/inner/k.py:3 uses zfunc.a.m._hidden, private to package zfunc.a",
        "zfunc/b/n.py:3 uses zfunc.a.m._hidden, private to package zfunc.a"]
    assert outside_report(readers) == [("zfunc/b/o.py", "recipes", "zfunc/b/o.py:3 imports recipes")]
