"""A public path kept for plugins: the executor contract lives in :mod:`kvforge.rank.executor`."""
from kvforge.rank.executor import *  # noqa: F403
