"""`trajbus demo`: the main job on the embedded default (local broker, local archive dir).

It starts the local broker (unless one is already running, which it then leaves alone),
creates the topics, publishes events of every kind, consumes them back decoded through Kafka
and prints a per-kind count table. It stops the broker it started unless `--keep`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter

from aiokafka import TopicPartition

from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.settings import Settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole pipeline on a simulated fleet and check what the trainer saw",
        description="The main job on the embedded default: a local Kafka broker, the stream "
        "processors (reorder, watchdog, scheduler) as a worker process, a simulated fleet with "
        "loops, crashes, migrations, duplicates and out-of-order delivery, a trainer reading "
        "ordered replay, and the Parquet archive in .trajbus/archive. A live line shows "
        "progress; the summary checks the trainer's view against what the emitters had "
        "acknowledged. The broker it started is stopped at the end unless --keep.",
    )
    p.add_argument("--keep", action="store_true",
                   help="leave the broker running afterwards (stop it with `trajbus kafka down`)")
    p.add_argument("--sandboxes", type=int, default=40, help="simulated sandboxes (default 40)")
    p.add_argument("--episodes", type=int, default=3, help="episodes per sandbox (default 3)")
    p.add_argument("--seed", type=int, default=None,
                   help="simulation seed (default: from the clock; printed, so a run can be "
                   "repeated on a fresh broker)")
    p.add_argument("--bootstrap", default=None,
                   help="use this existing Kafka instead of the local broker (default: "
                   "TRAJBUS_KAFKA__BOOTSTRAP_SERVERS when set, else a local broker on "
                   "127.0.0.1:9092, started if needed)")
    p.add_argument("--nodes", type=int, default=1, metavar="N",
                   help="run on a local replicated cluster of N Kafka nodes (production's "
                   "shape; N=3: replication factor 3, min.insync.replicas 2), started like "
                   "`trajbus kafka up --nodes N` unless it runs already. Try a drill meanwhile "
                   "from another shell: `trajbus kafka kill-node 2`, then `start-node 2`")
    p.add_argument("--smoke", action="store_true",
                   help="only publish events of every kind and count them back (no processors)")
    p.add_argument("--events-per-kind", type=int, default=200, metavar="N",
                   help="with --smoke: events to publish per kind (default 200)")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    import os

    from trajbus.bus.settings import get_settings
    from trajbus.infra.broker import LocalBroker
    from trajbus.infra.cluster import LocalCluster

    base = get_settings()  # every TRAJBUS_ setting applies (security, partitions, ...)
    broker: LocalBroker | LocalCluster | None = None
    bootstrap = args.bootstrap or os.environ.get("TRAJBUS_KAFKA__BOOTSTRAP_SERVERS")
    if bootstrap is None and args.nodes > 1:
        cluster = LocalCluster(nodes=args.nodes)
        running = cluster.status().running
        # a node or two down is the cluster's business (a drill, a rolling restart): a cluster
        # with any node up is used as it is, and left to whoever runs it
        already = running > 0
        _say(f"local Kafka cluster of {cluster.size} nodes: "
             + (f"{running} of {cluster.size} nodes running, using it" if already
                else "starting") + f" on {cluster.bootstrap}")
        if not already:
            cluster.start(timeout=180)
        bootstrap = cluster.bootstrap
        if "TRAJBUS_TOPICS__REPLICATION_FACTOR" not in os.environ:
            base = base.model_copy(update={"topics": base.topics.model_copy(
                update={"replication_factor": cluster.replication})})
        broker = None if already else cluster
    elif bootstrap is None:
        broker = LocalBroker()
        already = broker.is_running()
        _say(f"local Kafka broker: {'already running' if already else 'starting'} "
             f"on {broker.bootstrap}")
        broker.start(timeout=120)
        bootstrap = broker.bootstrap
        if already:
            broker = None  # not ours to stop
    settings = base.model_copy(update={"kafka": base.kafka.model_copy(
        update={"bootstrap_servers": bootstrap})})
    try:
        if args.smoke:
            counts, elapsed = asyncio.run(_publish_and_consume(settings, args.events_per_kind))
            _print_table(counts, elapsed)
            return 0 if counts and all(sent == got for sent, got in counts.values()) else 1
        from trajbus.pipeline_demo import run_pipeline

        seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
        run = isolated_run(settings, seed)
        _say(f"this run's topics, consumer groups, state and transactional ids use the prefix "
             f"{run.topics.prefix!r}; archive: {run.archive.url}")
        code = asyncio.run(run_pipeline(run, args.sandboxes, args.episodes, seed,
                                        run_id=run.topics.prefix.rsplit(".", 1)[-1]))
        print(f"\nto look at this run (the broker must still run: --keep):\n"
              f"  export TRAJBUS_TOPICS__PREFIX={run.topics.prefix} "
              f"TRAJBUS_ARCHIVE__URL={run.archive.url}")
        return code
    finally:
        if broker is not None and not args.keep:
            _say("stopping the broker this demo started")
            broker.stop()
        elif broker is not None:
            _say(f"Kafka left running on {bootstrap}; stop it with: trajbus kafka down")


async def _publish_and_consume(
    settings: Settings, per_kind: int
) -> tuple[dict[str, tuple[int, int]], float]:
    from trajbus.bus.admin import ensure_base_topics, register_schemas
    from trajbus.bus.producer import close_producer, get_producer
    from trajbus.bus.topics import Topics
    from trajbus.schemas.codec import default_codec
    from trajbus.schemas.models import EVENT_MODELS, Envelope
    from trajbus.schemas.samples import sample_event

    topics = Topics(settings)
    created, _ = await ensure_base_topics(settings, ["demo"])
    _say(f"topics ready ({len(created)} created)")
    await register_schemas(settings)
    topic = topics.sandbox_events
    # One consumer, positioned before we publish, reads exactly this run's events back.
    consumer = new_consumer(settings.kafka, enable_auto_commit=False)
    await consumer.start()
    producer = await get_producer(settings.kafka)
    tps = [TopicPartition(topic, p) for p in sorted(await producer.partitions_for(topic))]
    consumer.assign(tps)
    start_offsets = await consumer.end_offsets(tps)

    run = f"{int(time.time())}"
    sent: Counter[str] = Counter()
    started = time.perf_counter()
    futures = []
    for kind in sorted(EVENT_MODELS):
        for i in range(per_kind):
            header = Envelope(task="demo", sandbox=f"demo-{run}-{i % 10}",
                              episode=f"ep-{i % 7}", seq=i, producer_id="demo")
            futures.append(await producer.send(topic, sample_event(kind, header, i).encode(),
                                               key=header.sandbox.encode()))
            sent[kind] += 1
    await asyncio.gather(*futures)
    await close_producer()
    _say(f"published {sum(sent.values())} events of {len(sent)} kinds")

    got: Counter[str] = Counter()
    try:
        for tp in tps:
            consumer.seek(tp, start_offsets[tp])
        deadline = time.monotonic() + 60
        codec = default_codec()
        while sum(got.values()) < sum(sent.values()) and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for msgs in batch.values():
                for msg in msgs:
                    decoded = codec.decode(msg.value)
                    if decoded.header["sandbox"].startswith(f"demo-{run}-"):
                        got[decoded.kind] += 1
    finally:
        await close_client(consumer, "demo consumer")
    return {k: (sent[k], got[k]) for k in sorted(sent)}, time.perf_counter() - started


def _print_table(counts: dict[str, tuple[int, int]], elapsed: float) -> None:
    print()
    print(f"{'event kind':22} {'published':>10} {'consumed':>10}")
    print("-" * 44)
    for kind, (sent, got) in counts.items():
        flag = "" if sent == got else "   <-- MISMATCH"
        print(f"{kind:22} {sent:>10} {got:>10}{flag}")
    print("-" * 44)
    total_s = sum(s for s, _ in counts.values())
    total_g = sum(g for _, g in counts.values())
    print(f"{'total':22} {total_s:>10} {total_g:>10}   ({elapsed:.1f}s round trip)")


def isolated_run(settings: Settings, seed: int) -> Settings:
    """Settings of one demo run, isolated from every earlier run on the same broker: its own
    topic prefix (so its own consumer groups, state changelogs and transactional ids, which
    derive from the prefix) and its own archive location."""
    import uuid

    run_id = f"demo-{seed}-{uuid.uuid4().hex[:6]}"
    prefix = f"{settings.topics.prefix}.{run_id}"
    url = f"{settings.archive.url.rstrip('/')}/{run_id}"
    spool = f"{settings.archive.spool_dir.rstrip('/')}/{run_id}"
    return settings.model_copy(update={
        "topics": settings.topics.model_copy(update={"prefix": prefix}),
        "archive": settings.archive.model_copy(update={"url": url, "spool_dir": spool}),
    })


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)
