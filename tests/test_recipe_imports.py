"""recipes/: one concept per module, and no two modules that import each other (directly or round a
longer cycle), counting imports made inside functions too."""
import ast
from pathlib import Path

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def imports_of(path: Path) -> set[str]:
    """The recipes modules ``path`` imports anywhere in it (``from recipes import x``,
    ``from recipes.x import y``, ``import recipes.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "recipes":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("recipes."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("recipes.")}
    return found - {path.stem}


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> the modules it imports), or [] if there is none."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return []


def test_no_recipes_module_imports_one_that_imports_it_back():
    graph = {p.stem: imports_of(p) for p in RECIPES.glob("*.py")}
    assert graph["loop"] and graph["hf"] is not None  # the walk sees the modules
    assert cycle(graph) == [], " -> ".join(cycle(graph))


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []
