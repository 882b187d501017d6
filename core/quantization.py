"""A public path kept for plugins: the quantization contract lives in :mod:`kvforge.model.quantization`."""
from kvforge.model.quantization import *  # noqa: F403
