"""trajbus.archive: Parquet archival of the raw event topics and the decision context (decisions,
alerts, dead letters), indexed by task, sandbox, episode.

Modules, one concern each: ``storage`` (local dir / S3 object stores), ``rows`` (events ->
one Arrow schema), ``layout`` (keys), ``core`` (pure batching decisions), ``spool`` (bounded
buffering on disk), ``writer`` + ``index`` (Parquet objects and their episode index),
``manifest`` + ``maintenance`` (atomic compaction, retention), ``context`` (pure: how each
episode ended), ``query`` (episode lookup, decision context, DuckDB), ``archiver`` (the Kafka
consumer shell), ``cli`` (``trajbus archive ...``), ``synth`` (synthetic data for tests and
benchmarks). See ``archive/README.md``.
"""
