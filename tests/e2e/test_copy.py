"""The README's copy line, as a copier runs it: into a git repository of their own that already holds its own config.py,
transforms.py, utils/ and tools/, then the copy run where it landed, with nothing of this project installed or on
PYTHONPATH: plain python from the repository's root and from another directory, and torchrun on 2 ranks (stopped
mid-epoch, resumed, evaluated), its ADAPT place importing the repository's own modules."""
import ast
import hashlib
import os
import re
import subprocess
import sys

from support import ROOT, TINY, run_env

# The repository's own files, of the names a project commonly has: the copy must leave them and their imports alone.
REPO_FILES = {
    "config.py": "TRAIN_SIZE = 96\nTEST_SIZE = 40\n",
    "transforms.py": "REPO_TRANSFORMS = True  # the repository's own transforms module\n",
    "utils/__init__.py": "def describe(path):\n    return f'synthetic, read through {path}'\n",
    "tools/__init__.py": '"""The repository\'s own tools."""\n',
    "tools/plotting.py": "def plot():\n    return None\n",
}
# ADAPT (2/6) as a copier writes it: the repository's config, transforms and utils, imported from the copy; its Data
# line names the dataset_utils the copy imported.
LOAD_DATA = '''
def load_data(cfg, env, train: bool = True):
    """Synthetic data, sized by the repository's config.py and named by its utils package."""
    import config  # the repository's own modules, not the copy's
    import transforms
    import utils
    assert transforms.REPO_TRANSFORMS

    def split(is_train, size):
        data = dataset_utils.load_split("synthetic", cfg.data_dir, is_train, size)
        data.source = utils.describe(dataset_utils.__file__)
        return data
    return (split(True, config.TRAIN_SIZE) if train else None), split(False, config.TEST_SIZE)
'''
RUN = [*TINY, "--batch-size", 16, "--log-every", 0]


def readme_copy_line() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = text.split("<!-- the copy: the tests run exactly this line -->", 1)[1]
    (line,) = block.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    return line


def import_closure(folder: str, start: str) -> set:
    """The .py files under `folder` that `start` imports, directly or through them, anywhere in a file."""
    def resolve(name):
        base = os.path.join(folder, *name.split("."))
        return next((p for p in (base + ".py", os.path.join(base, "__init__.py")) if os.path.exists(p)), None)
    seen, todo = set(), [os.path.join(folder, start)]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(open(path).read())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                     if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                todo += [p for p in (resolve(name), resolve(name.split(".")[0])) if p]
    return {os.path.relpath(p, folder) for p in seen}


def run(cmd, cwd, nproc=1, env=None, check=True):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=run_env(nproc, env), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 or not check, f"{cmd} in {cwd}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_the_readme_copy_line_lands_in_a_repository_and_runs_there_clashing_with_nothing(tmp_path):
    assert ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep)  # the copy alone, not this project
    repo = tmp_path / "repo"
    for name, text in REPO_FILES.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    subprocess.run(["git", "init", "-q", repo], check=True)
    subprocess.run(["bash", "-c", readme_copy_line()], cwd=ROOT, env={**os.environ, "REPO": str(repo)}, check=True)

    # What it took: the files a training run imports, and nothing else.
    copied = {os.path.relpath(os.path.join(d, f), repo / "ddp") for d, _, files in os.walk(repo / "ddp")
              for f in files if f.endswith(".py")}
    assert copied == import_closure(str(repo / "ddp"), "train_ddp.py"), copied ^ import_closure(str(repo / "ddp"),
                                                                                               "train_ddp.py")
    script = repo / "ddp" / "train_ddp.py"
    src = script.read_text()
    start = src.index("\ndef load_data(") + 1
    end = re.compile(r"^\S", re.M).search(src, src.index("\n", start) + 1).start()
    script.write_text(src[:start] + LOAD_DATA.strip("\n") + "\n\n\n" + src[end:])
    data_line = f"Data: synthetic, read through {repo / 'ddp' / 'dataset_utils.py'}: 96 training and 40 test images"

    # plain python from the repository's root, then from another directory
    proc = run([sys.executable, "ddp/train_ddp.py", *RUN, "--epochs", 1, "--out-dir", "runs/plain"], cwd=repo)
    assert data_line in proc.stdout and "Training completed successfully." in proc.stdout, proc.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run([sys.executable, script, *RUN, "--epochs", 1, "--out-dir", "runs/elsewhere"], cwd=elsewhere)
    assert data_line in proc.stdout and (elsewhere / "runs" / "elsewhere" / "checkpoint.pt").exists()

    # torchrun, 2 ranks: stopped mid-epoch 1 (the stop file, seen at step 2's checkpoint), resumed, evaluated
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "ddp/train_ddp.py", *RUN, "--epochs", 2, "--out-dir", "runs/two"]
    stop_file = tmp_path / "stop"
    stop_file.touch()
    proc = run([*torchrun, "--checkpoint-every", 2], cwd=repo, nproc=2, env={"DDP_STOP_FILE": str(stop_file)},
               check=False)
    assert proc.returncode != 0 and "Stop requested" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    stop_file.unlink()
    proc = run(torchrun, cwd=repo, nproc=2)
    assert "Resumed from" in proc.stdout and "Training completed successfully." in proc.stdout, proc.stdout
    trained = re.findall(r"Validation Accuracy: ([\d.]+)", proc.stdout)[-1]
    proc = run([*torchrun, "--evaluate"], cwd=repo, nproc=2)
    assert f"Validation Accuracy: {trained}" in proc.stdout, proc.stdout

    # The repository's own files are as they were, and the copy added nothing but ddp/ and the runs.
    for name, text in REPO_FILES.items():
        assert hashlib.sha256((repo / name).read_bytes()).digest() == hashlib.sha256(text.encode()).digest(), name
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=normal"], cwd=repo,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    assert sorted(line for line in status if line) == sorted(
        ["?? config.py", "?? ddp/", "?? runs/", "?? tools/", "?? transforms.py", "?? utils/"]), status
