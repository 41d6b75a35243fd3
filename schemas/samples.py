"""A valid example of every event kind, for smoke tests, the first demo and documentation."""

from __future__ import annotations

import hashlib

from trajbus.schemas import models as m


def sample_event(kind: str, header: m.Envelope, i: int = 0) -> m.Event:
    """A plausible event of ``kind`` with the given header; ``i`` varies the payload."""
    digest = hashlib.sha256(f"{kind}{i}".encode()).hexdigest()
    data = f"step {i}: agent output\n".encode()
    match kind:
        case "SandboxLifecycle":
            states = list(m.LifecycleState)
            return m.SandboxLifecycle(header=header, state=states[i % 4],
                                      previous_state=states[(i - 1) % 4], node="node-1",
                                      tenant="tenant-a", reason="demo")
        case "Heartbeat":
            return m.Heartbeat(header=header)
        case "LivenessProbe":
            return m.LivenessProbe(header=header, target="127.0.0.1:8080", ok=i % 5 != 0,
                                   latency_ms=3 + i % 7)
        case "ToolCall":
            return m.ToolCall(header=header, call_id=f"c{i}", tool="exec", args_hash=digest,
                              args_canonical='{"cmd":"ls"}', args_summary="exec ls")
        case "ToolResult":
            return m.ToolResult(header=header, call_id=f"c{i}", tool="exec",
                                status=m.ToolStatus.OK, result_hash=digest,
                                result_summary="3 files", duration_ms=12)
        case "TraceChunk":
            return m.TraceChunk(header=header, file_offset=i * len(data), length=len(data),
                                sha256=hashlib.sha256(data).hexdigest(), data=data)
        case "EpisodeStart":
            return m.EpisodeStart(header=header, tenant="tenant-a", context={"prompt": f"p{i}"})
        case "EpisodeEnd":
            return m.EpisodeEnd(header=header, outcome=m.EpisodeOutcome.TERMINAL, reward=1.0)
        case "NodeReport":
            return m.NodeReport(header=header, node=f"node-{i % 3}", cpu_total=64, cpu_free=32,
                                memory_total_mb=262144, memory_free_mb=131072, gpu_total=8,
                                gpu_free=2.4, network_free_mbps=9000,
                                cached_datasets=["swe-bench"])
        case "SandboxRequest":
            return m.SandboxRequest(header=header, request_id=f"r{i}", tenant="tenant-a", cpu=2,
                                    memory_mb=4096, gpu_share=0.2, dataset="swe-bench")
        case "TrainerRelease":
            return m.TrainerRelease(header=header, reason="no longer needed")
        case "Drained":
            return m.Drained(header=header, complete=True,
                             final_seqs=[m.EpisodeFinalSeq(episode="ep-0", final_seq=i)])
        case "DecisionAck":
            return m.DecisionAck(header=header, decision_event_id=digest[:32],
                                 decision="TERMINATE", outcome=m.AckOutcome.DONE,
                                 detail="episodes stopped, resources released")
        case "Tick":
            return m.Tick(header=header)
        case "SchedulingDecision":
            return m.SchedulingDecision(header=header, decision=m.DecisionKind.PLACE,
                                        reason="best fit", node="node-1",
                                        scores={"fit": 0.9, "affinity": 50.0})
        case "WatchdogAlert":
            return m.WatchdogAlert(header=header, alert=m.AlertKind.LOOP,
                                   pattern=[f"exec:{digest[:12]}"], repeat_count=20,
                                   span_ms=120_000, first_seq=1, last_seq=40)
        case "ReplaySegment":
            return m.ReplaySegment(header=header, first_seq=0, last_seq=0, events=[data],
                                   is_first=True)
        case "DeadLetter":
            return m.DeadLetter(header=header, reason_code="bad_magic", reason="demo",
                                stage="demo", source_topic="t", original_value=b"\x00")
    raise KeyError(f"no sample for {kind!r}")
