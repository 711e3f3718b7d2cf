"""The layers point one way: the core (the recipe and its three modules) imports machinery/, which imports no
core module and no tool; the tools sit above both; and no module imports itself back through others. Every
import counts: at the top, inside a function, or in a module __getattr__."""
import ast
import os
import subprocess
import sys

from support import ROOT

CORE = {"train_ddp", "dataset_utils", "model", "train_utils"}
TOOLS = {"bench", "preflight", "plot", "tools"}


def project_modules() -> dict:
    """{module name: file} of the project's own Python modules (the top level, machinery/, tools/)."""
    found = {name[:-3]: os.path.join(ROOT, name) for name in os.listdir(ROOT) if name.endswith(".py")}
    for package in ("machinery", "tools"):
        for name in os.listdir(os.path.join(ROOT, package)):
            if name.endswith(".py"):
                module = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                found[module] = os.path.join(ROOT, package, name)
    return found


def imports_of(path: str, modules: dict) -> set:
    """The project's modules that the file imports, anywhere in it."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # from machinery import errors
    return {name for name in names if name in modules}


def import_graph() -> dict:
    modules = project_modules()
    return {module: imports_of(path, modules) - {module} for module, path in modules.items()}


def top(module: str) -> str:
    return module.split(".")[0]


def test_machinery_imports_no_core_module_and_no_tool():
    upward = {module: sorted(m for m in imported if top(m) in CORE | TOOLS)
              for module, imported in import_graph().items() if top(module) == "machinery"}
    assert {m: up for m, up in upward.items() if up} == {}


def test_the_core_imports_no_tool():
    upward = {module: sorted(m for m in imported if top(m) in TOOLS)
              for module, imported in import_graph().items() if module in CORE}
    assert {m: up for m, up in upward.items() if up} == {}


def find_cycle(graph: dict) -> list:
    """One import cycle [a, b, ..., a], or [] if there is none."""
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                return stack[stack.index(imported):] + [imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        stack.pop()
        state[module] = "done"
        return []
    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return []


def test_no_module_imports_itself_back_through_others():
    assert find_cycle(import_graph()) == []


def test_the_layer_checks_find_a_planted_upward_import_and_a_cycle():
    """The checks above can fail: a machinery module that imported the recipe, and a circle, are found."""
    graph = import_graph()
    planted = {**graph, "machinery.errors": graph["machinery.errors"] | {"dataset_utils"}}
    assert find_cycle(planted)  # dataset_utils imports machinery.errors
    assert top("dataset_utils") in CORE


CLOSURE_MAX_LINES = 3400  # what a copier takes along: the project's modules that `import train_ddp` loads (3,302
# on 2026-11-28, after --deterministic, the run's time to a target and the Data line's size range; 3,363 on
# 2026-11-29, after --comm-hook's flags and wrap_ddp, its hooks themselves loaded only when asked for; 3,388 after
# the teardown frees a failure's DDP model before the interpreter's finalization)


def test_importing_the_recipe_loads_at_most_3400_lines_of_the_project():
    """`import train_ddp` loads the core and the machinery it always needs; what only some runs need (a resume,
    CIFAR-100's files, --init-from, the modern recipe's ops, DataLoader workers, a failure's explanation)
    loads when that run needs it."""
    code = ("import os, sys; import train_ddp; root = os.getcwd(); "
            "files = sorted(m.__file__ for m in list(sys.modules.values()) "
            "if os.path.isabs(getattr(m, '__file__', None) or '') and os.path.dirname(m.__file__) in "
            "(root, os.path.join(root, 'machinery'))); "
            "print(sum(sum(1 for _ in open(f)) for f in files)); print(*files, sep='\\n')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout.split("\n")
    lines, files = int(out[0]), [os.path.relpath(f, ROOT) for f in out[1:] if f]
    assert "train_ddp.py" in files and "machinery/errors.py" in files  # what it counts
    assert lines <= CLOSURE_MAX_LINES, files


COPY_MAX_LINES = 4000  # the README's copy line's Python (issue 76: 5,137 lines before, 3,990 on 2026-12-02, 5212c3e)


def copy_line_files() -> list:
    """The .py files the README's copy line takes (its files, and every .py under its folders)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        block = f.read().split("<!-- the copy: the tests run exactly this line -->", 1)[1]
    line = block.split("```bash\n", 1)[1].split("```", 1)[0].strip()
    taken = line.split("cp -r ", 1)[1].split('"$REPO', 1)[0].split()
    return sorted(os.path.join(root, name) for path in taken for root, _, names in
                  ([(ROOT, None, [path])] if path.endswith(".py") else os.walk(os.path.join(ROOT, path)))
                  for name in names if name.endswith(".py"))


def test_the_readme_copy_line_takes_at_most_4000_lines_of_python():
    """What a copier owns: every line of Python the README's copy line takes, blank ones and comments included."""
    files = copy_line_files()
    assert {"train_ddp.py", "model.py", "dataset_utils.py", "train_utils.py"} <= {os.path.basename(f) for f in files}
    assert any(f.endswith(os.path.join("machinery", "self_check.py")) for f in files)
    lines = {os.path.relpath(f, ROOT): sum(1 for _ in open(f)) for f in files}
    assert sum(lines.values()) <= COPY_MAX_LINES, lines
