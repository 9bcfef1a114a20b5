"""The kill-and-resume harness at 20 kills, with the torch engine and with vLLM in process (one table).

Each run: ``--kills`` ``molt fit`` processes, each SIGKILLed at a random instant after it trained two steps (at the
latest at its fence after four), one that finishes the run, one that resumes the finished run; then the audit
(``SampleAudit``) is accounted for (tests/helpers/kill_harness.py). Columns: processes launched and on record,
starts with a checkpoint (s > 0), steps retrained after a kill, prompts lost and repeated after replay, torn audit
lines, child processes alive 60 s after their trainer's kill, wall time.

    python benchmarks/kill_resume.py [--kills 20] [--seed 0] [--engines torch,vllm]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
import kill_harness  # noqa: E402

ENGINES = {"torch": kill_harness.TORCH, "vllm": kill_harness.VLLM}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", default="torch,vllm")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    for name in args.engines.split(","):
        with tempfile.TemporaryDirectory() as folder:
            t0 = time.time()
            got = kill_harness.kill_and_resume(Path(folder), args.kills, args.seed, ENGINES[name], timeout=400)
            steps = kill_harness.steps_for(args.kills)
            rows.append((name, got["kills"], f"{got['launches']}/{len(got['starts'])}",
                         sum(s > 0 for s in got["starts"]), f"{steps}{'' if got['steps_in_order'] else ' (gaps!)'}",
                         got["retrained"], got["lost"], got["repeated"], got["torn"], got["orphans"],
                         f"{time.time() - t0:.0f}"))
            print(f"{name}: {rows[-1]}", flush=True)
    head = ("engine", "kills", "launched/started", "resumed", "steps", "retrained", "lost", "repeated", "torn",
            "orphans", "wall s")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
