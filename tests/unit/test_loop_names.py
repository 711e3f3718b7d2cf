"""The training loop a reader learns DDP from (train_ddp.py's train, train_one_epoch and train_step) uses at most 20
distinct names the project defines elsewhere, which a reader must look up in another file: the rest is torch's,
Python's, or train_ddp.py's own (train_step, evaluate, build_training, ...: read in place).

How they are counted: an ast walk over the three functions; each name used (called, or passed on as an argument),
bare (`log_start`) or as an attribute (`utils.log_start`, `step_log.mark`), counts once if the project's other
modules (the top level and machinery/; tests and tools aside) define a function, method or class of that name and
train_ddp.py does not, unless it is reached from torch (`torch.`, `dist.`, `nn.`) or from a local that holds a torch
object (the model, its optimizer, scaler, loss, tensors), whose methods are torch's even where the project has one
of the same name. At commit 92a1a6a this counted 35 (`PYTHONPATH=tests python tests/unit/test_loop_names.py ROOT` lists them)."""
import ast
import os
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


def test_the_training_loop_uses_at_most_20_names_the_project_defines():
    names = loop_names()
    assert len(names) <= 20, sorted(names)


if __name__ == "__main__":  # PYTHONPATH=tests python tests/unit/test_loop_names.py [ROOT]: the names, counted
    found = loop_names(sys.argv[1] if len(sys.argv) > 1 else ROOT)
    print(len(found), sorted(found))
