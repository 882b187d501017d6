"""Built-in KV-cache managers."""
from kvforge.hookspecs import hookimpl


@hookimpl
def register_kv_cache_managers(register):
    register("paged", "kvforge.plugins.kv_cache.paged:PagedKVCacheManager")
