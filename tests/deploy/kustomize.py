"""A small Kustomize renderer for the subset deploy/kubernetes/ uses, so its tests need only pip packages.

It renders what ``kubectl kustomize DIR`` (Kustomize v5) renders for kustomizations made of:
``resources`` (files, and directories holding a kustomization), ``configMapGenerator`` (``files``,
``literals``, ``behavior: create | replace | merge``), ``patches`` (a ``path`` to a strategic-merge
patch, matched to its target by kind and name) and ``images`` (``newName``, ``newTag``, ``digest``).
Any other key is a ``ValueError`` naming it, so a kustomization that outgrows this subset fails its
tests instead of being rendered wrongly. ``tests/deploy/test_kubernetes.py`` compares the output with
``kubectl kustomize`` wherever kubectl is installed.

Generated ConfigMaps get Kustomize's content-hash suffix at the end, and every reference to them from
a pod template is renamed with it: editing the engine options rolls the pods.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "configMapGenerator", "patches", "images"}
#: strategic-merge keys of the lists in a pod template (Kubernetes' ``patchMergeKey``); every other
#: list is replaced whole, as Kubernetes does for lists without one (args, command, tolerations)
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "volumeMounts": "mountPath",
              "env": "name", "ports": "containerPort", "volumeDevices": "devicePath"}
#: ``hash.go``'s alphabet change: the first ten hex digits, with these letters swapped so a suffix
#: never looks like a number or spells a word
_HASH_LETTERS = str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"})


def build(directory: str | Path) -> list[Resource]:
    """The resources ``kubectl kustomize directory`` prints, as dicts (in the order they were loaded)."""
    resources, generated = _render(Path(directory))
    return _add_name_hashes(resources, generated)


def _kustomization(directory: Path) -> dict[str, Any]:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            data = yaml.safe_load((directory / name).read_text()) or {}
            unknown = sorted(set(data) - SUPPORTED_KEYS)
            if unknown:
                raise ValueError(f"{directory / name}: {unknown} not supported by tests/deploy/kustomize.py "
                                 f"(it renders {sorted(SUPPORTED_KEYS)})")
            return data
    raise ValueError(f"{directory}: no kustomization file")


def _render(directory: Path) -> tuple[list[Resource], set[str]]:
    """A kustomization's resources before name hashing, and the names of the ConfigMaps it generated."""
    k = _kustomization(directory)
    resources: list[Resource] = []
    generated: set[str] = set()
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            sub, sub_generated = _render(path)
            resources += sub
            generated |= sub_generated
        else:
            resources += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for spec in k.get("configMapGenerator", []):
        _generate_config_map(directory, spec, resources)
        generated.add(spec["name"])
    for patch in k.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{directory}: patches entry {patch}: only {{path: FILE}} is supported")
        body = yaml.safe_load((directory / patch["path"]).read_text())
        target = _find(resources, body["kind"], body["metadata"]["name"])
        resources[resources.index(target)] = strategic_merge(target, body)
    for image in k.get("images", []):
        for resource in resources:
            for container in _containers(resource):
                _set_image(container, image)
    return resources, generated


def _generate_config_map(directory: Path, spec: dict[str, Any], resources: list[Resource]) -> None:
    unknown = sorted(set(spec) - {"name", "files", "literals", "behavior"})
    if unknown:
        raise ValueError(f"{directory}: configMapGenerator {spec.get('name')!r}: {unknown} not supported")
    data: dict[str, str] = {}
    for entry in spec.get("files", []):
        key, _, path = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[key] = (directory / path).read_text()
    for literal in spec.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    behavior = spec.get("behavior", "create")
    if behavior == "create":
        resources.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": spec["name"]}, "data": data})
        return
    if behavior not in ("replace", "merge"):
        raise ValueError(f"{directory}: configMapGenerator {spec['name']!r}: behavior {behavior!r}")
    existing = _find(resources, "ConfigMap", spec["name"])
    existing["data"] = data if behavior == "replace" else {**existing.get("data", {}), **data}


def _find(resources: list[Resource], kind: str, name: str) -> Resource:
    for resource in resources:
        if resource["kind"] == kind and resource["metadata"]["name"] == name:
            return resource
    raise ValueError(f"no {kind} named {name!r} to patch or replace")


def strategic_merge(target: Any, patch: Any, field: str | None = None) -> Any:
    """``patch`` merged into ``target`` the way ``kubectl patch --type strategic`` merges pod specs:
    maps recursively, lists of ``MERGE_KEYS`` by their key, other lists and scalars replaced."""
    if isinstance(target, dict) and isinstance(patch, dict):
        if any(key.startswith("$") for key in patch):
            raise ValueError(f"patch directives {sorted(k for k in patch if k.startswith('$'))} not supported")
        out = copy.deepcopy(target)
        for key, value in patch.items():
            out[key] = strategic_merge(out[key], value, key) if key in out else copy.deepcopy(value)
        return out
    if isinstance(target, list) and isinstance(patch, list) and field in MERGE_KEYS:
        # NOTE: Kustomize (kyaml) lists the patch's items first, merged into their match, then the
        # target's other items in their order
        key = MERGE_KEYS[field]
        matched = {item.get(key) for item in patch}
        old = {item.get(key): item for item in target}
        merged = [strategic_merge(old[item.get(key)], item) if item.get(key) in old else copy.deepcopy(item)
                  for item in patch]
        return merged + [copy.deepcopy(item) for item in target if item.get(key) not in matched]
    return copy.deepcopy(patch)


def _pod_spec(resource: Resource) -> dict[str, Any] | None:
    if resource["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
        return resource["spec"]["template"]["spec"]
    return None


def _containers(resource: Resource) -> list[dict[str, Any]]:
    spec = _pod_spec(resource)
    return [] if spec is None else spec.get("initContainers", []) + spec.get("containers", [])


def _set_image(container: dict[str, Any], image: dict[str, Any]) -> None:
    """Kustomize's ``images`` transformer: an image whose name (without tag or digest) matches."""
    current = container["image"]
    name, _, digest = current.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    if name != image["name"]:
        return
    name = image.get("newName", name)
    if "digest" in image:
        container["image"] = f"{name}@{image['digest']}"
    elif "newTag" in image:
        container["image"] = f"{name}:{image['newTag']}"
    else:
        container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def config_map_hash(config_map: Resource) -> str:
    """Kustomize's suffix for a generated ConfigMap: sha256 of its kind and data as Go's ``json.Marshal``
    writes them (sorted keys, ``<``, ``>`` and ``&`` escaped), first ten hex digits, letters swapped.
    NOTE: Kustomize v5 hashes the generated object before it is named, so ``name`` is ``""`` (checked
    against ``kubectl kustomize``, Kustomize v5.5)."""
    encoded = {"kind": "ConfigMap", "name": "", "data": config_map.get("data", {})}
    if config_map.get("binaryData"):
        encoded["binaryData"] = config_map["binaryData"]
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return hashlib.sha256(text.encode()).hexdigest()[:10].translate(_HASH_LETTERS)


def _add_name_hashes(resources: list[Resource], generated: set[str]) -> list[Resource]:
    renamed: dict[str, str] = {}
    for resource in resources:
        name = resource["metadata"]["name"]
        if resource["kind"] == "ConfigMap" and name in generated:
            renamed[name] = f"{name}-{config_map_hash(resource)}"
            resource["metadata"]["name"] = renamed[name]
    for resource in resources:
        spec = _pod_spec(resource)
        if spec is None:
            continue
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                volume["configMap"]["name"] = renamed.get(volume["configMap"]["name"], volume["configMap"]["name"])
        for container in _containers(resource):
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    ref = source["configMapRef"]
                    ref["name"] = renamed.get(ref["name"], ref["name"])
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("configMapKeyRef")
                if ref is not None:
                    ref["name"] = renamed.get(ref["name"], ref["name"])
    return resources
