"""What the README's set-up (pip install -e .) puts on the environment's import path: the dependencies, and none of
the project's modules, so that another project in the same environment keeps its own config, model, tools, ..."""
import os
import subprocess
import sys

PROJECT_NAMES = ["config", "transforms", "tools", "machinery", "utils", "model", "bench", "plot", "preflight",
                 "train_ddp", "dataset_utils", "train_utils"]


def test_the_set_up_installs_no_module_of_the_project_for_other_directories(tmp_path):
    # this interpreter is the set-up's (CI: .venv after pip install -e '.[test]'), started elsewhere, its
    # PYTHONPATH cleared: what it imports there is what the install put on its path
    code = ("import importlib.util, json, sys; "
            f"print(json.dumps([m for m in {PROJECT_NAMES!r} if importlib.util.find_spec(m)]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out
    deps = subprocess.run([sys.executable, "-c", "import torch, torchvision, numpy"], cwd=tmp_path, env=env)
    assert deps.returncode == 0  # the dependencies are there
