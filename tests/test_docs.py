"""Lists in docs/ that must follow the code: a stale doc fails here, not in a user's hands."""
import dataclasses
import re
from pathlib import Path

from kvforge.request import Request

DOCS = Path(__file__).resolve().parents[1] / "docs"


def table_after(doc: str, marker: str) -> list[str]:
    """The backticked names in the first column of the table that follows ``<!-- marker ... -->``."""
    lines = (DOCS / doc).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"<!-- {marker}"))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break  # the end of the table
    names = []
    for row in rows[2:]:  # past the header and the |---| line
        names += re.findall(r"`([A-Za-z_]\w*)`", row.split("|")[1])
    return names


def test_plugins_md_says_what_a_scheduler_policy_may_do_with_every_request_field():
    documented = table_after("plugins.md", "request-fields")
    assert len(documented) == len(set(documented)), "a field is listed twice"
    properties = {n for n, v in vars(Request).items() if isinstance(v, property) and not n.startswith("_")}
    fields = {f.name for f in dataclasses.fields(Request)} | properties
    assert set(documented) == fields, (f"docs/plugins.md's Request table is stale: missing "
                                       f"{sorted(fields - set(documented))}, not in Request "
                                       f"{sorted(set(documented) - fields)}")


def test_configuration_md_lists_every_engine_option():
    from kvforge.config import EngineConfig

    documented = table_after("configuration.md", "engine-options")
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    assert sorted(documented) == sorted(fields), (
        f"docs/configuration.md is stale: missing {sorted(set(fields) - set(documented))}, "
        f"not options {sorted(set(documented) - set(fields))}")


def test_configuration_md_lists_every_engine_flag():
    import argparse

    from kvforge.cli import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    text = (DOCS / "configuration.md").read_text()
    start = text.index("<!-- engine-flags")
    table = text[start:text.index("\n\n", start)]
    documented = set(re.findall(r"`(--[a-z-]+)", table))
    assert documented == flags, (f"missing {sorted(flags - documented)}, not flags {sorted(documented - flags)}")


def test_models_md_lists_every_registered_architecture_with_its_capabilities():
    from kvforge.model.interface import capabilities_of
    from kvforge.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    builtin = {n for n in pm.names("model") if pm.registries["model"].plugin_of(n) == "models"}
    lines = (DOCS / "models.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- models"))
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    header, body = rows[0], rows[2:]
    documented = {r[0].strip("`"): dict(zip(header, r)) for r in body}
    assert set(documented) == builtin, (f"docs/models.md is stale: missing {sorted(builtin - set(documented))}, "
                                        f"not registered {sorted(set(documented) - builtin)}")
    columns = {"sliding window": "sliding_window", "MoE": "moe", "tensor parallel": "tensor_parallel",
               "pipeline parallel": "pipeline_parallel", "quantization": "quantization"}
    root = DOCS.parent
    for name, row in documented.items():
        caps = capabilities_of(pm.get("model", name)).as_dict()
        assert row["inputs"] == ", ".join(["text", *caps["modalities"]]), f"{name}: inputs say {row['inputs']!r}"
        for column, field in columns.items():
            assert (row[column] == "yes") == caps[field], f"{name}: {column} says {row[column]!r}, the class {caps[field]}"
        assert (root / row["test"].strip("`")).is_file(), f"{name}: no test file {row['test']}"


def test_server_md_lists_every_metric():
    """docs/server.md's /metrics table names each family the server exposes (speculative decoding and data
    parallelism on, so that theirs are there too), and nothing else."""
    import typing

    import pytest

    pytest.importorskip("prometheus_client")
    from kvforge.engine.stats import EngineStats, SpecDecodeSnapshot
    from kvforge.server.metrics import ServerMetrics

    stats: dict = {key: 0 for key in typing.get_type_hints(EngineStats)}
    spec = {key: 0 for key in typing.get_type_hints(SpecDecodeSnapshot)} | {"accepted_by_position": [0]}
    stats.update(waiting_by_priority={0: 1}, rank_batch_requests=[0], data_parallel_routed=[0], spec_decode=spec)
    registry = ServerMetrics(lambda: stats, "m").registry  # type: ignore[arg-type, return-value]
    exposed = {family.name for family in registry.collect()}  # (a counter's without _total)
    table = (DOCS / "server.md").read_text()
    documented = set(re.findall(r"^\| `(kvforge:\w+)` \|", table, re.M))
    assert documented == exposed, (f"docs/server.md's metrics are stale: missing {sorted(exposed - documented)}, "
                                   f"not exposed {sorted(documented - exposed)}")


def test_plugins_md_lists_every_built_in_drafter_with_its_class_and_options():
    from kvforge.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    builtin = {n for n in pm.names("drafter") if pm.registries["drafter"].plugin_of(n) == "speculative"}
    rows = {}
    for line in (DOCS / "plugins.md").read_text().splitlines():
        if line.startswith("| drafter"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[1].strip("`")] = cells[2]
    assert set(rows) == builtin, f"docs/plugins.md's drafters: missing {sorted(builtin - set(rows))}, not built in " \
                                 f"{sorted(set(rows) - builtin)}"
    for name, cell in rows.items():
        cls = pm.get("drafter", name)
        assert cell.startswith(f"`{cls.__module__}:{cls.__name__}`"), f"{name}: {cell}"
        options = {f.name for f in dataclasses.fields(cls.Options)} if hasattr(cls, "Options") else set()
        listed = set(re.findall(r"`(\w+)`", cell.split("option", 1)[1].split(";")[0])) if "option" in cell else set()
        assert listed == options, f"{name}: docs/plugins.md lists options {sorted(listed)}, its Options has {sorted(options)}"
