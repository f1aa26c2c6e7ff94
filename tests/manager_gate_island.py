"""A minimal island for tests/test_manager_gate.py: one bridge rank, built by build_manager.

    manager_gate_island.py LIGHTHOUSE REPLICA VALUE STOP_FILE [MIN_REPLICAS]

Builds the manager (LOCAL_ADDR and ARCHIPELAGO_TEST_KEY from the environment), holds a
state {"w": VALUE x 4}, and runs rounds (start_quorum, an allreduce, should_commit) until STOP_FILE exists;
then shuts the manager down and exits 0. Prints one JSON line at the start ({"manager": its
server's address(), "pid"}) and one per round ({"round", "step", "healed", "w",
"recover_src"}, the address the lighthouse gave for healing).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.membership import build_manager
from archipelago.federation.trust import FederationKey


def say(**record: Any) -> None:
    print(json.dumps(record), flush=True)


class Recorder:
    """The manager's client, noting the healing source of each quorum."""

    def __init__(self, client: Any) -> None:
        self._client, self.recover_src, self.heal = client, "", False

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self.recover_src, self.heal = quorum.recover_src_manager_address, bool(quorum.heal)
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def main(lighthouse: str, replica: int, value: float, stop: Path, min_replicas: int = 1) -> None:
    secret = os.environ.get("ARCHIPELAGO_TEST_KEY")
    key = FederationKey(bytes.fromhex(secret)) if secret else None
    ft = FaultToleranceConfig(enable=True, lighthouse=lighthouse, replica_id=replica, min_replica_size=min_replicas,
                              connect_timeout_ms=10000, quorum_timeout_ms=60000, process_group_timeout_ms=20000)
    manager = build_manager(ft, 0, 1, key)
    state = {"w": torch.full((4,), value)}
    manager.register_state_dict_fn("w", lambda loaded: state.update(w=loaded["w"].clone()), lambda: state)
    recorder = manager._client = Recorder(manager._client)
    say(manager=manager._manager.address(), pid=os.getpid())
    rounds = 0
    try:
        while not stop.exists():
            manager.start_quorum()  # a heal is applied here (use_async_quorum=False)
            healed = recorder.heal
            # One collective per round, as the outer loop has: the islands of a quorum move
            # together, so a healing source still serves the step its peer asks for.
            manager.allreduce(torch.zeros(1)).wait()
            manager.should_commit()
            rounds += 1
            say(round=rounds, step=manager.current_step(), healed=healed, w=state["w"].tolist(),
                recover_src=recorder.recover_src, errored=str(manager.errored() or ""))
            time.sleep(0.2)
    finally:
        manager.shutdown(wait=False)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]), *map(int, sys.argv[5:]))
