"""A rogue torchft replica, for tests: it holds no federation key, claims step 10^9 (so
torchft would make it every other island's healing source), and serves, through torchft's
own pickling transport, a state whose unpickling creates MARKER. It asks for a quorum
every half second; if one ever admits it, it writes the quorum's size to JOINED.

usage: python rogue_island.py LIGHTHOUSE_URL MARKER JOINED
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path


class Payload:
    """Unpickling this runs `open(path, "w")`: code of the rogue's choosing on the loader."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def main(url: str, marker: str, joined: str) -> None:
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    seconds = timedelta(seconds=5)
    manager = Manager(pg=ProcessGroupGloo(timeout=seconds), load_state_dict=lambda state: None,
                      state_dict=lambda: {"payload": Payload(marker)}, min_replica_size=1,
                      use_async_quorum=False, timeout=seconds, quorum_timeout=seconds, connect_timeout=seconds,
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=url, replica_id="island_2", hostname="127.0.0.1")
    manager.load_state_dict({"step": 10**9, "batches_committed": 0})
    while True:
        try:
            manager.start_quorum()
        except Exception as exc:  # noqa: BLE001 - refused: try again, as a determined rogue would
            print(f"rogue: no quorum: {str(exc)[:200]}", flush=True)
            time.sleep(0.5)
            continue
        Path(joined).write_text(str(manager.num_participants()))
        manager.allreduce(torch.zeros(4)).wait()
        manager.should_commit()


if __name__ == "__main__":
    main(*sys.argv[1:4])
