#!/usr/bin/env python
"""What a small job's start-up costs against the imports every torch training process pays:
the default job (`ddpkit train wine`, 2 local processes) beside a bare `import torch,
torch.distributed`, the same plus `torch._dynamo` (which DDP's constructor and every torch
optimizer's first step import, so the guide's single-process script pays it too) and the
guide's single-process script, run interleaved (A B C D A B C D ...).

    python benchmarks/startup.py [--rounds 5] [--out benchmarks/results/startup.md]

Reports the medians (and ranges) of each command's wall time, ddpkit's start-up as its own
ledger measures it (summary.json's time.seconds.startup: launch to the first step) with its
parts, and the ratios: start-up / bare import, job wall / the guide's script's wall.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

BARE = "import torch, torch.distributed{more}; print('RESULT {{\"imported\": 1}}')"


def _ledger(tmp: str) -> dict:
    """The start-up the run's own ledger measured, and its parts."""
    time = json.loads((Path(tmp) / "run" / "summary.json").read_text())["time"]
    return {"startup_s": time["seconds"]["startup"], "parts": time.get("startup_parts") or {}}


VARIANTS = [
    {"name": "import-torch", "argv": ["{python}", "-c", BARE.format(more="")]},
    {"name": "import-torch+dynamo", "argv": ["{python}", "-c", BARE.format(more=", torch._dynamo")]},
    {
        "name": "ddpkit-wine-2",
        "argv": ["{python}", "-m", "ddpkit", "train", "wine", "--run-dir", "{tmp}/run", "--quiet"],
        "env": {"PYTHONPATH": str(ROOT / "src"), "DDPKIT_BENCH_RESULT": "1"},
        "collect": _ledger,
    },
    {"name": "guide-single", "argv": ["{python}", "benchmarks/baselines/guide_single.py", "--save-dir", "{tmp}/ckpt"]},
]


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(results: list[dict], header: str) -> str:
    by = {v["name"]: [r for r in results if r["name"] == v["name"] and r["ok"]] for v in VARIANTS}
    lines = [header, "", *harness.md_table(
        ("command", "runs", "wall s: median", "min .. max"),
        [(name, len(runs), f"{_median(runs, 'wall_s'):.2f}",
          f"{min(r['wall_s'] for r in runs):.2f} .. {max(r['wall_s'] for r in runs):.2f}")
         for name, runs in by.items() if runs],
    )]  # fmt: skip
    ddpkit = by["ddpkit-wine-2"]
    if not (ddpkit and by["import-torch"] and by["guide-single"]):
        return "\n".join([*lines, "", "not every command ran: see the failures above"])
    startup = _median(ddpkit, "startup_s")
    parts = {k: statistics.median(r["parts"].get(k, 0.0) for r in ddpkit) for k in ddpkit[0]["parts"]}
    bare, dynamo = _median(by["import-torch"], "wall_s"), _median(by["import-torch+dynamo"], "wall_s")
    lines += [
        "",
        f"- ddpkit's start-up (its ledger: launch to the first step), median: {startup:.2f} s = "
        f"{startup / bare:.2f}x `import torch, torch.distributed` ({bare:.2f} s), "
        f"{startup / dynamo:.2f}x the same with torch._dynamo ({dynamo:.2f} s)",
        "- its parts (medians, s): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()),
        f"- the job's wall {_median(ddpkit, 'wall_s'):.2f} s = "
        f"{_median(ddpkit, 'wall_s') / _median(by['guide-single'], 'wall_s'):.2f}x the guide's single-process "
        f"script ({_median(by['guide-single'], 'wall_s'):.2f} s)",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/startup.md"))
    args = ap.parse_args()
    load_before = os.getloadavg()
    results = harness.alternate(VARIANTS, args.rounds, cwd=str(ROOT), timeout=300)
    measured = harness.measured(load_before, os.getloadavg())
    header = f"# Start-up of the default job\n\n{harness.machine('cpu')}. {measured}."
    text = report(results, header)
    failed = [r for r in results if not r["ok"]]
    text += "".join(f"\n\nFAILED {r['name']}: rc={r['rc']} {r.get('error', '')[:300]}" for r in failed)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
