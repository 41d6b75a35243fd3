"""Operators' tools: what did a sandbox do, and why did the processors decide what they did.

Everything here reads without a consumer group (nothing committed, nothing changed), except
``replay republish`` (a debug replay topic) and ``deadletters redrive``. :mod:`.tools`
(timelines, ``explain``, status, republish), :mod:`.waterfall`, :mod:`.consume`,
:mod:`.deadletters` and :mod:`.alerts` are the library; :mod:`.cli` and :mod:`.inspect_cli`
add the ``trajbus`` commands.
"""
