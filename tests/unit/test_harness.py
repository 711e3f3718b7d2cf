"""The test harness itself, where a mistake would not fail a test but silently cost the suite its time, or
hide what a user's run does at its exit."""
import os
import subprocess
import sys

from support import ROOT, python_path, run_env

# A reference cycle whose finalizer says so, made by the script's own exit handler: only a garbage
# collection can end it, and the interpreter's collections at exit do, unless tests/fast_exit's gc.freeze
# runs after that handler.
CYCLE = ("import atexit\n"
         "class C:\n    def __del__(self): print('collected')\n"
         "def at_exit():\n    c = C(); c.me = c\n"
         "atexit.register(at_exit)\n")


def exit_collects(env) -> bool:
    proc = subprocess.run([sys.executable, "-c", CYCLE], capture_output=True, text=True, check=True, env=env,
                          cwd=ROOT)
    return proc.stdout == "collected\n"


def test_a_launch_s_environment_skips_the_final_collections_unless_it_asks_for_a_user_s_exit():
    assert exit_collects({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})  # the interpreter's own
    # every launch (launch, launch_forked, start), with or without a PYTHONPATH of the test's own, and a
    # process a test starts with python_path
    for env in (run_env(2), run_env(1, {"PYTHONPATH": ROOT}), {**os.environ, "PYTHONPATH": python_path(ROOT)}):
        assert not exit_collects(env), env["PYTHONPATH"]
    # the runs that are a user's command as written
    for env in (run_env(2, fast_exit=False), run_env(1, {"PYTHONPATH": ROOT}, fast_exit=False)):
        assert exit_collects(env), env.get("PYTHONPATH")
