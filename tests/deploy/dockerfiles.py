"""Reading the repository's Dockerfiles and .dockerignore the way a builder does, for the deploy tests."""
from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"cuda": ROOT / "Dockerfile", "cpu": ROOT / "Dockerfile.cpu"}


@dataclass
class Instruction:
    """One Dockerfile instruction: ``RUN``, ``ENTRYPOINT``, ..., its text after the keyword (continuation
    lines joined, comments dropped) and the build stage it belongs to (0 = the first ``FROM``)."""
    keyword: str
    text: str
    stage: int

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form instruction (``ENTRYPOINT ["a", "b"]``); ``ValueError`` for
        the shell form, which would run under ``/bin/sh -c`` and keep signals from the server."""
        text = re.sub(r"^(--\S+\s+)*", "", self.text) if self.keyword == "HEALTHCHECK" else self.text
        text = text[len("CMD"):].strip() if self.keyword == "HEALTHCHECK" else text
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{self.keyword} {self.text}: not an exec-form JSON array of strings")
        return value


def instructions(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile, in order."""
    out: list[Instruction] = []
    stage = -1
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        keyword, _, text = full.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, re.sub(r"\s+", " ", text).strip(), stage))
    return out


def build_args(path: Path) -> dict[str, str | None]:
    """Every ``ARG NAME[=default]`` of a Dockerfile (global and per stage): name -> default (None: none)."""
    args: dict[str, str | None] = {}
    for ins in instructions(path):
        if ins.keyword == "ARG":
            name, eq, default = ins.text.partition("=")
            args.setdefault(name, default.strip('"') if eq else None)
    return args


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether ``.dockerignore`` ``patterns`` keep ``path`` (relative, with ``/``) out of the build context:
    the last pattern matching the path or one of its parent folders decides, ``!`` re-includes."""
    result = False
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatchcase(p.rsplit("/", 1)[-1], pattern[3:]) for p in prefixes)
        else:
            hit = any(fnmatch.fnmatchcase(p, pattern) and p.count("/") == pattern.count("/") for p in prefixes)
        if hit:
            result = not negate
    return result


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
