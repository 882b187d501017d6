"""Built-in speculative drafters (none yet: the ``Drafter`` contract lives in ``kvforge.drafter``)."""
