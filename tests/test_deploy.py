"""The Kubernetes deployment (deploy/kubernetes/) and the trm image (Dockerfile), checked without a cluster.

No cluster, kubectl, kustomize or container engine exists where these tests run. They check instead:

- every kustomization renders, with the small kustomize below, and every rendered object (and every plain
  manifest file) validates against the Kubernetes API schemas of named versions (``kubernetes-validate``,
  strict: unknown fields fail); where ``kubectl`` is installed, ``kubectl kustomize`` renders the same;
- nothing renders until every image is pinned by digest (``pin-images.sh`` writes the component that pins
  them; here it runs with a stand-in ``crane``, since no registry is reachable where these tests run);
- Triton's control APIs are restricted to the key the agent holds, and the NetworkPolicy admits only
  inference traffic to Triton and only Prometheus to the metrics and agent ports;
- every ``trm`` command line (init container, sidecar, Dockerfile) parses with trm's own click CLI, with the
  ``$(VAR)`` references Kubernetes would expand resolved from the container's env, so they cannot drift
  from the code;
- the pieces agree: probe ports and the agent's ``--listen``, ``--repo``/``--cache`` and the volumes mounted
  there, Triton's flags and its container ports, Service ports and container ports, selectors and labels,
  the HPA's target and metric, no credential outside a Secret.

What the renderer does (the subset deploy/kubernetes uses, nothing more): ``resources`` (files, and
directories holding a kustomization.yaml), ``patches`` with ``path`` (strategic merge: maps merged key by key;
``containers``/``initContainers``/``env``/``volumes`` lists merged by ``name``; other lists replaced, among
them those the API marks atomic, an HPA's ``metrics``; ``$patch: delete`` of a whole object; a patch names its
target by kind and name), ``nameSuffix`` (with the name references kustomize rewrites for the kinds used here:
ConfigMap references in env and volumes, ``serviceAccountName``, an HPA's ``scaleTargetRef``), ``namespace``,
and ``components`` whose only field is ``images`` (name, newName, newTag, digest: ``name:tag@digest``, as
kustomize writes it). Any other kustomization field, or a patch outside that subset, fails the test rather
than being ignored. Not implemented: generators, replacements, label transformers, JSON 6902 patches.
"""

from __future__ import annotations

import atexit
import copy
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import click
import kubernetes_validate
import pytest
import yaml

from repo_manager.adapters.triton.restricted import OPEN_APIS, RESTRICTED_APIS
from repo_manager.cli import Context, cli
from repo_manager.cli.commands import COMMANDS
from repo_manager.core.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("production", "production-canary", "production-llm")
KUSTOMIZATIONS = ("base", *(f"overlays/{name}" for name in OVERLAYS))
# The oldest Kubernetes these manifests target (every field used is GA there) and the newest schema set
# that kubernetes-validate ships; both are bundled with the package, so no network is needed.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
# Custom resources have no schema in the Kubernetes API; they are checked as YAML and by the tests below.
CRD_GROUPS = ("monitoring.coreos.com/",)
AGENT_MISSING = "agent" not in COMMANDS
AGENT_XFAIL = pytest.mark.xfail(AGENT_MISSING, strict=True,
                                reason="`trm agent` is built on branch i12-agent; passes once it is merged")


# ---------------------------------------------------------------- a minimal, strict kustomize

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches", "namespace", "nameSuffix", "components"}
COMPONENT_FIELDS = {"apiVersion", "kind", "images"}
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
MERGE_BY_NAME = {"containers", "initContainers", "env", "volumes"}
ATOMIC_LISTS = {"metrics"}
"""Lists the Kubernetes API marks ``x-kubernetes-list-type: atomic`` (an HPA's ``metrics``): a patch replaces them."""
CLUSTER_SCOPED = {"Namespace"}


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def key_of(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def strategic_merge(target: Any, patch: Any, path: str = "") -> Any:
    if isinstance(patch, dict) and isinstance(target, dict):
        merged = dict(target)
        for key, value in patch.items():
            if key.startswith("$"):
                raise AssertionError(f"patch directive {key} at {path or '/'} is not implemented")
            merged[key] = strategic_merge(target[key], value, f"{path}/{key}") if key in target else value
        return merged
    if isinstance(patch, list) and isinstance(target, list):
        field = path.rsplit("/", 1)[-1]
        if field in ATOMIC_LISTS:
            return patch
        if field not in MERGE_BY_NAME:
            if any(isinstance(item, dict) for item in patch):
                raise AssertionError(f"patching the list {path} (merge key unknown to this renderer)")
            return patch
        merged = list(target)
        for item in patch:
            names = [entry["name"] for entry in merged]
            if item["name"] in names:
                index = names.index(item["name"])
                merged[index] = strategic_merge(merged[index], item, f"{path}[{item['name']}]")
            else:
                merged.append(item)
        return merged
    return patch


def rename_references(obj: dict[str, Any], renamed: dict[tuple[str, str], str]) -> None:
    """Rewrite the name references kustomize's nameSuffix rewrites, for the kinds these manifests use."""
    def new(kind: str, name: str) -> str:
        return renamed.get((kind, name), name)

    if obj["kind"] == "HorizontalPodAutoscaler":
        ref = obj["spec"]["scaleTargetRef"]
        ref["name"] = new(ref["kind"], ref["name"])
    if obj["kind"] != "Deployment":
        return
    pod = obj["spec"]["template"]["spec"]
    if "serviceAccountName" in pod:
        pod["serviceAccountName"] = new("ServiceAccount", pod["serviceAccountName"])
    for volume in pod.get("volumes", []):
        if "configMap" in volume:
            volume["configMap"]["name"] = new("ConfigMap", volume["configMap"]["name"])
        if "secret" in volume:
            volume["secret"]["secretName"] = new("Secret", volume["secret"]["secretName"])
    for container in pod.get("initContainers", []) + pod["containers"]:
        for item in container.get("env", []):
            ref = item.get("valueFrom", {})
            if "configMapKeyRef" in ref:
                ref["configMapKeyRef"]["name"] = new("ConfigMap", ref["configMapKeyRef"]["name"])
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                source["configMapRef"]["name"] = new("ConfigMap", source["configMapRef"]["name"])


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """``name[:tag][@digest]`` -> (name, tag, digest)."""
    image, _, digest = image.partition("@")
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    return name, tag or None, digest or None


def set_images(objects: list[dict[str, Any]], images: list[dict[str, str]]) -> None:
    """kustomize's images transformer, for the containers of Deployments."""
    unknown = {key for entry in images for key in entry} - {"name", "newName", "newTag", "digest"}
    assert not unknown, f"images fields this renderer does not implement: {unknown}"
    by_name = {entry["name"]: entry for entry in images}
    for obj in find(objects, "Deployment"):
        pod = obj["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            name, tag, digest = split_image(container["image"])
            if name in by_name:
                entry = by_name[name]
                name, tag, digest = entry.get("newName", name), entry.get("newTag", tag), entry.get("digest", digest)
                container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kustomize build directory`` would print, for the subset described above."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: kustomization fields this renderer does not implement: {unknown}"
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        objects += render(path) if path.is_dir() else load_yaml_documents(path)
    objects = copy.deepcopy(objects)
    for entry in kustomization.get("components", []):
        component = yaml.safe_load(((directory / entry).resolve() / "kustomization.yaml").read_text())
        assert component["kind"] == "Component" and set(component) <= COMPONENT_FIELDS, component
        set_images(objects, component.get("images", []))
    keys = [key_of(obj) for obj in objects]
    assert len(keys) == len(set(keys)), f"{directory}: the same object twice: {keys}"
    for patch_entry in kustomization.get("patches", []):
        assert set(patch_entry) == {"path"}, f"{directory}: only `path` patches are implemented: {patch_entry}"
        for patch in load_yaml_documents(directory / patch_entry["path"]):
            index = keys.index(key_of(patch))  # ValueError: a patch whose target does not exist
            if patch.get("$patch") == "delete":
                del objects[index], keys[index]
            else:
                objects[index] = strategic_merge(objects[index], patch)
    suffix = kustomization.get("nameSuffix", "")
    if suffix:
        renamed = {key_of(obj): obj["metadata"]["name"] + suffix for obj in objects
                   if obj["kind"] not in CLUSTER_SCOPED}
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["name"] += suffix
            rename_references(obj, renamed)
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


STAND_IN_CRANE = """#!/bin/sh
# A stand-in for `crane digest REF` (no registry is reachable where the tests run): a digest made from REF.
[ "$1" = digest ] && printf 'sha256:%s\\n' "$(printf %s "$2" | sha256sum | cut -c1-64)"
"""
PUSHED_TRM = "ghcr.io/example/trm:0.1.0"


def pin_images(tree: Path) -> subprocess.CompletedProcess[str]:
    """Run the tree's pin-images.sh as a user does after pushing the trm image, with the stand-in crane."""
    bin_dir = tree / ".stand-in-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "crane").write_text(STAND_IN_CRANE)
    (bin_dir / "crane").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["sh", str(tree / "pin-images.sh"), PUSHED_TRM], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


@functools.cache
def pinned_tree() -> Path:
    """A copy of deploy/kubernetes as a user's checkout is after pin-images.sh: what the tests render."""
    tree = Path(tempfile.mkdtemp(prefix="trm-deploy-")) / "kubernetes"
    atexit.register(shutil.rmtree, tree.parent, True)
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("kustomization.yaml.tmp"))
    (tree / "images" / "kustomization.yaml").unlink(missing_ok=True)  # (one pinned in this checkout)
    result = pin_images(tree)
    assert result.returncode == 0, result.stderr
    return tree


def rendered(name: str) -> list[dict[str, Any]]:
    return render(pinned_tree() / name)


def find(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = find(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def manifest_files() -> list[Path]:
    return sorted(path for path in K8S.rglob("*.yaml")
                  if path.name != "kustomization.yaml" and path.parent.name != "prometheus-adapter")


# ---------------------------------------------------------------- trm command lines, parsed by trm

def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion; an unknown variable is an error here (Kubernetes would keep it as is)."""
    def replace(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not defined in the container's env"
        return env[match.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", replace, value)


def container_env(container: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, str]:
    config_maps = {obj["metadata"]["name"]: obj.get("data", {}) for obj in find(objects, "ConfigMap")}
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        source = item["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] in config_maps, f"env {item['name']}: no ConfigMap {ref['name']}"
            assert ref["key"] in config_maps[ref["name"]], f"env {item['name']}: no key {ref['key']}"
            env[item["name"]] = config_maps[ref["name"]][ref["key"]]
        elif "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name"
            env[item["name"]] = "triton-7d9f8b6c5d-x2k4q"
        else:
            assert "secretKeyRef" in source, f"env {item['name']}: unexpected source {source}"
    return env


def parse_trm(argv: list[str], settings_file: Path | None = None) -> tuple[str, dict[str, Any]]:
    """Parse a trm command line exactly as `trm` would (no operation runs): the command and its params."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # click 8.2+: protected_args
        try:
            group = cli.make_context("trm", list(argv), resilient_parsing=False)
        except click.exceptions.Exit as exc:  # --version / --help: parsed, nothing to run
            assert exc.exit_code == 0
            return "", {}
        group.obj = Context(load_settings(settings_file, env={}))
        name, command, rest = cli.resolve_command(group, [*group.protected_args, *group.args])
        assert command is not None, f"trm has no command {argv[0]!r}"
        try:
            sub = command.make_context(name, rest, parent=group, resilient_parsing=False)
        except click.exceptions.Exit as exc:
            assert exc.exit_code == 0
            return name, {}
    return name, sub.params


def trm_containers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]
            if c.get("args") and split_image(c["image"])[0].endswith("/trm")}


def parsed_command(name: str, objects: list[dict[str, Any]], tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """The container's trm command line, with its env expanded and its settings file (from the ConfigMap)."""
    container = trm_containers(objects)[name]
    assert "command" not in container, "the trm image's entrypoint is trm; give only args"
    env = container_env(container, objects)
    settings_file = None
    if "TRM_CONFIG" in env:
        settings_file = tmp_path / Path(env["TRM_CONFIG"]).name
        settings_file.write_text(config_file_content(env["TRM_CONFIG"], container, objects))
    return parse_trm([expand(arg, env) for arg in container["args"]], settings_file)


def config_file_content(path: str, container: dict[str, Any], objects: list[dict[str, Any]]) -> str:
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = next(c for c in find(objects, "ConfigMap") if c["metadata"]["name"] == volume["configMap"]["name"])
    key = Path(path).name
    assert any(item["path"] == key for item in volume["configMap"].get("items", [{"path": key}]))
    return config_map["data"][key]


def mount_path(container: dict[str, Any], volume_name: str) -> str:
    paths = [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] == volume_name]
    assert len(paths) == 1, f"{container['name']} mounts {volume_name} {len(paths)} times"
    return paths[0]


def volume_at(container: dict[str, Any], path: str) -> str:
    names = [m["name"] for m in container.get("volumeMounts", []) if m["mountPath"].rstrip("/") == path.rstrip("/")]
    assert len(names) == 1, f"{container['name']}: nothing (or several things) mounted at {path}"
    return names[0]


def port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in container.get("ports", []) if p["name"] == port]
    assert numbers, f"{container['name']} has no port named {port}"
    return numbers[0]


def host_port(address: str) -> int:
    return int(address.rsplit(":", 1)[1].split("/", 1)[0])


def triton_flags(container: dict[str, Any]) -> dict[str, str]:
    args = container.get("command", []) + container.get("args", [])
    assert args[0] == "tritonserver"
    return dict(arg[2:].split("=", 1) for arg in args[1:])


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_kustomization_renders_to_objects_valid_for_the_kubernetes_api(name: str) -> None:
    objects = rendered(name)
    assert objects
    for version in K8S_VERSIONS:
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes "
                            f"{version}: {exc.message} at {'/'.join(map(str, exc.path))}")


def test_every_manifest_file_that_is_a_whole_object_is_valid_on_its_own() -> None:
    """Patches are partial objects (render() fails on a patch without a target); every other file validates."""
    patch_files = {(K8S / name / entry["path"]).resolve()
                   for name in KUSTOMIZATIONS
                   for entry in yaml.safe_load((K8S / name / "kustomization.yaml").read_text()).get("patches", [])}
    whole = [path for path in manifest_files() if path.resolve() not in patch_files]
    assert len(whole) >= 7
    for path in whole:
        for obj in load_yaml_documents(path):
            kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)


def test_custom_resources_and_adapter_values_are_well_formed() -> None:
    podmonitor = load_yaml_documents(K8S / "prometheus-adapter" / "podmonitor.yaml")[0]
    assert podmonitor["apiVersion"].startswith(CRD_GROUPS)
    container_ports = {p["name"] for c in one(rendered("overlays/production"), "Deployment")["spec"]["template"]
                       ["spec"]["containers"] for p in c.get("ports", [])}
    assert {e["port"] for e in podmonitor["spec"]["podMetricsEndpoints"]} <= container_ports
    service = one(rendered("overlays/production"), "Service")
    assert podmonitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]


def test_init_container_sync_command_parses_with_trm_and_matches_its_volumes(tmp_path: Path) -> None:
    for name in KUSTOMIZATIONS:
        objects = rendered(name)
        command, params = parsed_command("sync", objects, tmp_path)
        container = trm_containers(objects)["sync"]
        assert command == "sync"
        assert params["store"].startswith("s3://") and params["env"]
        assert volume_at(container, params["repository"]) == "model-repository"
        assert volume_at(container, params["cache_dir"]) == "node-cache"


@AGENT_XFAIL
def test_agent_sidecar_command_parses_with_trm(tmp_path: Path) -> None:
    for name in KUSTOMIZATIONS:
        objects = rendered(name)
        command, params = parsed_command("agent", objects, tmp_path)
        assert command == "agent"
        values = {str(value) for value in params.values()}
        assert {one(objects, "ConfigMap")["data"][key] for key in ("TRM_STORE", "TRM_ENV")} <= values
        # a drained pod must be out of the endpoints before the agent waits for in-flight requests
        probe = trm_containers(objects)["agent"]["readinessProbe"]
        if "drain_grace" in params:
            assert params["drain_grace"] >= probe["periodSeconds"] * probe["failureThreshold"]


def agent_args(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The agent's options as written in the manifest (parsed by trm in the test above)."""
    container = trm_containers(objects)["agent"]
    env = container_env(container, objects)
    args = [expand(arg, env) for arg in container["args"]]
    assert args[0] == "agent" and not args[1].startswith("-")
    options: dict[str, str] = {"store": args[1]}
    rest = args[2:]
    while rest:
        flag = rest.pop(0)
        assert flag.startswith("--"), f"unexpected argument {flag}"
        options[flag[2:]] = "" if flag in ("--json", "--no-side-by-side") else rest.pop(0)
    return options


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_agent_and_init_container_agree_with_probes_volumes_triton_and_the_agreed_interface(name: str) -> None:
    objects = rendered(name)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    agent, triton, sync = containers["agent"], containers["triton"], trm_containers(objects)["sync"]
    options = agent_args(objects)
    # the interface agreed with i12-agent (/work/wt/_notes/AGENT_CLI.md)
    assert set(options) <= {"store", "env", "repo", "cache", "url", "grpc-url", "listen", "interval", "jitter",
                            "max-unavailable", "no-side-by-side", "pod-name", "json"}
    sync_args = [expand(a, container_env(sync, objects)) for a in sync["args"]]
    assert options["store"] == sync_args[1] and options["env"] == sync_args[sync_args.index("--env") + 1]
    assert options["repo"] == sync_args[sync_args.index("--repo") + 1]
    assert options["cache"] == sync_args[sync_args.index("--cache") + 1]
    # probes hit the port the agent listens on, on the paths it serves
    listen = host_port(options["listen"])
    assert port_number(agent, "agent") == listen
    assert agent["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert agent["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe"):
        assert port_number(agent, agent[probe]["httpGet"]["port"]) == listen
    # the agent and Triton see the same repository; the cache is the node-local hostPath
    flags = triton_flags(triton)
    assert flags["model-control-mode"] == "explicit"
    assert volume_at(agent, options["repo"]) == volume_at(triton, flags["model-repository"]) == "model-repository"
    assert volume_at(agent, options["cache"]) == "node-cache"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["model-repository"]
    assert volumes["node-cache"]["hostPath"]["type"] == "DirectoryOrCreate"
    assert not any(m.get("readOnly") for m in agent["volumeMounts"] if m["name"] in ("model-repository",
                                                                                        "node-cache"))
    # the agent talks to the Triton beside it, on Triton's own ports
    assert options["url"] == f"http://127.0.0.1:{flags['http-port']}"
    assert host_port(options["grpc-url"]) == int(flags["grpc-port"])
    for port_name, flag in (("http", "http-port"), ("grpc", "grpc-port"), ("metrics", "metrics-port")):
        assert port_number(triton, port_name) == int(flags[flag])
    # the GPU is requested by Triton, the only container that uses it
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert all("nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}) for c in (agent, sync))


def test_service_ports_reach_container_ports_and_selectors_match_the_pods() -> None:
    production, canary = rendered("overlays/production"), rendered("overlays/production-canary")
    service = one(production, "Service")
    assert {p["port"] for p in service["spec"]["ports"]} == {8000, 8001}, "the Service publishes inference only"
    for objects in (production, canary):
        deployment = one(objects, "Deployment")
        pod = deployment["spec"]["template"]
        named = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert named[port["targetPort"]] == port["port"]
        labels = pod["metadata"]["labels"]
        # the one Service sends traffic to both tracks; each Deployment and PDB select only their own
        assert service["spec"]["selector"].items() <= labels.items()
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert one(objects, "PodDisruptionBudget")["spec"]["selector"] == deployment["spec"]["selector"]
        assert deployment["metadata"]["namespace"] == service["metadata"]["namespace"]
    selectors = [one(objects, "Deployment")["spec"]["selector"]["matchLabels"] for objects in (production, canary)]
    assert selectors[0] != selectors[1]
    assert not find(canary, "Service"), "the canary answers through the production Service"


def test_overlays_follow_their_environments_with_distinct_names() -> None:
    production, canary = rendered("overlays/production"), rendered("overlays/production-canary")
    assert one(production, "ConfigMap")["data"]["TRM_ENV"] == "production"
    assert one(canary, "ConfigMap")["data"]["TRM_ENV"] == "production-canary"
    assert one(production, "ConfigMap")["data"]["TRM_STORE"] == one(canary, "ConfigMap")["data"]["TRM_STORE"]
    names = {(o["kind"], o["metadata"]["name"]) for o in production if o["kind"] != "Namespace"}
    assert not names & {(o["kind"], o["metadata"]["name"]) for o in canary}, "canary objects overwrite production"
    assert one(canary, "Deployment")["spec"]["replicas"] == 1
    for objects in (production, canary):  # every reference points at an object of the same render
        pod = one(objects, "Deployment")["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == one(objects, "ServiceAccount")["metadata"]["name"]
        for container in pod["initContainers"] + pod["containers"]:
            container_env(container, objects)


def test_settings_file_in_the_config_map_loads_and_declares_the_canary_wave(tmp_path: Path) -> None:
    config = tmp_path / "trm.yaml"
    config.write_text(one(rendered("base"), "ConfigMap")["data"]["trm.yaml"])
    settings = load_settings(config, env={})
    assert settings.environments["production"]["requires"] == "production-canary"
    assert "production-canary" in settings.environments
    try:  # trm's own reading of the requirement, where this branch has it (i12-agent's promote waves)
        from repo_manager.ops.promote.waves import requirement
    except ImportError:
        return
    assert requirement(settings, "production").env == "production-canary"
    assert requirement(settings, "production-canary") is None


def test_hpa_scales_the_production_deployment_on_queue_depth_with_a_floor_of_two() -> None:
    objects = rendered("overlays/production")
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(objects, "Deployment")["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] == 2
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    (rule,) = [r for r in adapter["rules"]["custom"] if r["name"]["as"] == "triton_queued_requests"]
    assert "nv_inference_pending_request_count" in rule["seriesQuery"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_llm_overlay_scales_on_the_engines_waiting_requests_and_is_production_otherwise() -> None:
    """overlays/production-llm: the HPA's pods metric is vLLM's waiting requests per pod, served by the
    adapter rule from the series trm's vLLM backend reports and `trm observe rules` alerts on; Triton's
    queue stays a second metric; every other object is production's."""
    from repo_manager.ops.observe.rules import WAITING

    llm, production = rendered("overlays/production-llm"), rendered("overlays/production")
    hpa = one(llm, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(llm, "Deployment")["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["behavior"] == one(
        production, "HorizontalPodAutoscaler")["spec"]["behavior"]
    metrics = {m["pods"]["metric"]["name"]: m for m in hpa["spec"]["metrics"]}
    assert set(metrics) == {"vllm_requests_waiting", "triton_queued_requests"}
    assert all(m["type"] == "Pods" for m in metrics.values())
    assert metrics["vllm_requests_waiting"]["pods"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    rules = {r["name"]["as"]: r for r in adapter["rules"]["custom"]}
    assert set(metrics) <= set(rules)  # every metric the HPA asks for, the adapter serves
    waiting = rules["vllm_requests_waiting"]
    assert waiting["seriesQuery"].startswith(WAITING + "{") and waiting["name"]["matches"] == f"^{WAITING}$"
    assert set(waiting["resources"]["overrides"]) == {"namespace", "pod"} and "sum(" in waiting["metricsQuery"]
    assert sorted((o for o in llm if o["kind"] != "HorizontalPodAutoscaler"), key=key_of) == sorted(
        (o for o in production if o["kind"] != "HorizontalPodAutoscaler"), key=key_of)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_security_context_images_and_credentials(name: str) -> None:
    objects = rendered(name)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    for container in pod["initContainers"] + pod["containers"]:
        image = container["image"]
        assert DIGEST.search(image), f"{container['name']}: image {image} is not pinned by digest"
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True, f"{container['name']} has a writable root filesystem"
        assert security["capabilities"]["drop"] == ["ALL"]
        if security.get("runAsUser") == 0:  # the one root step: chown of the hostPath cache, nothing else
            assert container["command"][0] == "chown" and security["capabilities"]["add"] == ["CHOWN"]
        for item in container.get("env", []):
            if item["name"].startswith("AWS_"):
                assert "secretKeyRef" in item["valueFrom"], f"{item['name']} outside a Secret"
    text = json.dumps(objects)
    assert not re.search(r"[a-z0-9+.-]+://[^/\s\"]*@", text), "credentials in a URL"
    assert not find(objects, "Secret"), "no Secret is shipped: the user creates it"


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_trm_command_lines_parse_with_trm() -> None:
    instructions = dockerfile_instructions(ROOT / "Dockerfile")
    entrypoint = [json.loads(arg) for op, arg in instructions if op == "ENTRYPOINT"]
    cmd = [json.loads(arg) for op, arg in instructions if op == "CMD"]
    assert entrypoint == [["trm"]] and len(cmd) == 1
    parse_trm(cmd[0])
    runs = [json.loads(arg) if arg.startswith("[") else shlex.split(arg) for op, arg in instructions if op == "RUN"]
    trm_runs = [run for run in runs if run[0] == "trm"]
    assert trm_runs
    for run in trm_runs:
        parse_trm(run[1:])
    assert instructions[0][0] == "FROM" and re.search(r":[\w.-]+$", instructions[0][1])
    assert ("USER", "1000:1000") in instructions
    # the image's uid is the one the pod runs as
    pod = one(rendered("base"), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 1000


def test_dockerignore_sends_only_what_pip_needs() -> None:
    lines = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0] == "*"
    copied = [name for op, arg in dockerfile_instructions(ROOT / "Dockerfile") if op == "COPY"
              for name in arg.split()[:-1]]
    assert copied
    for name in copied:
        assert (f"!{name}/" if (ROOT / name).is_dir() else f"!{name}") in lines, f"{name} is not sent to the build"


# ---------------------------------------------------------------- exposure: images, Triton's APIs, the network

def test_nothing_renders_until_every_image_is_pinned_by_digest(tmp_path: Path) -> None:
    """The checkout as cloned (no images component) does not render, with kustomize or with this renderer;
    after pin-images.sh every image of every kustomization carries a digest."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    (tree / "images" / "kustomization.yaml").unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError):
        render(tree / "overlays" / "production")
    if shutil.which("kubectl"):
        refused = subprocess.run(["kubectl", "kustomize", str(tree / "overlays" / "production")],
                                 capture_output=True, text=True, timeout=120, check=False)
        assert refused.returncode != 0 and "images" in refused.stderr
    bad = subprocess.run(["sh", str(tree / "pin-images.sh"), "ghcr.io/example/trm"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "usage" in bad.stderr  # a trm image without its tag
    result = pin_images(tree)
    assert result.returncode == 0, result.stderr
    for name in KUSTOMIZATIONS:
        pod = one(render(tree / name), "Deployment")["spec"]["template"]["spec"]
        images = [c["image"] for c in pod["initContainers"] + pod["containers"]]
        assert all(DIGEST.search(image) for image in images), images
        assert {split_image(image)[0] for image in images} == {"nvcr.io/nvidia/tritonserver", "ghcr.io/example/trm"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kubectl_kustomize_renders_what_this_renderer_renders(name: str) -> None:
    result = subprocess.run(["kubectl", "kustomize", str(pinned_tree() / name)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    theirs = sorted((o for o in yaml.safe_load_all(result.stdout) if o), key=key_of)
    assert sorted(rendered(name), key=key_of) == theirs


def test_triton_restricts_its_control_apis_to_the_key_only_the_agent_holds(tmp_path: Path) -> None:
    objects = rendered("overlays/production")
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["initContainers"] + pod["containers"]}
    header = Settings().triton_api_header
    flags = triton_flags(containers["triton"])
    expected = f"{','.join(RESTRICTED_APIS)}:{header}=$(TRM_TRITON_API_KEY)"
    assert flags["http-restricted-api"] == flags["grpc-restricted-protocol"] == expected
    assert not set(OPEN_APIS) & set(RESTRICTED_APIS) and "model-repository" in RESTRICTED_APIS
    # the key comes from one Secret, required (no pod with an open API), to Triton and the agent only
    sources = {name: next((e["valueFrom"] for e in c.get("env", []) if e["name"] == "TRM_TRITON_API_KEY"), None)
               for name, c in containers.items()}
    required = {"secretKeyRef": {"name": "trm-triton-api-key", "key": "key"}}
    assert sources == {"cache-owner": None, "sync": None, "triton": required, "agent": required}
    assert expand(flags["http-restricted-api"], {"TRM_TRITON_API_KEY": "k" * 32}).endswith(f"={'k' * 32}")
    # trm in the agent container reads the key from that variable
    assert load_settings(env={"TRM_TRITON_API_KEY": "k" * 32}).triton_api_key == "k" * 32
    # the agent listens on the pod's address (the kubelet probes it), and talks to Triton over loopback
    options = agent_args(objects)
    assert options["listen"].startswith("0.0.0.0:") and options["url"].startswith("http://127.0.0.1:")
    # Triton's root filesystem is read-only: what it writes goes to emptyDirs
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/tmp", "/dev/shm", "/var/log"):
        assert "emptyDir" in volumes[volume_at(containers["triton"], path)]


def test_network_policy_admits_inference_from_the_cluster_and_metrics_and_agent_only_from_prometheus() -> None:
    for name in OVERLAYS:
        objects = rendered(f"overlays/{name}")
        (policy,) = find(objects, "NetworkPolicy")
        deployment = one(objects, "Deployment")
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        containers = deployment["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])}
        open_to_all, from_prometheus = policy["spec"]["ingress"]
        assert "from" not in open_to_all and {p["port"] for p in open_to_all["ports"]} == {"http", "grpc"}
        assert {p["port"] for p in from_prometheus["ports"]} == {"metrics", "agent"}
        (peer,) = from_prometheus["from"]
        assert peer["namespaceSelector"]["matchLabels"] and peer["podSelector"]["matchLabels"]
        assert set(ports) == {"http", "grpc", "metrics", "agent"}, "a container port the policy does not mention"
    podmonitor = load_yaml_documents(K8S / "prometheus-adapter" / "podmonitor.yaml")[0]
    assert {e["port"] for e in podmonitor["spec"]["podMetricsEndpoints"]} == {"metrics", "agent"}
