"""A peer runner that follows scripts/peers' contract without an engine: tests/worker/test_peers.py drives it.

It uses scripts/peers/peer_common.py (command line, workload, count check, report), so the real
shared code runs, and "generates" token t of a request as (last prompt id + t) % 1000. FAKE_PEER_MODE:
  ok       the contract
  short    one request one token short, through peer_common's check (which fails the run, exit 3)
  lie      one request one token short, report and tokens written around the check (exit 0)
  slow     start a child (its pid in FAKE_PEER_PID_FILE) and sleep past any timeout
  diverge  request 0 differs from token 8 on (for the agreement checks)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "peers"))

from peer_common import convert_atomically, parser, read_workload, report, require_run_args  # noqa: E402


def main() -> None:
    ap = parser("fake peer")
    args = ap.parse_args()
    require_run_args(ap, args)
    if args.convert:
        convert_atomically(args.out, lambda tmp: (tmp / "converted-from").write_text(args.convert))
        return
    mode = os.environ.get("FAKE_PEER_MODE", "ok")
    if mode == "slow":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        Path(os.environ["FAKE_PEER_PID_FILE"]).write_text(str(child.pid))
        time.sleep(600)
    if (Path(args.model) / "converted-from").read_text() == "":
        raise SystemExit("the model is no converted folder")
    workload = read_workload(args.workload)
    outputs = [[(p[-1] + t) % 1000 for t in range(m)] for p, m in zip(workload.prompts, workload.max_tokens, strict=True)]
    if mode == "diverge":
        outputs[0][8:] = [999] * (len(outputs[0]) - 8)
    if mode in ("short", "lie"):
        outputs[1] = outputs[1][:-1]
    if mode == "lie":
        Path(args.report).write_text(json.dumps({"engine": "fake", "elapsed_s": 1.0, "load_s": 0.5}))
        Path(args.dump_tokens).write_text(json.dumps({"id": workload.ids, "output_token_ids": outputs}))
        return
    report(args, workload, outputs, 2.0, 0.25, {"engine": "fake", "threads": args.threads, "mode": mode})


if __name__ == "__main__":
    main()
