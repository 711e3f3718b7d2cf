"""machinery.files.describe_write_failure: each reason a write fails for (errno) gets its own words and
its own way out, in the one line a failed write ends the run with."""
import errno
import os

import pytest

from machinery.files import describe_write_failure


@pytest.mark.parametrize("code,reason,way_out", [
    (errno.EDQUOT, "disk quota exceeded", "free space under your quota (or use another --out-dir)"),
    (errno.EACCES, "permission denied", "make {d} writable for you"),
    (errno.ENOENT, "no such file or directory",
     "{d}, or a file in it, was removed while the run wrote there"),
    (errno.EIO, "input/output error", "the filesystem failed"),
])
def test_each_reason_of_a_failed_write_has_its_way_out(tmp_path, code, reason, way_out):
    line = describe_write_failure(OSError(code, os.strerror(code)), "the checkpoint after epoch 3",
                                  str(tmp_path))
    assert line.startswith(f"{reason} writing the checkpoint after epoch 3 in {tmp_path}; no checkpoint was "
                           f"written yet: ")
    assert way_out.format(d=tmp_path) in line and line.endswith(", then run the same command to resume")
