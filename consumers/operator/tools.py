"""Operators' tools: what did a sandbox do, and why did the processors decide what they did.

A façade over one module per concern (import from here or from the module):

* :mod:`.timeline` -- a sandbox's events as a human timeline (:class:`TimelineEntry`).
* :mod:`.reads` -- bounded reads of the live topics (never a consumer group, always ending).
* :mod:`.explain` -- ``replay explain``: re-run the processors over the log and compare.
* :mod:`.republish` -- ``replay republish``: one episode to a debug replay topic.
* :mod:`.status` -- ``trajbus status``.
* :mod:`.watchdog_history` -- ``watchdog explain``.

Everything is read-only on the live topics except :func:`republish`.
"""

from __future__ import annotations

from trajbus.consumers.operator.explain import (
    DerivedRecord as DerivedRecord,
)
from trajbus.consumers.operator.explain import (
    Divergence as Divergence,
)
from trajbus.consumers.operator.explain import (
    ExplainedItem as ExplainedItem,
)
from trajbus.consumers.operator.explain import (
    Explanation as Explanation,
)
from trajbus.consumers.operator.explain import (
    Status as Status,
)
from trajbus.consumers.operator.explain import (
    _causes as _causes,
)
from trajbus.consumers.operator.explain import (
    _clock as _clock,
)
from trajbus.consumers.operator.explain import (
    _day as _day,
)
from trajbus.consumers.operator.explain import (
    _entry_when as _entry_when,
)
from trajbus.consumers.operator.explain import (
    _Rerun as _Rerun,
)
from trajbus.consumers.operator.explain import (
    _reruns as _reruns,
)
from trajbus.consumers.operator.explain import (
    _run_adapter as _run_adapter,
)
from trajbus.consumers.operator.explain import (
    _when as _when,
)
from trajbus.consumers.operator.explain import (
    causal_order as causal_order,
)
from trajbus.consumers.operator.explain import (
    explain as explain,
)
from trajbus.consumers.operator.explain import (
    feed_processor as feed_processor,
)
from trajbus.consumers.operator.explain import (
    processor_inputs as processor_inputs,
)
from trajbus.consumers.operator.reads import (
    Source as Source,
)
from trajbus.consumers.operator.reads import (
    _archive_entries as _archive_entries,
)
from trajbus.consumers.operator.reads import (
    _decode_all as _decode_all,
)
from trajbus.consumers.operator.reads import (
    _parse_time_bound as _parse_time_bound,
)
from trajbus.consumers.operator.reads import (
    _require as _require,
)
from trajbus.consumers.operator.reads import (
    _retrying as _retrying,
)
from trajbus.consumers.operator.reads import (
    group_lag as group_lag,
)
from trajbus.consumers.operator.reads import (
    group_offsets as group_offsets,
)
from trajbus.consumers.operator.reads import (
    merge_by_timestamp as merge_by_timestamp,
)
from trajbus.consumers.operator.reads import (
    read_records as read_records,
)
from trajbus.consumers.operator.reads import (
    read_sandbox_log as read_sandbox_log,
)
from trajbus.consumers.operator.reads import (
    sandboxes_in_log as sandboxes_in_log,
)
from trajbus.consumers.operator.reads import (
    topic_partitions as topic_partitions,
)
from trajbus.consumers.operator.republish import (
    _REPUBLISH_NS as _REPUBLISH_NS,
)
from trajbus.consumers.operator.republish import (
    REPUBLISH_PRODUCER as REPUBLISH_PRODUCER,
)
from trajbus.consumers.operator.republish import (
    RepublishResult as RepublishResult,
)
from trajbus.consumers.operator.republish import (
    _segment_plan as _segment_plan,
)
from trajbus.consumers.operator.republish import (
    _with_raw as _with_raw,
)
from trajbus.consumers.operator.republish import (
    debug_replay_task as debug_replay_task,
)
from trajbus.consumers.operator.republish import (
    republish as republish,
)
from trajbus.consumers.operator.status import (
    fleet_status as fleet_status,
)
from trajbus.consumers.operator.status import (
    restore_scheduler as restore_scheduler,
)
from trajbus.consumers.operator.status import (
    retained_records as retained_records,
)
from trajbus.consumers.operator.timeline import (
    _LONG_HEX as _LONG_HEX,
)
from trajbus.consumers.operator.timeline import (
    _MS_AMOUNT as _MS_AMOUNT,
)
from trajbus.consumers.operator.timeline import (
    _TEXTUAL as _TEXTUAL,
)
from trajbus.consumers.operator.timeline import (
    TimelineEntry as TimelineEntry,
)
from trajbus.consumers.operator.timeline import (
    _clip as _clip,
)
from trajbus.consumers.operator.timeline import (
    _iso as _iso,
)
from trajbus.consumers.operator.timeline import (
    _jsonable as _jsonable,
)
from trajbus.consumers.operator.timeline import (
    _ms as _ms,
)
from trajbus.consumers.operator.timeline import (
    entry_from_decoded as entry_from_decoded,
)
from trajbus.consumers.operator.timeline import (
    humanize as humanize,
)
from trajbus.consumers.operator.timeline import (
    order_timeline as order_timeline,
)
from trajbus.consumers.operator.timeline import (
    short_id as short_id,
)
from trajbus.consumers.operator.timeline import (
    shorten_ids as shorten_ids,
)
from trajbus.consumers.operator.timeline import (
    summarize as summarize,
)
from trajbus.consumers.operator.watchdog_history import (
    StreamHistory as StreamHistory,
)
from trajbus.consumers.operator.watchdog_history import (
    WatchdogMoment as WatchdogMoment,
)
from trajbus.consumers.operator.watchdog_history import (
    _render_moment as _render_moment,
)
from trajbus.consumers.operator.watchdog_history import (
    watchdog_explain as watchdog_explain,
)
from trajbus.consumers.operator.watchdog_history import (
    watchdog_history as watchdog_history,
)

__all__ = [
    "REPUBLISH_PRODUCER",
    "DerivedRecord",
    "Divergence",
    "ExplainedItem",
    "Explanation",
    "RepublishResult",
    "TimelineEntry",
    "debug_replay_task",
    "entry_from_decoded",
    "explain",
    "feed_processor",
    "fleet_status",
    "group_lag",
    "group_offsets",
    "merge_by_timestamp",
    "order_timeline",
    "processor_inputs",
    "read_records",
    "read_sandbox_log",
    "republish",
    "restore_scheduler",
    "retained_records",
    "summarize",
    "topic_partitions",
    "watchdog_explain",
]
