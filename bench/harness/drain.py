"""A process measured while it drains a backlog: its CPU and wall time from the moment its
consumer group is Stable with partitions assigned until its committed offsets reach the end of
the input (``run_measured``, watching through ``DrainWatch``), with the box's load beside."""

from __future__ import annotations

import resource
import subprocess
import time
from pathlib import Path
from typing import Any

from harness.kafka import kafka_conf
from harness.procstat import box_cpu, proc_cpu_s
from harness.worker import ROOT, stop_process


class DrainWatch:
    """Polls a consumer group through the admin API: Stable with partitions assigned, and
    its committed offsets on the input topic."""

    def __init__(self, bootstrap: str, group: str, topic: str, target: dict[int, int]) -> None:
        from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
        from confluent_kafka.admin import AdminClient

        self.admin = AdminClient(kafka_conf(bootstrap))
        self.group = group
        self.target = target
        self.request = [ConsumerGroupTopicPartitions(
            group, [TopicPartition(topic, p) for p in sorted(target)])]

    def active(self) -> bool:
        from confluent_kafka import ConsumerGroupState

        try:
            desc = self.admin.describe_consumer_groups([self.group])[self.group].result(5)
        except Exception:  # not known to the coordinator yet
            return False
        return desc.state == ConsumerGroupState.STABLE and any(
            m.assignment is not None and m.assignment.topic_partitions for m in desc.members)

    def drained(self) -> bool:
        try:
            res = self.admin.list_consumer_group_offsets(self.request)[self.group].result(5)
        except Exception:
            return False
        got = {tp.partition: tp.offset for tp in res.topic_partitions}
        return all(got.get(p, -1) >= end for p, end in self.target.items())


def run_measured(cmd: list[str], env: dict[str, str] | None, watch: DrainWatch,
                 timeout: float, log_path: Path, cwd: Path = ROOT) -> dict[str, Any]:
    """Start ``cmd``, measure its CPU and wall time from group-active to drained, wait for
    its exit."""
    log = open(log_path, "ab")
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t_launch = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=log)
    start: tuple[float, float, float, float] | None = None  # wall, cpu, box busy, harness
    end: tuple[float, float, float, float] | None = None
    last_cpu = 0.0
    error = None
    try:
        deadline = t_launch + timeout
        while time.monotonic() < deadline:
            cpu = proc_cpu_s(proc.pid)
            if proc.poll() is not None:
                error = f"exited {proc.returncode} before draining the input"
                break
            if cpu is not None:
                last_cpu = cpu
            sample = (time.monotonic(), last_cpu, box_cpu()[0], time.process_time())
            if start is None:
                if watch.active():
                    start = sample
            elif watch.drained():
                end = (time.monotonic(), proc_cpu_s(proc.pid) or last_cpu, box_cpu()[0],
                       time.process_time())
                break
            time.sleep(0.1)
        else:
            error = f"not drained within {timeout:.0f} s"
        if end is not None:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                error = "did not exit within 60 s of draining its input"
    finally:
        stop_process(proc)
        log.close()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    res: dict[str, Any] = {
        "exit_code": proc.returncode,
        "process_cpu_s_total": round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime,
                                     3),
        "process_wall_s_total": round(time.monotonic() - t_launch, 2)}
    if error is None and proc.returncode not in (0, None):
        error = f"exited {proc.returncode}"
    if error is not None:
        tail = log_path.read_bytes()[-1500:].decode(errors="replace")
        return {**res, "error": error, "log_tail": tail}
    assert start is not None and end is not None
    wall = end[0] - start[0]
    cpu = end[1] - start[1]
    busy = end[2] - start[2]
    harness = end[3] - start[3]
    res.update({"cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
                "startup_s": round(start[0] - t_launch, 2),
                "variant_cores": round(cpu / wall, 2) if wall > 0 else None,
                "box_busy_cores": round(busy / wall, 2) if wall > 0 else None,
                "other_processes_cores": round(max(0.0, busy - cpu - harness) / wall, 2)
                if wall > 0 else None})
    return res
