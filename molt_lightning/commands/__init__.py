"""The command line: ``molt fit``/``validate``/``eval`` (``cli``), ``molt sft`` (``sft``), ``molt export``
(``export``) and ``molt serve`` (``serve``)."""
