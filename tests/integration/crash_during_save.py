"""train.py, except that rank 0 dies (os._exit, like a kill) right after writing its shard of
the checkpoint whose folder name contains $CRASH_IN_SAVE — between the shard writes and
the completion mark. Used by test_checkpoint_resume.py."""

import os
import sys

import torch.distributed.checkpoint.filesystem as filesystem

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import train  # noqa: E402

_write_data = filesystem.FileSystemWriter.write_data


def _write_then_die(self, plan, planner):
    written = _write_data(self, plan, planner)
    if os.environ["CRASH_IN_SAVE"] in str(self.path) and int(os.environ.get("RANK", "0")) == 0:
        written.wait()
        os._exit(17)
    return written


filesystem.FileSystemWriter.write_data = _write_then_die

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
