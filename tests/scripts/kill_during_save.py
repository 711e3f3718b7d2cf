"""Save two checkpoints with the real save_checkpoint, then SIGKILL this process during a third:
`mid-write` once half of its bytes are on disk, or `before-rename` after the older checkpoints were
shifted down but before the new one was renamed into place.

    python kill_during_save.py OUT_DIR {mid-write,before-rename}
"""
import io
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from machinery.checkpoints import save_checkpoint  # noqa: E402


def state(epoch):
    return {"model": {"w": torch.full((1 << 20,), float(epoch))}, "progress": {"epoch": epoch}}


out_dir, moment = sys.argv[1], sys.argv[2]
for epoch in (1, 2):
    save_checkpoint(out_dir, lambda f: torch.save(state(epoch), f), keep=2)

if moment == "mid-write":
    real_save = torch.save

    def save_half_then_die(obj, f):
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    torch.save = save_half_then_die
else:
    real_replace = os.replace

    def die_before_rename(src, dst):
        if src.endswith(".tmp"):  # the shifts are done; this would put the new checkpoint in place
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)
    os.replace = die_before_rename
save_checkpoint(out_dir, lambda f: torch.save(state(3), f), keep=2)  # torch.save, looked up now: the one above
raise SystemExit("not killed")
