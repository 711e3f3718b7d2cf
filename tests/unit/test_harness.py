"""The test harness itself, where a mistake would not fail a test but silently cost the suite its time."""
import os
import subprocess
import sys

from support import ROOT, python_path, run_env

# A reference cycle whose finalizer says so: only a garbage collection can end it, and the interpreter's
# own collections at exit do, unless tests/fast_exit's gc.freeze ran first.
CYCLE = "class C:\n def __del__(self): print('collected')\nc = C(); c.me = c; del c\n"


def test_every_process_the_tests_start_skips_the_final_garbage_collections():
    without = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    plain = subprocess.run([sys.executable, "-c", CYCLE], capture_output=True, text=True, check=True, env=without)
    assert plain.stdout == "collected\n"  # the interpreter's exit collects it
    for env in (run_env(2), run_env(1, {"PYTHONPATH": ROOT}), {"PYTHONPATH": python_path(ROOT)}):
        fast = subprocess.run([sys.executable, "-c", CYCLE], capture_output=True, text=True, check=True,
                              env=env, cwd=ROOT)
        assert fast.stdout == "", env["PYTHONPATH"]
