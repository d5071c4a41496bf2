"""The package's shape, as docs/architecture.md draws it: layers that import downward only, no cycles, a short
top level, thin command modules and short functions."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanogpt_cli"

# bottom to top; the top-level modules (errors, files, config, device, model, lora, tokenizer) are layer 0.
# Two folders on one layer never import each other. inference/backends/ (how a decode step is computed, and the
# quantized weights' format that loading builds) sits below the rest of inference/, with data/.
LAYERS = {"data": 1, "inference.backends": 1, "runs": 2, "interop": 3, "training": 4, "inference": 4}
LAYERS |= {"model": 0, "inspect": 5, "serve": 5, "api": 6, "cli": 7, "__main__": 8}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports, at the top or inside a function."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name, found = module_name(path), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                target = (
                    ".".join(base[: len(base) - node.level + 1] + [node.module or ""]) if node.level else node.module
                )
                target = (target or "").rstrip(".")
                if target.startswith("nanogpt_cli"):
                    found |= {f"{target}.{a.name}" if is_module(f"{target}.{a.name}") else target for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("nanogpt_cli")}
        graph[name] = found - {name, "nanogpt_cli"}
    return graph


def room(module: str) -> str:
    """The folder that makes a module's layer: its top-level folder, or a subfolder that has a layer of its own."""
    parts = module.split(".")
    sub = ".".join(parts[1:3])
    return sub if sub in LAYERS else parts[1] if len(parts) > 1 else ""


def layer(module: str) -> int:
    return LAYERS.get(room(module), 0)


def test_every_import_points_down_or_stays_in_its_folder():
    upward = [
        f"{m} -> {d}"
        for m, deps in imports().items()
        if m != "nanogpt_cli"  # the package's face: __version__, and the Python API's names handed out lazily
        for d in deps
        if layer(d) > layer(m) or (layer(d) == layer(m) > 0 and room(d) != room(m))
    ]
    assert not upward, upward


def test_the_imports_have_no_cycle():
    graph, state, cycles = imports(), {}, []
    graph.pop("nanogpt_cli")  # its lazy __getattr__ imports the API on first use, not at import

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                cycles.append(path[path.index(d) :] + [d])
            elif d in graph and d not in state:
                visit(d, [*path, d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_the_top_level_holds_about_ten_modules_and_every_folder_is_a_layer():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 10, modules
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders <= set(LAYERS), folders - set(LAYERS)


def test_each_folder_says_what_it_owns_and_what_it_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc, f"{init} has no docstring"
        if init.parent.name not in ("cli", "serve"):
            assert "import" in doc, f"{init}'s docstring does not say what it may import"


def test_command_modules_stay_under_400_lines_and_functions_under_80():
    long_modules = [p.name for p in (PACKAGE / "cli").glob("*.py") if len(p.read_text().splitlines()) > 400]
    assert not long_modules, long_modules
    long_functions = [
        f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long_functions, long_functions


# --- docs/architecture.md tells the truth ----------------------------------------------------------------------

DOC = PACKAGE.parent / "docs" / "architecture.md"


def doc_section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_architecture_pages_layer_table_is_the_layers_checked_here():
    rows = [line.split("|") for line in doc_section("The layers").splitlines() if line.startswith("| ")]
    drawn = {}
    for row in rows[1:]:  # the header first
        layer_cell, where = row[1].strip(), row[2]
        if not layer_cell.isdigit():
            continue
        for name in re.findall(r"`([^`]+)`", where):
            drawn[name.removesuffix("/").removesuffix(".py").replace("/", ".")] = int(layer_cell)
    assert drawn == LAYERS, (drawn, LAYERS)


def test_every_module_of_the_package_is_named_on_the_architecture_page():
    bullets = {}  # the folder a bullet of "Every module" opens with -> its text
    for bullet in doc_section("Every module").split("\n- ")[1:]:
        head = bullet.split(":", 1)[0]
        bullets[head.strip("`").removesuffix("/") if head != "top level" else ""] = bullet
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        parts = path.relative_to(PACKAGE).parts
        if f"`{path.name}`" not in bullets.get(parts[0] if len(parts) > 1 else "", ""):
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, missing


# what a command module may take from the library below the API: pictures and tables, which are rendering
DRAWING = {"nanogpt_cli.inspect.draw": None, "nanogpt_cli.inspect": {"heads_table"}}  # None: any of its names
BELOW_THE_API = ("training", "data", "runs", "interop", "inference", "inspect")


def test_command_modules_call_the_library_through_the_api_only():
    """cli/ renders what api returns: the layers below it are reached through api, except their drawing."""
    found = []
    for path in sorted((PACKAGE / "cli").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                names = [(a.name, "*") for a in node.names]
            else:
                continue
            for module, name in names:
                if module == "nanogpt_cli":  # from nanogpt_cli import training
                    module, name = f"{module}.{name}", "*"
                parts = module.split(".")
                if parts[0] != "nanogpt_cli" or len(parts) < 2 or parts[1] not in BELOW_THE_API:
                    continue
                allowed = DRAWING.get(module, set())
                if allowed is not None and name not in allowed:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {module} {name}")
    assert not found, found
