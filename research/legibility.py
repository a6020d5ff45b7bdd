"""How easy is the code to follow? Prints the measures the legibility issue asks for, over
tasks/, flows/ and schemas/: import cycles between the project's modules (module-level and
function-local imports alike), public names defined in more than one module, the longest
functions, function-local imports (all, and those of the project's own modules).
A function's length counts its def line and body, not its docstring.

    .venv/bin/python research/legibility.py [--top 10]
"""
import argparse
import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("tasks", "flows", "schemas")


_FOUND: dict[str, pathlib.Path] = {}


def modules() -> dict[str, pathlib.Path]:
    found = _FOUND
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _resolve(module: str, node: ast.ImportFrom | ast.Import, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    # `from a import b` imports the module a.b when there is one, else the name b from a.
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in _FOUND else base for alias in node.names]


def import_graph(found: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """module -> the project's modules it imports (a `from a.b import c` names a.b, or a.b.c if that is a module)."""
    graph = {}
    for name, path in found.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(name, node, path.name == "__init__.py"):
                    while target and target not in found:
                        target = target.rpartition(".")[0]
                    if target and target != name:
                        edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v); on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop(); on_stack.discard(w); component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def with_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first: those edges are real too."""
    full = {k: set(v) for k, v in graph.items()}
    for name, edges in graph.items():
        for target in edges:
            parts = target.split(".")
            for i in range(1, len(parts)):
                parent = ".".join(parts[:i])
                if parent in graph and parent != name and not name.startswith(parent + "."):
                    full[name].add(parent)
    return full


def report(top: int) -> dict:
    found = modules()
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in found.items()}
    graph = with_package_inits(import_graph(found))
    defined = collections.defaultdict(list)
    functions = []
    for name, tree in trees.items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                defined[node.name].append(name)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
                lines = node.end_lineno - body[0].lineno + 2  # the def line and the body, not the docstring
                functions.append((lines, f"{found[name].relative_to(ROOT)}:{node.lineno} {node.name}"))
    # A nested function's imports are walked once per enclosing function: count each import node once.
    seen, local_imports, own_local = set(), 0, 0
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)) and id(inner) not in seen:
                        seen.add(id(inner))
                        local_imports += 1
                        targets = _resolve(name, inner, found[name].name == "__init__.py")
                        own_local += any(t.split(".")[0] in PACKAGES for t in targets)
    return {
        "modules": len(found),
        "cycles": cycles(graph),
        "names_in_several_modules": {k: v for k, v in sorted(defined.items()) if len(v) > 1},
        "longest_functions": sorted(functions, reverse=True)[:top],
        "function_local_imports": local_imports,
        "function_local_imports_of_own_modules": own_local,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10)
    r = report(parser.parse_args().top)
    print(f"modules: {r['modules']}")
    print(f"import cycles: {len(r['cycles'])}")
    for c in r["cycles"]:
        print("  " + " <-> ".join(c))
    print(f"public names defined in several modules: {len(r['names_in_several_modules'])}")
    for k, v in r["names_in_several_modules"].items():
        print(f"  {k}: {', '.join(v)}")
    print("longest functions (lines without the docstring):")
    for n, where in r["longest_functions"]:
        print(f"  {n:4d} {where}")
    print(f"function-local imports: {r['function_local_imports']} "
          f"(of the project's own modules: {r['function_local_imports_of_own_modules']})")
