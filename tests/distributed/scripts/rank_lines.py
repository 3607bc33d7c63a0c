"""Every rank prints long lines at once (no print of ddpkit): under a launcher that tees, each
console line must be whole and carry its rank. Also prints what the launcher told it."""
import os
import sys

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
print(f"rank {rank} env WORLD_SIZE={world} LOCAL_RANK={os.environ['LOCAL_RANK']} "
      f"GROUP_RANK={os.environ.get('GROUP_RANK')} args={sys.argv[1:]}", flush=True)
for i in range(int(os.environ.get("LINES", "300"))):
    sys.stdout.write(f"rank {rank} line {i} " + "x" * 300 + "\n")
print(f"rank {rank} to stderr", file=sys.stderr, flush=True)
