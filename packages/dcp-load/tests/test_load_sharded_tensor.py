"""torch's sharded tensor module stays unimported by a save and load of plain tensors: dcp
recognises a ShardedTensor only where that module is already loaded
(``layouts/_sharded.py``). Multi-rank behaviour: tests-integration/load/test_integ_sharded_tensor.py."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, tempfile, torch, dcp_load
path = tempfile.mkdtemp()
dcp_load.save({"a": torch.ones(2)}, checkpoint_id=path, no_dist=True)
state = {"a": torch.zeros(2)}
dcp_load.load(state, checkpoint_id=path, no_dist=True)
assert state["a"].tolist() == [1.0, 1.0], state
print(sorted(m for m in sys.modules if "sharded_tensor" in m))
"""


def test_plain_save_and_load_leave_the_sharded_tensor_module_unimported():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_is_sharded_tensor_is_false_for_plain_tensors():
    import torch
    from dcp_load.layouts._sharded import is_sharded_tensor

    assert not is_sharded_tensor(torch.ones(2)) and not is_sharded_tensor(3)
