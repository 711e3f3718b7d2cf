"""The training loop a reader learns DDP from (train_ddp.py's train, train_one_epoch and train_step) uses at most 21
distinct names the project defines elsewhere, which a reader must look up in another file: the rest is torch's,
Python's, or train_ddp.py's own (train_step, evaluate, build_training, ...: read in place). 20 until the resumed
epoch's start became a call of its own (StepSampler.start_at), beside torch's set_epoch(epoch).

How they are counted: an ast walk over the three functions; each name used (called, or passed on as an argument),
bare (`log_start`) or as an attribute (`utils.log_start`, `step_log.mark`), counts once if the project's other
modules (the top level and machinery/; tests and tools aside) define a function, method or class of that name and
train_ddp.py does not, unless it is reached from torch (`torch.`, `dist.`, `nn.`) or from a local that holds a torch
object (the model, its optimizer, scaler, loss, tensors), whose methods are torch's even where the project has one
of the same name. At commit 92a1a6a this counted 35 (`PYTHONPATH=tests python tests/unit/test_loop_names.py ROOT`
lists them).

And every name of the project the recipe reads is where it says it lives: `module.name` in train_ddp.py (code,
comments, docstrings) names a module that defines `name` itself, and `from module import name` imports it from
there; no re-export on the way (train_utils.__all__ lists only what train_utils.py defines)."""
import ast
import os
import re
import sys

from support import ROOT

LOOP = ("train", "train_one_epoch", "train_step")
TORCH_ROOTS = {"torch", "dist", "nn", "functools", "time", "math",
               # locals that hold torch objects: the model (DDP, compiled), its optimizer, scaler, loss, EMA, tensors
               "model", "ddp", "eval_model", "optimizer", "scaler", "loss_fn", "images", "labels", "logits", "loss",
               "x", "y", "sums", "total", "buffer", "kept", "group", "hits", "stats"}
TORCH_ATTRIBUTES = {"optimizer", "scaler", "ema", "loss_fn", "model"}  # training.optimizer.step: torch's step


def definitions(path: str) -> set:
    """The names of every function, method and class the file defines."""
    with open(path) as f:
        return {node.name for node in ast.walk(ast.parse(f.read()))
                if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def project_definitions(root: str) -> set:
    """What the project's modules but train_ddp.py define, less what train_ddp.py defines itself."""
    names = set()
    for folder in (root, os.path.join(root, "machinery")):
        for name in os.listdir(folder):
            if name.endswith(".py") and name != "train_ddp.py":
                names |= definitions(os.path.join(folder, name))
    return names - definitions(os.path.join(root, "train_ddp.py"))


def chain(node) -> list:
    """`a.b.c` as ["a", "b", "c"]; [] where it starts from something other than a name (a call, a subscript)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    return [node.id, *parts] if isinstance(node, ast.Name) else []


def loop_names(root: str = ROOT) -> set:
    defined = project_definitions(root)
    with open(os.path.join(root, "train_ddp.py")) as f:
        functions = [node for node in ast.parse(f.read()).body
                     if isinstance(node, ast.FunctionDef) and node.name in LOOP]
    used = set()
    for function in functions:
        for node in ast.walk(function):
            if isinstance(node, ast.Call):
                # called, or passed on (functools.partial(evaluate, ...), timing=step_log.finish_epoch(...))
                targets = [node.func, *node.args, *(k.value for k in node.keywords)]
                for target in targets:
                    parts = chain(target)
                    if (parts and parts[-1] in defined and parts[0] not in TORCH_ROOTS
                            and not TORCH_ATTRIBUTES & set(parts[:-1])):
                        used.add(parts[-1])
    return used


def test_the_training_loop_uses_at_most_21_names_the_project_defines():
    names = loop_names()
    assert len(names) <= 21, sorted(names)


def module_file(module: str) -> str | None:
    """The file of the project's module `module` (`train_utils`, `machinery.launch`), or None if it is not one."""
    path = os.path.join(ROOT, *module.split(".")) + ".py"
    return path if os.path.exists(path) else None


def own_names(module: str) -> set:
    """What the module defines at its top level (functions, classes, assignments), not what it imports."""
    with open(module_file(module)) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def misplaced_names(text: str) -> list:
    """In the recipe's source `text`, the project's names not where it says they live: `from module import name`,
    and `module.name` (code, comments and docstrings alike) for a module it imports whole (`utils`: train_utils),
    train_utils and machinery's, where the module does not define the name itself."""
    tree, wrong = ast.parse(text), []
    modules = {"train_utils": "train_utils"}  # as the prose names it; the code's aliases below
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.asname or alias.name: alias.name for alias in node.names if module_file(alias.name)}
        elif isinstance(node, ast.ImportFrom) and module_file(node.module):
            wrong += [f"from {node.module} import {a.name}" for a in node.names if a.name not in own_names(node.module)]
    for module, name in re.findall(r"(?<![\w.])((?:machinery\.)?\w+)\.(\w+)", text):
        module = modules.get(module, module if module.startswith("machinery.") else None)
        if module and module_file(module) and name != "py" and name not in own_names(module):
            wrong.append(f"{module}.{name}")
    return sorted(set(wrong))


def test_every_name_the_recipe_reads_is_defined_where_it_says_it_lives():
    import train_utils
    with open(os.path.join(ROOT, "train_ddp.py")) as f:
        assert misplaced_names(f.read()) == []
    assert set(train_utils.__all__) <= own_names("train_utils"), "train_utils.__all__ lists what it defines only"


def test_the_place_check_finds_a_re_exported_name():
    """As the recipe read them at 898c6d0: names through train_utils' re-exports; and mix64, which dataset_utils
    imports from machinery.hashing."""
    text = ("import train_utils as utils\nfrom dataset_utils import mix64\n"
            "log = utils.StepLog(0)  # see train_utils.measure_data, machinery.timing.StepLog\n")
    assert misplaced_names(text) == ["from dataset_utils import mix64", "train_utils.StepLog",
                                     "train_utils.measure_data"]


if __name__ == "__main__":  # PYTHONPATH=tests python tests/unit/test_loop_names.py [ROOT]: the names, counted
    found = loop_names(sys.argv[1] if len(sys.argv) > 1 else ROOT)
    print(len(found), sorted(found))
