"""Built-in executors: ``uni`` (one rank, in process), ``mp`` (ranks in spawned processes on this
node), ``ray`` (ranks as Ray actors in a placement group, across nodes)."""
from kvforge.hookspecs import hookimpl


@hookimpl
def register_executors(register):
    register("uni", "kvforge.rank.executor:UniExecutor")
    register("mp", "kvforge.plugins.executors.multiproc:MultiprocExecutor")
    register("ray", "kvforge.plugins.executors.ray_executor:RayExecutor")
