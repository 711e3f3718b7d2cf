"""Imported by every Python process the tests start (conftest's pytest_configure puts this folder first on
PYTHONPATH; support.python_path keeps it there when a test sets its own), but the runs that are a user's
command as written (support.run_env's fast_exit=False).

The process's last act, after every other atexit handler, is gc.freeze(): every object moves to the garbage
collector's permanent generation, so the collections of the interpreter's finalization skip them. With torch
and torch._dynamo loaded those collections cost about a CPU-second per process (measured in a1f2dc4's
commit), and in one run of the suite about 180 such processes end normally
(launchers, ranks, jobs, tools) on two cores. What a run does is untouched: its records, checkpoint and last line
are written before the atexit handlers run, and objects are still freed when their last reference goes; only
reference cycles left at the very end are not collected, which Python never promises to do at exit. It shadows
a sitecustomize of the interpreter's own (Debian's and Ubuntu's install a crash reporter's hook), which no test
needs."""
import atexit
import gc

atexit.register(gc.freeze)  # registered as the interpreter starts, before the script's own: so run last
