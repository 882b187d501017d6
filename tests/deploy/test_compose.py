"""deploy/compose.yaml and deploy/nginx.conf: a valid Compose file (compose-spec, the Compose
specification's parser), two replicas per profile behind nginx gated on /ready, and an nginx config
that nginx's own parser (crossplane) accepts, with streaming-friendly proxying to both replicas."""
import argparse
import json
import re
from pathlib import Path

import pytest
import yaml

from kvforge.server.app import DEFAULT_MAX_BODY_BYTES
from kvforge.server.cli import add_serve_parser

crossplane = pytest.importorskip("crossplane", reason="the test extra installs it")
PyCompose = pytest.importorskip("compose_spec", reason="the test extra installs it").PyCompose

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROFILES = {"gpu": ("kvforge-0", "kvforge-1", "lb"), "cpu": ("kvforge-cpu-0", "kvforge-cpu-1", "lb-cpu")}
SIZES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def interpolated(value, env: dict[str, str] | None = None):
    """Compose's variable interpolation on a parsed file: ``${VAR:-default}`` in string values, with
    ``env`` (none set: every default)."""
    env = env or {}
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), value)
    if isinstance(value, list):
        return [interpolated(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolated(v, env) for k, v in value.items()}
    return value


def compose(text: str | None = None) -> dict:
    """The Compose file as ``docker compose config`` sees it: YAML anchors and merge keys resolved,
    variables interpolated, then checked against the Compose specification."""
    data = interpolated(yaml.safe_load(text if text is not None else (DEPLOY / "compose.yaml").read_text()))
    project = PyCompose.from_json(json.dumps(data))  # ValueError naming the field and line when invalid
    project.validate()
    return data


def serve_args(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvforge")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *args])


def seconds(duration: str) -> float:
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", duration))


def test_the_compose_file_follows_the_compose_specification():
    services = compose()["services"]
    assert set(services) == {name for names in PROFILES.values() for name in names}


@pytest.mark.parametrize("typo", ["stop_grace_periodd: 40s", "condition: service_healthyy", "start_period: 600q"])
def test_the_specification_check_refuses_a_typo(typo):
    """The validity test can fail: a misspelt key, value or duration is refused."""
    text = (DEPLOY / "compose.yaml").read_text()
    original = {"stop_grace_periodd": "stop_grace_period: 40s", "condition": "condition: service_healthy",
                "start_period": "start_period: 600s"}[typo.split(":")[0]]
    assert original in text
    with pytest.raises(ValueError):
        compose(text.replace(original, typo, 1))


@pytest.mark.parametrize("profile", sorted(PROFILES), ids=[f"profile-{p}" for p in sorted(PROFILES)])
def test_two_replicas_behind_nginx_which_starts_once_both_are_ready(profile):
    services = compose()["services"]
    *replicas, lb = PROFILES[profile]
    assert all(services[name]["profiles"] == [profile] for name in PROFILES[profile])
    for name in replicas:
        replica = services[name]
        check = replica["healthcheck"]["test"]
        assert check[0] == "CMD" and "http://127.0.0.1:8000/ready" in check[-1]
        args = serve_args(replica["command"])
        assert seconds(replica["stop_grace_period"]) > args.shutdown_timeout
        assert replica["restart"] == "unless-stopped", "a server whose engine died exits: start it again"
        assert "8000" in replica["expose"] and "ports" not in replica, "only nginx is published"
        assert replica["build"]["dockerfile"] == {"gpu": "Dockerfile", "cpu": "Dockerfile.cpu"}[profile]
    assert services[lb]["depends_on"] == {name: {"condition": "service_healthy"} for name in replicas}
    upstreams = {v for k, v in services[lb]["environment"].items() if k.startswith("KVFORGE_UPSTREAM_")}
    assert upstreams == {f"{name}:8000" for name in replicas}
    assert services[lb]["ports"] == ["8000:80"]


def test_each_gpu_replica_reserves_its_own_gpu():
    services = compose()["services"]
    devices = [services[name]["deploy"]["resources"]["reservations"]["devices"] for name in PROFILES["gpu"][:2]]
    assert all(len(d) == 1 and d[0]["driver"] == "nvidia" and d[0]["capabilities"] == ["gpu"] for d in devices)
    assert devices[0][0]["device_ids"] != devices[1][0]["device_ids"]
    assert all("deploy" not in services[name] for name in PROFILES["cpu"])


def test_the_model_and_port_come_from_the_environment():
    data = interpolated(yaml.safe_load((DEPLOY / "compose.yaml").read_text()),
                        {"KVFORGE_MODEL": "org/other-model", "KVFORGE_PORT": "9000"})
    assert data["services"]["kvforge-0"]["command"][0] == "org/other-model"
    assert data["services"]["lb"]["ports"] == ["9000:80"]


def directives(blocks: list[dict], name: str) -> list[dict]:
    found = []
    for block in blocks:
        if block["directive"] == name:
            found.append(block)
        found += directives(block.get("block", []), name)
    return found


@pytest.fixture(scope="module")
def nginx():
    env = compose()["services"]["lb"]["environment"]
    text = re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), m.group(0)), (DEPLOY / "nginx.conf").read_text())
    assert "${" not in text, "a placeholder compose does not set"
    return env, text


def test_nginx_accepts_the_config_and_balances_over_both_replicas(nginx, tmp_path):
    env, text = nginx
    main = tmp_path / "nginx.conf"
    main.write_text("events {}\nhttp {\n" + text + "\n}\n")
    parsed = crossplane.parse(str(main), check_ctx=True, check_args=True)
    assert parsed["status"] == "ok", parsed["errors"]
    blocks = parsed["config"][0]["parsed"]
    (upstream,) = directives(blocks, "upstream")
    servers = [d["args"][0] for d in directives(upstream["block"], "server")]
    assert servers == [env["KVFORGE_UPSTREAM_0"], env["KVFORGE_UPSTREAM_1"]]
    assert directives(upstream["block"], "least_conn")
    (proxy,) = [d for d in directives(blocks, "location") if d["args"] == ["/"]]
    settings = {d["directive"]: d["args"] for d in proxy["block"] if d["directive"] != "proxy_set_header"}
    headers = {d["args"][0]: d["args"][1] for d in proxy["block"] if d["directive"] == "proxy_set_header"}
    assert settings["proxy_pass"] == [f"http://{upstream['args'][0]}"]
    # streaming: every SSE event passed on at once, long generations not cut off, keep-alive upstream
    assert settings["proxy_buffering"] == ["off"] and settings["proxy_cache"] == ["off"]
    assert seconds(settings["proxy_read_timeout"][0]) >= 600
    assert settings["proxy_http_version"] == ["1.1"] and headers["Connection"] == ""
    assert headers["X-Request-Id"] == "$kvforge_request_id"
    (body_limit,) = directives(blocks, "client_max_body_size")
    size = body_limit["args"][0]
    assert int(size[:-1]) * SIZES[size[-1].lower()] >= DEFAULT_MAX_BODY_BYTES


def test_the_nginx_check_refuses_a_misplaced_directive(tmp_path):
    """The config test can fail: a directive outside its context is an error."""
    main = tmp_path / "nginx.conf"
    main.write_text("events {}\nhttp {\n server { proxy_buffering off; }\n least_conn;\n}\n")
    assert crossplane.parse(str(main), check_ctx=True, check_args=True)["status"] == "failed"
