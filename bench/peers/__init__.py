"""The peers the benchmarks measure trajbus beside, each a minimal implementation of the same
job: the consume/reorder/produce loop on confluent-kafka and on aiokafka (``reorder_loop``),
the same reorder on Quix Streams (``quix``), and the ends of the minimal peer pipeline of the
end-to-end bench, a confluent-kafka producer and consumer (``pipeline``).

They import only the standard library at import time (the clients where they are used): a
peer runs in a process of its own, maybe from another virtualenv (Quix Streams)."""
