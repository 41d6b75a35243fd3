"""The benchmarks' shared harness, one concern per module: reading /proc (``procstat``),
summary figures (``figures``), Kafka from the harness side (``kafka``), watching groups and
replay topics (``groups``), a process measured while it drains a backlog (``drain``), the
trajbus worker as a subprocess (``worker``) and its log (``worklog``), the code of other git
refs (``trees``), a local broker and its files (``broker``), event records (``events``), an aged
reorder changelog (``changelog``), a worker's SIGKILL to serving (``restart``), and the
trainer's side of the end-to-end bench (``trainer``, ``load``).

The bench scripts import it as ``harness`` (``bench/`` is on ``sys.path`` when one runs as a
script). Its modules import only the standard library at import time; Kafka clients and
``trajbus`` are imported where they are used, so a peer process (``bench_worker.py --peer``,
maybe in another virtualenv) and a subprocess running another ref's tree can import them.
"""
