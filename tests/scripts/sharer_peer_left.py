"""A loader worker's fd-sharing thread (multiprocessing's resource_sharer) whose rank leaves mid-handshake:
tests/unit/test_stop_request.py. argv[1]: "worker" (deaf_to_stop_signals, a loader worker's worker_init_fn, first)
or "plain". Prints the thread's address, waits for a line on stdin (the parent connected and left), then stops the
thread, which handles connections in order: the broken one first."""
import os
import sys
from multiprocessing import resource_sharer

from machinery.loader_workers import deaf_to_stop_signals

if sys.argv[1] == "worker":
    deaf_to_stop_signals()
shared = resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))  # starts the thread, as a batch's storage does
print(shared._id[0], flush=True)  # (address, key)
sys.stdin.readline()
resource_sharer.stop()
