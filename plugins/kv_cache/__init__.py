"""Built-in KV-cache managers, and the KV connectors (tiers) the paged manager keeps blocks in."""
from kvforge.hookspecs import hookimpl


@hookimpl
def register_kv_cache_managers(register):
    register("paged", "kvforge.plugins.kv_cache.paged:PagedKVCacheManager")


@hookimpl
def register_kv_connectors(register):
    register("cpu", "kvforge.plugins.kv_cache.cpu_tier:CPUConnector")
    register("disk", "kvforge.plugins.kv_cache.disk_tier:DiskConnector")
