"""The cluster drill as a new user runs it (issue 36's bar): `trajbus demo --nodes 3` again and
again on a local 3-node cluster, with one node SIGKILLed (`trajbus kafka kill-node N`, started
again 10 s later) or a graceful rolling restart (`stop-node`/`start-node` one at a time) at a
random moment of every run, from another process, exactly as the README tells an operator.
A run passes when the demo exits 0 (its own exact check passed) and printed no traceback.

    .venv/bin/python tests/cluster_demo_drill.py --runs 20       # ~25 minutes on 2 cores

Results: one JSON line per run in <work>/drill.jsonl and a table at the end; exit 1 if any run
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from trajbus.infra.ports import ephemeral_ports

NOISE = ("Traceback (most recent call last)", "Task exception was never retrieved",
         "Exception ignored in")


def _free_base() -> int:
    """A base port with the 6 ports after it free (3 nodes x client + controller), below the
    kernel's ephemeral range (where any outgoing connection may take a port meanwhile)."""
    top = max(20_006, ephemeral_ports()[0]) - 6
    for _ in range(200):
        base = random.randint(20_000, top)
        ok = True
        for port in range(base, base + 6):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no 6 consecutive free ports")


def _trajbus(work: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trajbus", *args], cwd=work, text=True,
                          capture_output=True, timeout=timeout, check=False)


def _chaos(work: Path, kind: str, at: float, node: int, log: list[str]) -> None:
    time.sleep(at)
    t0 = time.monotonic()
    if kind == "kill":
        out = _trajbus(work, "kafka", "kill-node", str(node))
        log.append(f"{at:.1f}s: kill-node {node} (rc {out.returncode})")
        time.sleep(10)
        out = _trajbus(work, "kafka", "start-node", str(node))
        log.append(f"start-node {node} (rc {out.returncode}) after "
                   f"{time.monotonic() - t0:.1f}s")
    else:
        for n in (1, 2, 3):
            a = _trajbus(work, "kafka", "stop-node", str(n))
            b = _trajbus(work, "kafka", "start-node", str(n))
            log.append(f"rolling: node {n} stop rc {a.returncode}, start rc {b.returncode}")
        log.insert(0, f"{at:.1f}s: rolling restart, {time.monotonic() - t0:.1f}s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--sandboxes", type=int, default=40)
    ap.add_argument("--episodes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--work", type=Path, default=Path(".trajbus") / "drill")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    rng = random.Random(seed)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.pop("TRAJBUS_KAFKA__BOOTSTRAP_SERVERS", None)
    up = _trajbus(work, "kafka", "up", "--nodes", "3", "--port", str(_free_base()))
    print(up.stdout, up.stderr, flush=True)
    if up.returncode != 0:
        return 1
    results = []
    try:
        for i in range(args.runs):
            kind = rng.choice(["kill", "kill", "rolling"])
            at, node = rng.uniform(3.0, 25.0), rng.randint(1, 3)
            log: list[str] = []
            chaos = threading.Thread(target=_chaos, args=(work, kind, at, node, log))
            t0 = time.monotonic()
            chaos.start()
            demo = _trajbus(work, "demo", "--nodes", "3", "--sandboxes", str(args.sandboxes),
                            "--episodes", str(args.episodes), "--seed", str(seed + i),
                            timeout=900)
            chaos.join()
            out = demo.stdout + demo.stderr
            noisy = [n for n in NOISE if n in out]
            ok = demo.returncode == 0 and not noisy
            results.append({"run": i + 1, "seed": seed + i, "ok": ok, "rc": demo.returncode,
                            "noise": noisy, "chaos": log,
                            "seconds": round(time.monotonic() - t0, 1),
                            # the summary (stdout) says which check failed; stderr the rest
                            "summary": "" if ok else demo.stdout[-6000:],
                            "stderr_tail": "" if ok else demo.stderr[-3000:]})
            with (work / "drill.jsonl").open("a") as f:
                f.write(json.dumps(results[-1]) + "\n")
            print(f"[drill] run {i + 1}/{args.runs}: {'PASS' if ok else 'FAIL'} "
                  f"rc {demo.returncode} {results[-1]['seconds']}s; {'; '.join(log)}"
                  + (f"; noise {noisy}" if noisy else ""), flush=True)
            if not ok:
                problems = demo.stdout[demo.stdout.find("PROBLEMS"):] if "PROBLEMS" in \
                    demo.stdout else demo.stdout[-3000:]
                print(problems[:4000], demo.stderr[-1500:], flush=True)
    finally:
        _trajbus(work, "kafka", "down")
    passed = sum(r["ok"] for r in results)
    print(f"=== drill: {passed}/{len(results)} demo runs exit 0 without a traceback ===")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
