"""Node topology from keys and the environment, without numpy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aiak.comm.env import node_key
from aiak.comm.topology import Topology

# ------------------------------------------------------------------------------------------
# topology
# ------------------------------------------------------------------------------------------


def test_topology_from_keys():
    t = Topology(["group:0", "group:0", "group:1", "group:1"], rank=2, local_world_size=2)
    assert t.nodes == ((0, 1), (2, 3)) and t.local_rank == 0 and t.homogeneous
    assert t.inter_ranks(1) == (1, 3)
    assert not t.crosses((0, 1, 2, 3))  # rank 2 sends to 3, same node
    assert t.crosses((0, 1, 2))  # rank 2 wraps around to 0, across the link
    assert Topology(["a", "a", "b", "b"], rank=1).crosses((0, 1, 2, 3))  # 1 -> 2 leaves node
    assert Topology(["a", "a", "b"], rank=0).homogeneous is False


def test_topology_local_world_size_mismatch_is_an_error():
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=2"):
        Topology(["group:0", "group:0", "group:0", "group:1"], rank=0, local_world_size=2)


def test_node_key_env():
    assert node_key({"GROUP_RANK": "3", "LOCAL_WORLD_SIZE": "8"}) == "group:3"
    assert node_key({}).startswith("host:")
    with pytest.raises(ValueError, match="GROUP_RANK"):
        node_key({"GROUP_RANK": "-1"})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        node_key({"LOCAL_WORLD_SIZE": "eight"})


def test_topology_needs_no_numpy() -> None:
    # torch does not require numpy; all_gather_object does: without numpy the topology must
    # still be found.
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import socket, torch.distributed as dist\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, "
        "world_size=1)\n"
        "from aiak.comm.topology import topology\n"
        "t = topology(); assert t.nodes == ((0,),), t\n"
        "dist.destroy_process_group()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
