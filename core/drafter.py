"""A public path kept for plugins: the drafter contract lives in :mod:`kvforge.spec_decode.drafter`."""
from kvforge.spec_decode.drafter import *  # noqa: F403
