"""Built-in schedulers."""
from kvforge.hookspecs import hookimpl


@hookimpl
def register_schedulers(register):
    register("fcfs", "kvforge.plugins.scheduling.fcfs:FCFSScheduler")
    register("priority", "kvforge.plugins.scheduling.priority:PriorityScheduler")
