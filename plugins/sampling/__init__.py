"""Built-in samplers."""
from kvforge.hookspecs import hookimpl


@hookimpl
def register_samplers(register):
    register("default", "kvforge.plugins.sampling.default:DefaultSampler")
