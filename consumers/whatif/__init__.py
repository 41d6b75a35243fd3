"""What-if replay: re-run the processors over a past log with changed rules, and show what
they would have decided differently.

:mod:`.source` reads the past log (Kafka), :mod:`.rules` names the rules a run may change,
:mod:`.run` runs the cores (through the live adapters) and checks the recorded-rules run
against the recorded outputs, :mod:`.diff` compares two runs per sandbox, :mod:`.render`
shows a diff (table, JSON, HTML), :mod:`.cli` is ``trajbus whatif``. Entry point:
:func:`whatif`.
"""

from trajbus.consumers.whatif.api import whatif, whatif_async
from trajbus.consumers.whatif.diff import Change, Diff, SandboxDiff
from trajbus.consumers.whatif.rules import RuleError, Rules, rule_names
from trajbus.consumers.whatif.run import SelfCheck
from trajbus.consumers.whatif.source import LogFilter, RecordedLog, read_kafka_log

__all__ = ["Change", "Diff", "LogFilter", "RecordedLog", "RuleError", "Rules", "SandboxDiff",
           "SelfCheck", "read_kafka_log", "rule_names", "whatif", "whatif_async"]
