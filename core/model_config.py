"""A public path kept for plugins: the model config lives in :mod:`kvforge.model.config`."""
from kvforge.model.config import *  # noqa: F403
