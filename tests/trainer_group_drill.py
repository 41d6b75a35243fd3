"""The trainer-group drill (issue 41, item 2), N runs: two or three trainers of one group join
and leave at random moments while live replay segments are written at 1,000-2,000 events/s;
each run is checked against the producer's manifest (tests/trainer_group.py says what).

    .venv/bin/python tests/trainer_group_drill.py --runs 10      # ~1 minute a run, 2 cores

Runs alternate two and three members (``--members 2,3``), async, sync and mixed clients
(``--kinds``), per-ack and coalesced commits (``--commit-every-ms 0,100``), at a rate drawn
from ``--rates`` (default 1000-2000). A local broker is started unless ``--bootstrap`` names
one. One JSON line per run in ``--out`` (default trainer_group_drill.jsonl), a table at the
end; exit 1 if any run failed a check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from support import settings_for
from trainer_group import failed, run_group, summary

from trajbus.infra.broker import LocalBroker, free_port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--members", default="2,3")
    ap.add_argument("--kinds", default="async,sync,mixed")
    ap.add_argument("--commit-every-ms", default="0,100")
    ap.add_argument("--rates", default="1000-2000")
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0, help="0: random")
    ap.add_argument("--bootstrap", default=None)
    ap.add_argument("--out", default="trainer_group_drill.jsonl")
    args = ap.parse_args()
    members = [int(x) for x in args.members.split(",")]
    kinds = args.kinds.split(",")
    commits = [float(x) for x in args.commit_every_ms.split(",")]
    lo, _, hi = args.rates.partition("-")
    seed = args.seed or random.randrange(1, 1_000_000)
    rng = random.Random(seed)
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        broker = LocalBroker(data_dir=Path(tempfile.mkdtemp(prefix="group-drill-")),
                             port=free_port(), controller_port=free_port())
        broker.start(timeout=120)
        bootstrap = broker.bootstrap
    reports = []
    try:
        for i in range(args.runs):
            run_seed = rng.randrange(1, 1_000_000)
            settings = settings_for(bootstrap, f"drill-{uuid.uuid4().hex[:8]}", partitions=4)
            report = asyncio.run(run_group(
                settings, members=members[i % len(members)], seed=run_seed,
                rate=rng.randint(int(lo), int(hi or lo)), duration_s=args.duration_s,
                kind=kinds[i % len(kinds)], commit_every_ms=commits[(i // 2) % len(commits)]))
            reports.append(report)
            with open(args.out, "a") as f:
                f.write(json.dumps(report) + "\n")
            print(summary([report], first=i + 1, head=i == 0), flush=True)
    finally:
        if broker is not None:
            broker.stop(timeout=30)
    print(f"\nseed {seed}")
    print(summary(reports))
    return 1 if any(failed(r) for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
