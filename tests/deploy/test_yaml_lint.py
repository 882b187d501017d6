"""Every YAML file under deploy/ passes yamllint with the repository's .yamllint (syntax, duplicate keys,
indentation, truthy values, line length), and so does the YAML that ConfigMaps carry inside them."""
from pathlib import Path

import pytest
import yaml

linter = pytest.importorskip("yamllint.linter", reason="the test extra installs it")
YamlLintConfig = pytest.importorskip("yamllint.config").YamlLintConfig

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "deploy").rglob("*.yaml"))
CONFIG = YamlLintConfig(file=str(ROOT / ".yamllint"))


def problems(text: str, path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{p.line}:{p.column}: {p.message} ({p.rule})"
            for p in linter.run(text, CONFIG, str(path))]


def test_deploy_has_the_yaml_files_this_test_is_about():
    names = {str(f.relative_to(ROOT / "deploy")) for f in FILES}
    assert {"compose.yaml", "kubernetes/base/kustomization.yaml", "kubernetes/base/deployment.yaml",
            "kubernetes/overlays/cpu/kustomization.yaml", "kubernetes/overlays/gpu/kustomization.yaml",
            "kubernetes/prometheus-adapter/adapter-config.yaml"} <= names


@pytest.mark.parametrize("path", FILES, ids=[str(f.relative_to(ROOT / "deploy")) for f in FILES])
def test_yamllint_finds_nothing(path):
    found = problems(path.read_text(), path)
    for doc in yaml.safe_load_all(path.read_text()):  # YAML inside a ConfigMap (the adapter's rules)
        if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
            for key, value in doc.get("data", {}).items():
                if key.endswith((".yaml", ".yml")):
                    found += problems(value, path / key)
    assert not found, "\n".join(found)


def test_yamllint_reports_a_duplicate_key_and_a_bare_truthy_value():
    """The lint test can fail: the mistakes it is there for are reported."""
    found = problems("a: 1\na: 2\nb: yes\n", ROOT / "deploy" / "x.yaml")
    assert any("key-duplicates" in p for p in found) and any("truthy" in p for p in found), found
