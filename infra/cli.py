"""``trajbus kafka ...``: run a local single-node Kafka broker without Docker.

Wire it into a top-level parser with :func:`register`; every leaf parser sets
``func=handler`` where ``handler(args: argparse.Namespace) -> int`` returns an exit code::

    parser = argparse.ArgumentParser(prog="trajbus")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args()
    sys.exit(args.func(args))
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from trajbus.infra.broker import DEFAULT_DATA_DIR, DEFAULT_PORT, BrokerError, LocalBroker
from trajbus.infra.cluster import DEFAULT_CLUSTER_BASE_PORT, DEFAULT_CLUSTER_DATA_DIR, LocalCluster
from trajbus.infra.kafka_runtime import KafkaSetupError, ensure_jars, kafka_version

_ENV_HELP = (
    "Environment: TRAJBUS_KAFKA_PORT and TRAJBUS_KAFKA_DATA_DIR override the default port "
    f"({DEFAULT_PORT}) and data directory ({DEFAULT_DATA_DIR} under the current directory); "
    "TRAJBUS_KAFKA_LIB_DIR uses an existing directory of Kafka jars instead of fetching them; "
    "TRAJBUS_KAFKA_JVM_OPTIONS replaces the JVM's tuning (default: G1, 20 ms pauses)."
)


def _add_data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"broker data directory (default: $TRAJBUS_KAFKA_DATA_DIR or ./{DEFAULT_DATA_DIR})",
    )


def _broker(args: argparse.Namespace) -> LocalBroker:
    return LocalBroker(
        data_dir=args.data_dir,
        port=getattr(args, "port", None),
        controller_port=getattr(args, "controller_port", None),
        heap=getattr(args, "heap", None) or "512m",
    )


def _cluster(args: argparse.Namespace, nodes: int | None = None) -> LocalCluster:
    return LocalCluster(getattr(args, "data_dir", None) or DEFAULT_CLUSTER_DATA_DIR, nodes,
                        base_port=getattr(args, "port", None))


def _is_cluster_dir(args: argparse.Namespace) -> bool:
    """True if --data-dir (or the default cluster directory, without --data-dir) holds a
    cluster started by ``up --nodes N``."""
    path = args.data_dir if args.data_dir is not None else DEFAULT_CLUSTER_DATA_DIR
    return (Path(path) / "cluster.json").exists()


def _cmd_up_cluster(args: argparse.Namespace) -> int:
    try:
        cluster = _cluster(args, args.nodes)
        already = cluster.status().running
        cluster.start(timeout=max(args.wait, 90.0))
    except (BrokerError, KafkaSetupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    st = cluster.status()
    verb = "already running" if already == cluster.size else "started"
    print(f"Kafka {kafka_version()} cluster of {cluster.size} nodes {verb} "
          f"(replication factor {cluster.replication}, "
          f"min.insync.replicas {max(1, cluster.replication - 1)})")
    for i, node in enumerate(st.nodes, 1):
        print(f"  node {i}: pid {node.pid}, {node.bootstrap}, log {node.log_file}")
    print(f"  bootstrap servers: {cluster.bootstrap}")
    print(f"  data directory:    {cluster.data_dir}")
    print(f"use it with: export TRAJBUS_KAFKA__BOOTSTRAP_SERVERS={cluster.bootstrap} "
          f"TRAJBUS_TOPICS__REPLICATION_FACTOR={cluster.replication}")
    dd = "" if args.data_dir is None else f" --data-dir {args.data_dir}"
    print(f"drills: trajbus kafka kill-node N{dd} / start-node N / pause-node N / resume-node N")
    print(f"stop it with: trajbus kafka down{dd}")
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    if args.nodes > 1:
        return _cmd_up_cluster(args)
    broker = _broker(args)
    already = broker.is_running()
    try:
        broker.start(timeout=args.wait)
    except (BrokerError, KafkaSetupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    st = broker.status()
    verb = "already running" if already else "started"
    print(f"Kafka {kafka_version()} broker {verb} (pid {st.pid})")
    print(f"  bootstrap servers: {st.bootstrap}")
    print(f"  data directory:    {st.data_dir}")
    print(f"  broker log:        {st.log_file}")
    dd = "" if args.data_dir is None else f" --data-dir {args.data_dir}"
    print(f"stop it with: trajbus kafka down{dd}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    if _is_cluster_dir(args):
        cluster = _cluster(args)
        running = cluster.status().running
        try:
            cluster.stop(timeout=args.timeout)
        except BrokerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"stopped {running} of {cluster.size} cluster nodes; data kept in "
              f"{cluster.data_dir}")
        if args.data_dir is not None:
            return 0
    broker = _broker(args)
    pid = broker.pid()
    if pid is None:
        print(f"no broker running for {broker.data_dir}")
        broker.stop()  # clears a stale pid file
        return 0
    try:
        broker.stop(timeout=args.timeout)
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"stopped Kafka broker pid {pid} ({broker.bootstrap}); data kept in {broker.data_dir}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    if _is_cluster_dir(args) and (args.data_dir is not None or _cluster(args).status().running):
        cluster = _cluster(args)
        cst = cluster.status()
        live = cluster.live_brokers() if cst.running else 0
        if args.json:
            print(json.dumps({**cst.as_dict(), "live_brokers": live}))
        else:
            print(f"cluster of {cluster.size} nodes: {cst.running} running, {live} live "
                  f"brokers; bootstrap {cluster.bootstrap}")
            for i, node in enumerate(cst.nodes, 1):
                state = f"running, pid {node.pid}" if node.running else "down"
                print(f"  node {i}: {state} ({node.bootstrap})")
        return 0 if cst.running == cluster.size else 3
    st = _broker(args).status()
    if args.json:
        print(json.dumps(st.as_dict()))
    elif st.running:
        print(f"running: pid {st.pid}, bootstrap {st.bootstrap}, data {st.data_dir}")
    else:
        print(f"not running (data {st.data_dir}, port {st.port})")
    return 0 if st.running else 3


def _cmd_jars(args: argparse.Namespace) -> int:
    try:
        lib = ensure_jars(force=args.force)
    except KafkaSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"Kafka {kafka_version()} jars in {lib}")
    return 0


def _node_command(action: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        if not _is_cluster_dir(args):
            print("error: no cluster here: start one with `trajbus kafka up --nodes 3` "
                  "(or give its --data-dir)", file=sys.stderr)
            return 2
        cluster = _cluster(args)
        try:
            if action == "start":
                cluster.start_node(args.node, timeout=args.wait)
            else:
                getattr(cluster, f"{action}_node")(args.node)
        except (BrokerError, ValueError, KafkaSetupError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"node {args.node}: {action} done ({cluster.node(args.node).bootstrap})")
        return 0
    return run


_NODE_ACTIONS = {
    "kill": "SIGKILL a node (a crash); its data stays, start-node brings it back",
    "stop": "controlled shutdown of a node (its partition leaders move first)",
    "start": "start a stopped or killed node and wait until it is registered again",
    "pause": "SIGSTOP a node: it answers nothing (a long GC pause, a frozen VM) until resumed",
    "resume": "SIGCONT a paused node",
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``kafka`` command group (up/down/status/jars) to a subparsers object."""
    kafka = subparsers.add_parser(
        "kafka",
        help="run a local single-node Kafka broker (KRaft, no Docker)",
        description="Run a local single-node Apache Kafka broker (KRaft mode, no ZooKeeper, "
        "no Docker). The broker jars come from Maven Central on first use (needs Java 17+ "
        "and Maven). " + _ENV_HELP,
    )
    sub = kafka.add_subparsers(
        dest="kafka_command",
        metavar="{up,down,status,jars,kill-node,stop-node,start-node,pause-node,resume-node}")
    sub.required = True

    up = sub.add_parser(
        "up",
        help="start the broker in the background and wait until it answers",
        description="Start the broker detached (it keeps running after this command exits) "
        "and wait until it answers Kafka requests. Does nothing if it is already running. "
        "Storage is formatted on first start; later starts keep the data. " + _ENV_HELP,
    )
    up.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"client port on 127.0.0.1 (default: $TRAJBUS_KAFKA_PORT, the port recorded in "
        f"the data directory, or {DEFAULT_PORT})",
    )
    up.add_argument(
        "--controller-port",
        type=int,
        default=None,
        help="KRaft controller port (default: recorded in the data directory, else port+1)",
    )
    _add_data_dir(up)
    up.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the broker to answer (default: 60)",
    )
    up.add_argument("--heap", default="512m", help="JVM max heap, e.g. 1g (default: 512m)")
    up.add_argument(
        "--nodes",
        type=int,
        default=1,
        metavar="N",
        help="run a replicated cluster of N KRaft nodes instead of one broker (production's "
        "shape: N=3 gives replication factor 3, min.insync.replicas 2, no unclean leader "
        f"election). Data in ./{DEFAULT_CLUSTER_DATA_DIR} unless --data-dir; node i listens "
        f"on --port+2(i-1) (default {DEFAULT_CLUSTER_BASE_PORT}), its controller on the next "
        "port. The drills kill-node/stop-node/start-node/pause-node/resume-node act on it.",
    )
    up.set_defaults(func=_cmd_up)

    down = sub.add_parser(
        "down",
        help="stop the broker (controlled shutdown), keeping its data",
        description="Send SIGTERM to the broker recorded in the data directory's pid file, "
        "wait for a controlled shutdown, then SIGKILL it after --timeout. Data is kept; "
        "delete the data directory to start from scratch.",
    )
    _add_data_dir(down)
    down.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="grace period before SIGKILL (default: 30)",
    )
    down.set_defaults(func=_cmd_down)

    status = sub.add_parser(
        "status",
        help="show whether the broker is running (exit code 0 running, 3 not running)",
        description="Show the broker's pid, bootstrap address and data directory. "
        "Exit code 0 if running, 3 if not.",
    )
    _add_data_dir(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=_cmd_status)

    for action, what in _NODE_ACTIONS.items():
        node = sub.add_parser(f"{action}-node", help=what,
                              description=f"{what[0].upper()}{what[1:]}. Acts on the cluster "
                              "started by `trajbus kafka up --nodes N` (or its --data-dir).")
        node.add_argument("node", type=int, help="the node's number, 1..N (its node.id)")
        _add_data_dir(node)
        if action == "start":
            node.add_argument("--wait", type=float, default=120.0, metavar="SECONDS",
                              help="how long to wait for the node to be registered again "
                              "(default: 120)")
        node.set_defaults(func=_node_command(action))

    jars = sub.add_parser(
        "jars",
        help="fetch the Kafka jars from Maven Central (done automatically by `up`)",
        description="Fetch the Kafka broker and tools jars into infra/kafka/lib with Maven "
        "(cached in ~/.m2). Runs automatically on the first `up`.",
    )
    jars.add_argument("--force", action="store_true", help="refetch even if up to date")
    jars.set_defaults(func=_cmd_jars)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m trajbus.infra.cli kafka up``."""
    parser = argparse.ArgumentParser(prog="trajbus")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
