"""Imports only go down: every import in src/attnkit (module level and inside functions, relative and
absolute) goes to the same or a lower layer, and the import graph has no cycle.

The layer map below is the one picture of the architecture (docs/architecture.md draws the same layers).
Modules that only re-export an old path (``from .x import *``) are allowed where they sit.
"""
import ast
import pathlib

import attnkit

SRC = pathlib.Path(attnkit.__file__).parent

# Bottom to top; a module may import from its own layer or any layer listed before it.
LAYERS = (
    ("_validation", "_aliases", "_cpu", "_display", "_progress", "_arguments", "io", "init"),
    ("kernels",),
    ("attention_core", "positional", "multi_head", "flex", "losses", "simple", "transformer_block"),
    ("core",),
    ("attention", "layers"),
    ("decoding", "optim"),
    ("models",),
    ("pretrained", "interop", "torch"),
    ("explain", "viz", "demos", "benchmarks", "testing"),
    ("cli", "__main__"),
)
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names}

# Imports that still go upwards; each would be a debt to pay off, and the list may only shrink (a fixed one
# must be removed from here, so the list stays true). The torch.nn converters are registered by class in
# attnkit.core.converters, so the layers no longer import the bridge.
KNOWN_UPWARD: frozenset[tuple[str, str]] = frozenset()

# The specified functional modules re-export these classes by name (the seeds say so).
SPECIFIED_REEXPORTS = frozenset({
    ("attnkit.multi_head", "attnkit.attention.multi_head_attention"),
    ("attnkit.transformer_block", "attnkit.layers.encoder"),
    ("attnkit.transformer_block", "attnkit.layers.encoder_block"),
})


def module_name(path):
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_reexport_shim(tree):
    body = [node for node in tree.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    return bool(body) and all(isinstance(n, ast.ImportFrom) and [a.name for a in n.names] == ["*"] for n in body)


def imported_modules(path):
    """Every attnkit module ``path`` imports, anywhere in the file."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "attnkit")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "attnkit":
                continue
            # ``from .pkg import sub`` imports the submodule when there is one.
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if _exists(sub) else target)
    found.discard(name)
    return found


def _exists(dotted):
    path = SRC.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer(dotted):
    if "." not in dotted:  # the package root re-exports everything, so only the top layer may import it
        return len(LAYERS) - 1
    return LAYER_OF[dotted.split(".")[1]]


def modules():
    return sorted(p for p in SRC.rglob("*.py") if "templates" not in p.parts)


def graph():
    edges = {}
    for path in modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if is_reexport_shim(tree) or path == SRC / "__init__.py":
            continue
        edges[module_name(path)] = imported_modules(path)
    return edges


def test_every_top_level_module_and_package_has_a_layer():
    tops = {p.stem for p in SRC.glob("*.py")} | {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    shims = {p.stem for p in SRC.glob("*.py") if is_reexport_shim(ast.parse(p.read_text(encoding="utf-8")))}
    assert sorted(tops - shims - {"__init__"} - set(LAYER_OF)) == []


def test_imports_only_go_down():
    upward = set()
    for importer, targets in graph().items():
        for target in targets:
            if layer(target) > layer(importer) and (importer, target) not in SPECIFIED_REEXPORTS:
                upward.add((importer, target))
    assert sorted(upward - KNOWN_UPWARD) == [], "imports from a higher layer"
    assert sorted(KNOWN_UPWARD - upward) == [], "fixed: remove these from KNOWN_UPWARD"


def test_no_import_cycles():
    edges = graph()
    # Package __init__ modules re-export their own submodules; a cycle through a package's own __init__
    # is how Python packages work, so an edge from a submodule to its enclosing package is left out.
    # The known upward imports are counted above; without them the graph must have no cycle at all.
    def successors(node):
        return [t for t in sorted(edges.get(node, ())) if t in edges and not node.startswith(t + ".")
                and (node, t) not in KNOWN_UPWARD]

    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in successors(node):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    assert cycles == []


def test_test_modules_do_not_import_each_other():
    """Shared cases live in helper modules (tests/helpers.py, tests/*_cases.py); a test module importing
    another would run that module's tests' setup twice and tie unrelated files together."""
    tests = pathlib.Path(__file__).resolve().parents[1]
    offenders = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [(str(path.relative_to(tests)), n) for n in names if n.split(".")[-1].startswith("test_")]
    assert offenders == []
