"""The harness: what a check admits (``setup``), the two sides and their state (``state``, ``candidates``), the
step loop that runs them side by side (``check``: :func:`shardcheck.check_parity`), one reference trajectory for
several checks (``reference_trajectory``), recorded runs (``recorded``) and the memory a check holds
(``footprint``)."""
