"""Run every benchmark under bench/ in one go and write BENCHMARKS.md.

    .venv/bin/python bench/run_all.py [--quick] [--only NAME ...]

``--only`` re-runs some benchmarks and keeps the others' last results (bench/results/all.json):
each section of BENCHMARKS.md says when it ran and under which load.

Starts its own Kafka broker (free port, temporary data directory) for the benchmarks that need
one, so peers and trajbus are measured side by side on the same broker in the same run. Each
benchmark writes a JSON file to bench/results/; this script turns them into BENCHMARKS.md with
the machine, the date and the targets table, then one line per section of bench/ANALYSIS.md
(the profiles behind the figures and the limits of the missed targets, written by hand) linking
to it, then one line per benchmark linking to its every metric in bench/results/NAME.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_watchdog import reference_ms

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# name -> (script, args for a full run, args for --quick, needs a broker)
BENCHES: dict[str, tuple[str, list[str], list[str], bool]] = {
    "emitter": ("bench_emitter.py", [], ["--small-count", "30000", "--large-count", "200"], True),
    "reorder": ("bench_reorder.py", [], ["--episodes", "5000", "--repeat", "1"], False),
    "watchdog": ("bench_watchdog.py", [], ["--sandboxes", "2000", "--repeat", "1"], False),
    "scheduler": ("bench_scheduler.py", [], ["--repeat", "1"], False),
    # a what-if run (issue 40): the cores re-run over a synthetic recorded log, no broker
    "whatif": ("bench_whatif.py", [], ["--sandboxes", "300", "--repeat", "1"], False),
    "archive": ("bench_archive.py", [], ["--events", "1000000", "--throughput-events",
                                         "200000", "--hour-events", "200000"], False),
    "archive_freshness": ("bench_archive_freshness.py", [], ["--minutes", "15"], False),
    # the episodes table (every `archive sql`): DuckDB arithmetic vs the rules in Python
    "archive_episodes": ("bench_archive_episodes.py", ["--episodes", "10000", "100000",
                                                       "1000000"],
                         ["--episodes", "10000", "100000"], False),
    "e2e": ("bench_e2e.py", [], ["--events", "15000", "--seconds", "8",
                                 "--overlap-episodes", "4"], True),
    "worker": ("bench_worker.py", [], ["--events", "15000", "--repeat", "1"], True),
    "recovery": ("bench_recovery.py", [], ["--episodes", "2000", "--repeat", "1"], True),
    "many_emitters": ("bench_many_emitters.py", [], ["--seconds", "10", "--warmup", "3"], True),
    "restore_history": ("bench_restore_history.py", [], ["--hours", "0.5", "--episodes", "5000",
                                                         "--repeat", "1"], False),
    "rebalance": ("bench_rebalance.py", [], ["--episodes", "3000", "--steady", "10", "--hold",
                                             "12", "--window", "8"], True),
    # the trainer client's commit styles (issue 41): per-ack vs coalesced, catch-up events/s
    "trainer_commit": ("bench_trainer_commit.py", [], ["--episodes", "300", "--repeat", "1"],
                       True),
    # its own 3-node cluster: the failover of a replicated cluster is what it measures
    "failover": ("bench_failover.py", [], ["--rounds", "2"], False),
}


def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "unknown"
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu, "cores": str(os.cpu_count()), "memory": mem,
        # hosts differ from run to run: the watchdog bench's reference, measured now
        "CPU calibration at this run": f"`sum(range(10**6))` takes {reference_ms()} ms of "
                                       "CPU (best of 5)",
        "python": platform.python_version(), "os": platform.platform(),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def run(names: list[str], quick: bool) -> dict[str, Any]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    broker = None
    bootstrap = ""
    results: dict[str, Any] = {"_machine": machine()}  # load average before any benchmark
    try:
        if any(BENCHES[n][3] for n in names):
            from trajbus.infra.broker import LocalBroker, free_port

            broker = LocalBroker(data_dir=Path(tempfile.mkdtemp(prefix="bench-kafka-")),
                                 port=free_port(), controller_port=free_port(), heap="1g")
            broker.start(timeout=120)
            bootstrap = broker.bootstrap
        for name in names:
            script, full, short, needs_broker = BENCHES[name]
            if not (ROOT / "bench" / script).exists():
                results[name] = {"skipped": f"bench/{script} does not exist yet"}
                continue
            out = RESULTS / f"{name}.json"
            out.unlink(missing_ok=True)
            cmd = [sys.executable, f"bench/{script}", "--json", str(out)]
            cmd += (short if quick else full)
            if needs_broker:
                cmd += ["--bootstrap", bootstrap]
            print(f"[bench] {name}: {' '.join(cmd[1:])}", flush=True)
            started = time.monotonic()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
            took = time.monotonic() - started
            print(proc.stdout.strip()[-2000:], flush=True)
            data: dict[str, Any] = {}
            if out.exists():
                data = json.loads(out.read_text())
            if proc.returncode not in (0, 1) or not data:
                data = {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-1500:]}
            command = " ".join(["python", *cmd[1:]])
            # (no shared broker when only self-contained benchmarks run: "" must not be replaced)
            data["_command"] = command.replace(bootstrap, "$BROKER") if bootstrap else command
            data["_seconds"] = round(took, 1)
            data["_ran_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            data["_load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
            results[name] = data
    finally:
        if broker is not None:
            broker.stop()
    return results


def _flatten(prefix: str, value: Any, rows: list[tuple[str, str]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not str(k).startswith("_"):
                _flatten(f"{prefix}.{k}" if prefix else str(k), v, rows)
    elif isinstance(value, list):
        if len(value) <= 6 and all(not isinstance(v, dict | list) for v in value):
            rows.append((prefix, ", ".join(map(str, value))))
        else:
            for i, v in enumerate(value[:12]):
                _flatten(f"{prefix}[{i}]", v, rows)
    else:
        if isinstance(value, float):
            text = f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
        elif isinstance(value, int) and not isinstance(value, bool):
            text = f"{value:,}"
        else:
            text = str(value)
        rows.append((prefix, text))


def _finished_now() -> dict[str, str]:
    return {"at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def write_markdown(results: dict[str, Any], quick: bool) -> str:
    # A re-render (--render) keeps the run's own end time and load, not the moment of rendering.
    finished = results.get("_finished") or _finished_now()
    lines = ["# trajbus benchmarks", "",
             f"Generated by `make bench` (`python bench/run_all.py{' --quick' if quick else ''}`)"
             f" on {finished['at']}.", "",
             "## Machine", ""]
    for k, v in (results.get("_machine") or machine()).items():
        lines.append(f"- {k}: {v}")
    lines.append(f"- load average at end: {finished['load']}")
    ref = results.get("watchdog", {}).get("reference_ms")
    if ref:
        lines.append(f"- CPU calibration at the watchdog bench's run (its section says when): "
                     f"`sum(range(10**6))` took {ref} ms of CPU (~8-12 ms on a current, idle x86 "
                     f"core): absolute per-core figures of that run are ~{ref / 10:.1f}x "
                     "pessimistic; a section run at another time (`--only`) may have run on "
                     "another host: compare with the calibration at this run above")
    lines += ["", "Figures come from one run on a shared 2-core machine (other engineers' test "
              "suites run concurrently: see the load averages); peers (Kafka's "
              "ProducerPerformance, confluent-kafka, raw pyarrow) run in the same invocation "
              "against the same broker or files, so the **ratios** are the figures to compare. "
              "SCALING.md turns the per-core figures into a deployment.", ""]
    summary = [r for r in (_summary(name, data) for name, data in results.items()
                           if not name.startswith("_")) if r]
    if summary:
        lines += ["## Targets", "", "| benchmark | measure | result | target | met |",
                  "| --- | --- | --- | --- | --- |"]
        for target_rows in summary:
            lines += [f"| {' | '.join(row)} |" for row in target_rows]
        lines.append("")
    analysis = ROOT / "bench" / "ANALYSIS.md"
    if analysis.exists():  # the profiles and the limits, kept by hand next to the benchmarks
        lines += ["## Analysis", "",
                  "What limits each figure, A/B runs and profiles: "
                  "[bench/ANALYSIS.md](bench/ANALYSIS.md), newest first where dated.", ""]
        for title, gist in analysis_sections(analysis.read_text()):
            lines.append(f"- [{title}](bench/ANALYSIS.md#{_anchor(title)}): {gist}")
        lines.append("")
    lines += ["## Every metric", "", "| benchmark | command | ran | all metrics |",
              "| --- | --- | --- | --- |"]
    for name, data in results.items():
        if name.startswith("_"):
            continue
        ran = (f"{data['_ran_at']}, load {data.get('_load', '?')}"
               if data.get("_ran_at") else "")
        lines.append(f"| {name} | `{data.get('_command', '')}` ({data.get('_seconds', '?')} s) "
                     f"| {ran} | [bench/results/{name}.md](bench/results/{name}.md) |")
    lines.append("")
    return "\n".join(lines) + "\n"


def write_raw(results: dict[str, Any]) -> None:
    """bench/results/NAME.md: every metric a benchmark reported, as a table."""
    for name, data in results.items():
        if name.startswith("_"):
            continue
        ran = (f" Ran {data['_ran_at']}, load average {data.get('_load', '?')} at its end."
               if data.get("_ran_at") else "")
        lines = [f"# {name}", "", f"Command: `{data.get('_command', '')}` "
                 f"({data.get('_seconds', '?')} s).{ran}", "", "| metric | value |",
                 "| --- | --- |"]
        rows: list[tuple[str, str]] = []
        _flatten("", data, rows)
        lines += [f"| {k} | {v} |" for k, v in rows]
        (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")


def analysis_sections(text: str) -> list[tuple[str, str]]:
    """(title, first sentence of its first prose paragraph, at most 240 characters) of each
    ``## `` section."""
    out: list[tuple[str, str]] = []
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = block.partition("\n")
        para = next((p for p in re.split(r"\n\s*\n", body.strip())
                     if p.strip() and not p.lstrip().startswith(("|", "```", "-", "#"))), "")
        para = " ".join(para.split())
        sentence = re.match(r"(.+?\.)(\s|$)", para)
        gist = (sentence.group(1) if sentence else para).lstrip("> ")
        out.append((title.strip(), gist[:240] + ("..." if len(gist) > 240 else "")))
    return out


def _anchor(title: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _summary(name: str, data: dict[str, Any]) -> list[tuple[str, ...]]:
    """Rows for the targets table, from the 'targets' list a benchmark reports."""
    rows: list[tuple[str, ...]] = []
    for t in data.get("targets", []) or []:
        rows.append((name, str(t.get("measure", "")), str(t.get("result", "")),
                     str(t.get("target", "")), "yes" if t.get("met") else "**no**"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (~3 minutes)")
    ap.add_argument("--only", nargs="*", choices=sorted(BENCHES), help="run only these")
    ap.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the markdown from bench/results/all.json")
    args = ap.parse_args()
    names = args.only or list(BENCHES)
    if args.render:
        results = json.loads((RESULTS / "all.json").read_text())
        args.out.write_text(write_markdown(results, args.quick))
        write_raw(results)
        print(f"[bench] wrote {args.out}")
        return
    results = run(names, args.quick)
    results["_finished"] = _finished_now()
    previous = RESULTS / "all.json"
    if args.only and previous.exists():  # keep the other benchmarks' last results
        kept = {k: v for k, v in json.loads(previous.read_text()).items()
                if not k.startswith("_") and k not in results}
        results = {**results, **kept}
        results = {"_machine": results["_machine"], "_finished": results["_finished"],
                   **{n: results[n] for n in BENCHES if n in results}}
    args.out.write_text(write_markdown(results, args.quick))
    write_raw(results)
    (RESULTS / "all.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
