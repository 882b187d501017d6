"""docs/deployment.md's lists follow the artefacts: the build-argument table is the Dockerfiles' ARGs with
their defaults, and every flag it names is a `kvforge serve` flag."""
import argparse
import re
from pathlib import Path

from dockerfiles import DOCKERFILES, build_args
from kvforge.server.cli import add_serve_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"


def build_argument_table() -> dict[str, dict[str, str]]:
    """image kind -> {argument: default as the table writes it} from the `### Build arguments` table."""
    text = DOC.read_text()
    table = text[text.index("| image | argument | default | meaning |"):]
    table = table[:table.index("\n\n")]
    out: dict[str, dict[str, str]] = {"cpu": {}, "cuda": {}}
    for row in table.splitlines()[2:]:
        image, argument, default = (cell.strip() for cell in row.strip("|").split("|")[:3])
        kinds = {"both": ["cpu", "cuda"], "CPU": ["cpu"], "CUDA": ["cuda"]}[image]
        defaults = re.findall(r"`([^`]*)`", default) or [""]
        for i, kind in enumerate(kinds):
            out[kind][argument.strip("`")] = defaults[min(i, len(defaults) - 1)]
    return out


def test_the_build_argument_table_is_the_dockerfiles_args_with_their_defaults():
    documented = build_argument_table()
    for kind, path in DOCKERFILES.items():
        actual = {name: default or "" for name, default in build_args(path).items()}
        assert documented[kind] == actual, f"{path.name}: docs/deployment.md says {documented[kind]}"


def test_every_flag_the_doc_names_after_the_images_is_a_serve_flag():
    """From `## Compose` on, a backticked `--flag` is kvforge's (the images' section names docker's too)."""
    parser = argparse.ArgumentParser(prog="kvforge")
    add_serve_parser(parser.add_subparsers(dest="command"))
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags = {s for a in serve._actions for s in a.option_strings}
    text = DOC.read_text()
    named = set(re.findall(r"`(--[a-z][a-z-]*)", text[text.index("## Compose"):]))
    assert {"--shutdown-timeout", "--log-format", "--disable-log-requests", "--root-path", "--allowed-origins",
            "--max-request-body-bytes"} <= named
    assert named <= flags, f"not `kvforge serve` flags: {sorted(named - flags)}"
