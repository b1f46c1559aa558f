"""The deployment files: Kubernetes manifests, the compose file, the images' install steps, and the
probe and live-run modules they run.

No Docker engine and no Kubernetes cluster are at hand, so this checks what can be checked without
them: kustomize (kubectl's) builds every kustomization, every object passes the Kubernetes JSON
schemas (strict: an unknown field fails), the objects agree with each other and with the code (service
names, replicas, the cluster spec, the NATS URL and Secret; in the GPU overlay, the node agents'
node name, address, GPUs and checkpoint volume), the compose file passes the compose spec's schema,
the Dockerfiles install as the Makefile does, the NATS configuration forms a 3-node JetStream cluster
with authentication (its addresses moved to loopback), and the probe tells a serving service from a
missing one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.resources
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import nats.js.errors
import pytest
import yaml
from kubernetes_validate import utils as k8s_schema

from launcher.live_run import create_live_run, live_request
from launcher.nats import free_loopback_port, nats_server_binary
from launcher.stack import SERVICES
from shared import permissions, storage, subjects
from shared.bus import Bus
from shared.bus.connection import REPLICAS_ENV, SERVER_ENV
from shared.cluster import load_cluster
from shared.credentials import connect_options
from shared.runner import new_service
from shared.schema.runs import RunCheckpoint
from shared.teams import load_team_file

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
BUILDS = {"default": K8S, "gpu": K8S / "overlays" / "gpu"}
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are checked against
NAMESPACE = "goodput"
SECRET = "goodput-nats-auth"
REPLICAS = {"policy": 3, "estimator": 2, "api": 2, "profiler": 2, "placer": 2}
SERVICE_NAMES = {
    "api": subjects.API_SERVICE,
    "profiler": subjects.PROFILER_SERVICE,
    "estimator": subjects.ESTIMATOR_SERVICE,
    "policy": subjects.POLICY_SERVICE,
    "placer": subjects.PLACER_SERVICE,
    "executor": subjects.EXECUTOR_SERVICE,
}
ROLE_OF = {"node": "executor"}  # a node agent (GOODPUT_SERVICE=node) logs in as the executor's role
PASSWORD = "gp4f1c0e9a7b3d5e2c8a6f0b1d3e5c7a9"  # the shape docs/deploy.md makes: a letter, then hex
ACCESS = (*permissions.ROLES, permissions.DEFAULT_LOGIN)  # every role, and the default login: one key each
PASSWORDS = {role: f"{PASSWORD[:-1]}{index}" for index, role in enumerate(ACCESS)}
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job")
METRICS_PORT = 9464  # where every service's pod serves its metrics (--metrics-port; docs/metrics.md)
METRICS_SECRET = "goodput-metrics-token"  # the operator's bearer token that a scrape sends: its key `token`
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yaml"  # the scrape configuration shipped for Kubernetes


def tool(name: str) -> str:
    """A command-line tool of the dev extras: beside this python, else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    assert found, f"no `{name}` next to {sys.executable} or on PATH: install the dev extras (pip install -e '.[dev]')"
    return found


@functools.cache
def built(name: str) -> tuple[dict, ...]:
    """The objects `kubectl kustomize` builds from BUILDS[name]."""
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(BUILDS[name])], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kustomize build of {BUILDS[name]} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(name: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in built(name) if o["kind"] == kind}


def schema_errors(obj: dict) -> str | None:
    """Why `obj` fails the Kubernetes schema (strict), or None."""
    try:
        k8s_schema.validate(obj, K8S_VERSION, strict=True)
    except k8s_schema.ValidationError as error:
        return f"{'.'.join(map(str, error.path))}: {error.message}"
    except k8s_schema.SchemaNotFoundError as error:
        return error.message
    return None


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def option(container: dict, name: str) -> str | None:
    """The value after `name` in the container's args, or None."""
    args = container.get("args", [])
    return args[args.index(name) + 1] if name in args else None


def env_entry(container: dict, value: str) -> dict:
    """The env entry an argument `$(NAME)` names (Kubernetes expands it from the container's env)."""
    match = re.fullmatch(r"\$\((\w+)\)", value or "")
    assert match, f"{value!r} is not a $(VAR) reference"
    return env_of(container)[match.group(1)]


def is_node_agent(workload: dict) -> bool:
    """A node agent's pods (`python -m services.node --node NAME`), not a service's."""
    return option(containers(workload)[0], "--node") is not None


def mount_of(workload: dict, claim: str) -> str:
    """Where the first container mounts the PersistentVolumeClaim `claim`."""
    pod = workload["spec"]["template"]["spec"]
    names = {v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == claim}
    [path] = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] in names]
    return path


def service_workloads(name: str) -> dict[str, list[dict]]:
    """Each goodput service's workloads in build `name` (its pods' GOODPUT_SERVICE)."""
    found: dict[str, list[dict]] = {}
    for obj in built(name):
        if obj["kind"] in WORKLOADS:
            service = env_of(containers(obj)[0]).get("GOODPUT_SERVICE", {}).get("value")
            service = ROLE_OF.get(service, service)
            if service:
                found.setdefault(service, []).append(obj)
    return found


def password_mounts(workload: dict) -> dict[str, set[str]]:
    """Each container's NATS password Secret keys that it mounts (init containers included)."""
    pod = workload["spec"]["template"]["spec"]
    keys = {
        v["name"]: {i["key"] for i in v["secret"].get("items", [])} or {"*"}  # "*": every key
        for v in pod.get("volumes", [])
        if v.get("secret", {}).get("secretName") == SECRET
    }
    return {
        c["name"]: set().union(*(keys[m["name"]] for m in c.get("volumeMounts", []) if m["name"] in keys))
        for c in pod.get("initContainers", []) + pod["containers"]
    }


def role_problems(workload: dict, role: str) -> list[str]:
    """Why `workload` does not log in as `role` with only its own password file, or []."""
    pod = workload["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = env_of(container)
    problems = []
    mounts = password_mounts(workload)  # its init containers' too: each may mount its role's key, no other
    if mounts.get(container["name"]) != {role} or any(keys - {role} for keys in mounts.values()):
        problems.append(f"mounts the password keys {mounts}, not only {role!r}")
    if env.get("GOODPUT_NATS_USER", {}).get("value") != role:
        problems.append(f"GOODPUT_NATS_USER is not {role!r}")
    password_file = Path(env.get("GOODPUT_NATS_PASSWORD_FILE", {}).get("value", "/nowhere/x"))
    mounted = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    volume = next((v for v in pod["volumes"] if v["name"] == mounted.get(str(password_file.parent))), {})
    if {"key": role, "path": password_file.name} not in volume.get("secret", {}).get("items", []):
        problems.append(f"GOODPUT_NATS_PASSWORD_FILE {password_file} is not its role's key")
    if "secretKeyRef" in json.dumps(container.get("env", [])) or "@" in env.get(SERVER_ENV, {}).get("value", ""):
        problems.append("a password in its environment or URL")
    return problems


def metrics_problems(workload: dict) -> list[str]:
    """Why Prometheus would not scrape `workload`'s pods where its service serves metrics, or []: the
    pod's scrape annotations, the container's port and its --metrics-port/--metrics-host."""
    annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
    container = containers(workload)[0]
    problems = []
    expected = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }
    if {key: annotations.get(key) for key in expected} != expected:
        problems.append(f"its pod's scrape annotations are {annotations}, not {expected}")
    if option(container, "--metrics-port") != str(METRICS_PORT):
        problems.append(f"--metrics-port is {option(container, '--metrics-port')}, not {METRICS_PORT}")
    if option(container, "--metrics-host") != "0.0.0.0":  # the default, loopback, is out of Prometheus's reach
        problems.append(f"--metrics-host is {option(container, '--metrics-host')}, not 0.0.0.0")
    if {"name": "metrics", "containerPort": METRICS_PORT} not in container.get("ports", []):
        problems.append(f"no container port `metrics` {METRICS_PORT}")
    # The operator's token, which the service asks of every scrape: the key `token` of its Secret.
    token_file = Path(env_of(container).get("GOODPUT_METRICS_TOKEN_FILE", {}).get("value", "/nowhere/x"))
    mounted = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    pod = workload["spec"]["template"]["spec"]
    volume = next((v for v in pod["volumes"] if v["name"] == mounted.get(str(token_file.parent))), {})
    if volume.get("secret", {}).get("secretName") != METRICS_SECRET or volume["secret"].get("items") != [
        {"key": "token", "path": token_file.name}
    ]:
        problems.append(
            f"GOODPUT_METRICS_TOKEN_FILE {token_file} is not the key `token` of the Secret {METRICS_SECRET}"
        )
    return problems


def render_auth(config_dir: Path) -> None:
    """Put the rendered users where nats.conf includes them: ../nats-auth/auth.conf."""
    (config_dir.parent / "nats-auth").mkdir(exist_ok=True)
    (config_dir.parent / "nats-auth" / "auth.conf").write_text(
        permissions.render_server_config(
            {role: PASSWORDS[role] for role in permissions.ROLES},
            {permissions.DEFAULT_LOGIN: PASSWORDS[permissions.DEFAULT_LOGIN]},
        )
    )


# ---- Kubernetes ----------------------------------------------------------------------------------


def test_every_yaml_under_k8s_parses_and_every_object_passes_the_schema():
    errors, checked = [], 0
    for path in sorted(K8S.rglob("*.yaml")):
        docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        assert docs, f"{path} is empty"
        for doc in docs:
            if doc.get("kind") == "Kustomization":
                continue  # kustomize's own file: built below
            if "apiVersion" not in doc:  # a data file a generator reads: the team file, the cluster spec
                load_team_file(path) if "teams" in doc else load_cluster(str(path))
                continue
            checked += 1
            if (error := schema_errors(doc)) is not None:
                errors.append(f"{path.relative_to(ROOT)} {doc['kind']}/{doc['metadata']['name']}: {error}")
    assert not errors, "\n".join(errors)
    assert checked >= 15


@pytest.mark.e2e
def test_the_schema_check_fails_a_wrong_manifest():
    """The validation has teeth: a misspelt field, or a count that is no integer, fails it."""
    policy = json.loads(json.dumps(objects("default", "Deployment")["policy"]))
    assert schema_errors(policy) is None
    policy["spec"]["replica"] = policy["spec"].pop("replicas")
    assert "replica" in schema_errors(policy)
    policy["spec"]["replicas"] = "three"
    del policy["spec"]["replica"]
    assert "replicas" in schema_errors(policy)


def test_kustomizations_name_files_that_exist():
    kustomizations = sorted(K8S.rglob("kustomization.yaml"))
    assert {k.parent for k in kustomizations} >= set(BUILDS.values()) | {K8S / "base"}
    for kustomization in kustomizations:
        spec = yaml.safe_load(kustomization.read_text())
        named = list(spec.get("resources", []))
        for generator in spec.get("configMapGenerator", []):
            named += [entry.partition("=")[2] or entry for entry in generator.get("files", [])]
        assert named, f"{kustomization} names nothing"
        for entry in named:
            target = kustomization.parent / entry
            assert target.is_file() or (target / "kustomization.yaml").is_file(), (
                f"{kustomization.relative_to(ROOT)} names {entry}, which is neither a file nor a kustomization"
            )


@pytest.mark.e2e
@pytest.mark.parametrize("build", BUILDS)
def test_the_built_manifests_pass_the_schema_and_stay_in_one_namespace(build):
    errors = [f"{o['kind']}/{o['metadata']['name']}: {e}" for o in built(build) if (e := schema_errors(o))]
    assert not errors, "\n".join(errors)
    for obj in built(build):
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']}/{obj['metadata']['name']}"
    kinds = [(o["kind"], o["metadata"]["name"]) for o in built(build)]
    assert len(kinds) == len(set(kinds)), "an object is defined twice"


@pytest.mark.e2e
@pytest.mark.parametrize("build", BUILDS)
def test_each_service_runs_with_its_replicas_nats_url_tracing_and_probes(build):
    workloads = service_workloads(build)
    assert set(workloads) == set(SERVICES)
    jaeger = objects(build, "Service")["jaeger"]
    assert {4317, 4318} <= {p["port"] for p in jaeger["spec"]["ports"]}
    nats_port = {p["name"]: p["port"] for p in objects(build, "Service")["nats"]["spec"]["ports"]}["client"]
    for service, found in workloads.items():
        for workload in found:
            if service in REPLICAS:
                assert workload["kind"] == "Deployment" and workload["spec"]["replicas"] == REPLICAS[service], service
            container = containers(workload)[0]
            env = env_of(container)
            assert env["GOODPUT_NATS_URL"]["value"] == f"nats://nats:{nats_port}"
            assert role_problems(workload, service) == [], workload["metadata"]["name"]
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://jaeger:4318"
            assert env[REPLICAS_ENV]["value"] == str(objects(build, "StatefulSet")["nats"]["spec"]["replicas"])
            if is_node_agent(workload):
                # deploy.probe pings a service by name: it cannot tell this pod's agent from another
                # node's, and the executor service's answer would restart the agents while it is away.
                assert not {"livenessProbe", "readinessProbe"} & set(container), workload["metadata"]["name"]
                continue
            probe = ["python", "-m", "deploy.probe", SERVICE_NAMES[service]]
            assert container["livenessProbe"]["exec"]["command"] == probe
            # The policy is ready only while its live run is not stalled.
            ready = probe + (["--ready"] if service == "policy" else [])
            assert container["readinessProbe"]["exec"]["command"] == ready


@pytest.mark.e2e
@pytest.mark.parametrize("build", BUILDS)
def test_the_cluster_spec_and_policy_settings_reach_the_services(build, tmp_path):
    configmaps = {name.rsplit("-", 1)[0]: cm for name, cm in objects(build, "ConfigMap").items()}
    for service, found in service_workloads(build).items():
        for workload in found:
            container = containers(workload)[0]
            args = container["args"]
            if service == "executor" and (option(container, "--executors") == "real" or is_node_agent(workload)):
                # The real executor's nodes are the live agents, named by Kubernetes: --cluster would
                # keep only agents named as the spec's nodes (aws-0 ...). The agents take none.
                assert "--cluster" not in args, workload["metadata"]["name"]
                continue
            cluster_file = Path(args[args.index("--cluster") + 1])
            mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(cluster_file.parent))
            volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
            data = configmaps[volume["configMap"]["name"].rsplit("-", 1)[0]]["data"]
            (tmp_path / cluster_file.name).write_text(data[cluster_file.name])
            cluster = load_cluster(str(tmp_path / cluster_file.name))
            assert cluster.name == "goodput-k8s", service
            for match in re.findall(r"\$\((\w+)\)", " ".join(args)):
                assert match in env_of(container), f"{service}: $({match}) in its args is not in its env"
    settings = configmaps["goodput-settings"]["data"]
    live_run = objects(build, "Job")["live-run"]
    assert containers(live_run)[0]["envFrom"][0]["configMapRef"]["name"].startswith("goodput-settings-")
    live_request(
        "live",
        settings["GOODPUT_POLICY"],
        "sia-hetero-64",
        float(settings["GOODPUT_ROUND_S"]),
        float(settings["GOODPUT_SPEED"]),
    )
    float(settings["GOODPUT_LEASE_TTL_S"])


@pytest.mark.e2e
@pytest.mark.parametrize("build", BUILDS)
def test_the_team_file_reaches_the_setup_that_stores_it_before_the_live_run(build, tmp_path):
    """The live-run Job's init container stores the ConfigMap's team file, checked against the cluster
    spec the services run (as the operator), before its container creates the live run."""
    from launcher.setup import checked_teams
    from launcher.setup import main as setup

    configmaps = {name.rsplit("-", 1)[0]: cm for name, cm in objects(build, "ConfigMap").items()}
    pod = objects(build, "Job")["live-run"]["spec"]["template"]["spec"]
    [init] = pod["initContainers"]
    assert init["args"][:3] == ["python", "-m", "launcher.setup"]
    assert env_of(init)["GOODPUT_NATS_USER"]["value"] == "operator"
    assert init["envFrom"] == containers(objects(build, "Job")["live-run"])[0]["envFrom"]
    for match in re.findall(r"\$\((\w+)\)", " ".join(init["args"])):
        assert match in configmaps["goodput-settings"]["data"] or match in env_of(init), match
    volumes = {v["name"]: v for v in pod["volumes"]}
    files = {}
    for option_name in ("--teams", "--cluster"):
        path = Path(option(init, option_name))
        mount = next(m for m in init["volumeMounts"] if m["mountPath"] == str(path.parent))
        data = configmaps[volumes[mount["name"]]["configMap"]["name"].rsplit("-", 1)[0]]["data"]
        files[option_name] = tmp_path / option_name.strip("-") / path.name
        files[option_name].parent.mkdir()
        files[option_name].write_text(data[path.name])
    teams = checked_teams(str(files["--teams"]), str(files["--cluster"]))
    assert len(teams.teams) >= 2
    assert configmaps["goodput-settings"]["data"]["GOODPUT_POLICY"] == "goodput"  # the default policy
    with pytest.raises(SystemExit):  # --teams is checked against a cluster, so it needs one
        setup(["--teams", str(files["--teams"])])


@pytest.mark.e2e
@pytest.mark.parametrize("build", BUILDS)
def test_each_workload_mounts_only_its_own_roles_password_from_the_secret_that_is_not_in_the_repo(build):
    workloads = {o["metadata"]["name"]: o for o in built(build) if o["kind"] in WORKLOADS}
    services = {name: env_of(containers(w)[0]).get("GOODPUT_SERVICE", {}).get("value") for name, w in workloads.items()}
    roles = {name: ROLE_OF.get(service, service) for name, service in services.items()}
    roles["live-run"] = "operator"
    for name, workload in workloads.items():
        secrets = {
            v["secret"]["secretName"] for v in workload["spec"]["template"]["spec"].get("volumes", []) if "secret" in v
        }
        assert secrets <= {SECRET, METRICS_SECRET}, name
        if name == "nats":
            # only its init container sees every password: it renders the users for the servers
            assert password_mounts(workload) == {"nats-auth": {"*"}, "nats": set()}
        elif name != "jaeger":
            assert role_problems(workload, roles[name]) == [], f"{name}: {role_problems(workload, roles[name])}"
    assert {roles[name] for name in workloads if name not in ("nats", "jaeger")} == set(permissions.ROLES)
    assert not [o for o in built(build) if o["kind"] == "Secret"]
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".yml", ".conf"):
            assert "kind: Secret" not in path.read_text(), path
    assert f"create secret generic {SECRET}" in (ROOT / "docs" / "deploy.md").read_text()
    assert f"create secret generic {METRICS_SECRET}" in (ROOT / "docs" / "deploy.md").read_text()


@pytest.mark.e2e
@pytest.mark.parametrize("build", BUILDS)
def test_every_services_pods_serve_metrics_where_their_scrape_annotations_say(build):
    workloads = service_workloads(build)
    assert set(workloads) == set(SERVICES)
    for found in workloads.values():
        for workload in found:  # the node agents' DaemonSets among the executor's
            assert metrics_problems(workload) == [], workload["metadata"]["name"]


@pytest.mark.e2e
def test_the_metrics_check_notices_a_pod_prometheus_would_miss():
    placer = json.loads(json.dumps(objects("default", "Deployment")["placer"]))
    assert metrics_problems(placer) == []
    placer["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = "9090"
    assert "scrape annotations" in metrics_problems(placer)[0]
    placer = json.loads(json.dumps(objects("default", "Deployment")["placer"]))
    args = containers(placer)[0]["args"]
    del args[args.index("--metrics-host") : args.index("--metrics-host") + 2]
    assert metrics_problems(placer) == ["--metrics-host is None, not 0.0.0.0"]
    placer = json.loads(json.dumps(objects("default", "Deployment")["placer"]))
    volumes = placer["spec"]["template"]["spec"]["volumes"]
    volumes[:] = [v for v in volumes if v["name"] != "metrics-token"]  # it would not start: no token
    assert "is not the key `token`" in metrics_problems(placer)[0]


def test_the_shipped_prometheus_config_scrapes_the_annotated_pods_with_the_operators_token():
    """deploy/prometheus/prometheus.yaml: each job sends the token from a file (a scrape without it
    gets 401), finds goodput's pods by their annotations, and docs/metrics.md says where it is."""
    config = yaml.safe_load(PROMETHEUS.read_text())
    [job] = config["scrape_configs"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": "/etc/prometheus/goodput/token"}
    assert (
        "bearer_token" not in json.dumps(job) and "credentials:" not in PROMETHEUS.read_text()
    )  # a file, never inline
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": [NAMESPACE]}}]
    keep = job["relabel_configs"][0]
    assert keep == {
        "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"],
        "action": "keep",
        "regex": "true",
    }
    port = next(r for r in job["relabel_configs"] if r.get("target_label") == "__address__")
    assert re.fullmatch(port["regex"], f"10.0.0.7:8080;{METRICS_PORT}") and port["replacement"] == "$1:$2"
    text = (ROOT / "docs" / "metrics.md").read_text()
    assert "deploy/prometheus/prometheus.yaml" in text and f"{METRICS_SECRET}" in text


@pytest.mark.e2e
def test_the_role_check_notices_a_workload_with_another_roles_password():
    placer = json.loads(json.dumps(objects("default", "Deployment")["placer"]))
    assert role_problems(placer, "placer") == []
    assert role_problems(placer, "policy")  # the placer's file and user are not the policy's
    volume = next(v for v in placer["spec"]["template"]["spec"]["volumes"] if "secret" in v)
    volume["secret"]["items"].append({"key": "policy", "path": "policy"})
    assert "mounts the password keys" in role_problems(placer, "placer")[0]
    del volume["secret"]["items"]  # every key of the Secret
    assert role_problems(placer, "placer")


@pytest.mark.e2e
def test_nats_is_a_three_node_jetstream_statefulset_whose_routes_name_its_pods(tmp_path):
    statefulset = objects("default", "StatefulSet")["nats"]
    headless = objects("default", "Service")[statefulset["spec"]["serviceName"]]
    assert statefulset["spec"]["replicas"] == 3
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    conf_map = next(cm for name, cm in objects("default", "ConfigMap").items() if name.startswith("nats-config-"))
    conf = conf_map["data"]["nats.conf"]
    routes = re.findall(r"nats://([\w.-]+):6222", conf)
    assert routes == [f"nats-{i}.{headless['metadata']['name']}" for i in range(3)]
    assert re.search(r"^jetstream\s*{", conf, re.M)
    # The init container renders the users into the volume the server mounts where nats.conf includes them.
    pod = statefulset["spec"]["template"]["spec"]
    [init], [server] = pod["initContainers"], pod["containers"]
    config_dir = next(m["mountPath"] for m in server["volumeMounts"] if m["name"] == "config")
    include = os.path.normpath(os.path.join(config_dir, re.search(r"^include (\S+)", conf, re.M).group(1)))
    out = init["args"][init["args"].index("--out") + 1]
    assert init["args"][:3] == ["python", "-m", "shared.permissions"] and out == include
    auth_volume = next(m["name"] for m in server["volumeMounts"] if m["mountPath"] == os.path.dirname(include))
    assert auth_volume in {m["name"] for m in init["volumeMounts"]}
    passwords = init["args"][init["args"].index("--passwords") + 1]
    assert {m["mountPath"]: m["name"] for m in init["volumeMounts"]}[passwords] == "passwords"
    assert "NATS_PASSWORD" not in json.dumps(server.get("env", []))
    check = check_nats_conf(conf, tmp_path, {"POD_NAME": "nats-0"})
    assert check.returncode == 0, check.stdout + check.stderr


def check_nats_conf(conf: str, workdir: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`nats-server -t` on `conf`, with the rendered users where it includes them."""
    config_dir = workdir / "etc-nats"
    config_dir.mkdir()
    (config_dir / "nats.conf").write_text(conf)
    render_auth(config_dir)
    return subprocess.run(
        [str(nats_server_binary()), "-t", "-c", str(config_dir / "nats.conf")],
        env={**(env or {}), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.e2e
@pytest.mark.parametrize("build", BUILDS)
def test_no_workloads_selector_takes_another_workloads_pods(build):
    """The executor's Deployment and the agents' DaemonSets (and every other pair) select apart."""
    workloads = [o for o in built(build) if o["kind"] in WORKLOADS and o["kind"] != "Job"]
    for owner in workloads:
        selector = owner["spec"]["selector"]["matchLabels"]
        for other in workloads:
            if other is not owner:
                labels = other["spec"]["template"]["metadata"]["labels"]
                assert not selector.items() <= labels.items(), (
                    f"{owner['kind']}/{owner['metadata']['name']} selects the pods of {other['metadata']['name']}"
                )


@pytest.mark.e2e
def test_node_agents_are_daemonsets_on_their_gpu_type_named_after_their_node_on_the_pod_ip():
    cluster = load_cluster(str(K8S / "base" / "cluster.yaml"))
    per_node = {node.gpu_type: node.gpus for node in cluster.nodes}
    executor = objects("gpu", "Deployment")["executor"]
    checkpoints = urllib.parse.urlparse(option(containers(executor)[0], "--checkpoints"))
    assert checkpoints.scheme == "file"
    daemonsets = objects("gpu", "DaemonSet")
    covered = set()
    for name, daemonset in daemonsets.items():
        assert is_node_agent(daemonset), name
        pod = daemonset["spec"]["template"]["spec"]
        gpu_type = pod["nodeSelector"]["goodput.io/gpu-type"]
        assert gpu_type in per_node, f"{name} runs on {gpu_type!r}, a type the cluster spec does not have"
        container = pod["containers"][0]
        assert container["image"].startswith("goodput-executor:")
        env = env_of(container)
        assert env["GOODPUT_SERVICE"]["value"] == "node" and "GOODPUT_EXECUTORS" not in env
        # --node: the Kubernetes node's name; --address: the pod's IP (rank 0's rendezvous for its peers)
        node, address = (env_entry(container, option(container, o))["valueFrom"] for o in ("--node", "--address"))
        assert node == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        assert address == {"fieldRef": {"fieldPath": "status.podIP"}}
        # --gpu-type: the pod's own type label, the one its nodeSelector asks of the node
        label = env_entry(container, option(container, "--gpu-type"))["valueFrom"]["fieldRef"]["fieldPath"]
        match = re.fullmatch(r"metadata\.labels\['([\w./-]+)'\]", label)
        assert match, label
        key = match.group(1)
        assert daemonset["spec"]["template"]["metadata"]["labels"][key] == gpu_type == pod["nodeSelector"][key], name
        assert daemonset["spec"]["selector"]["matchLabels"][key] == gpu_type, name
        # every GPU of a node, as the device plugin gives them (the agent takes the CUDA devices it sees)
        gpus = {kind: amounts["nvidia.com/gpu"] for kind, amounts in container["resources"].items()}
        assert gpus == {"requests": per_node[gpu_type], "limits": per_node[gpu_type]}, name
        assert option(container, "--gpus") is None, "the agent counts the CUDA devices it is given"
        # the checkpoints where the executor names them: the same claim, at the same path
        assert mount_of(daemonset, "checkpoints") == mount_of(executor, "checkpoints") == checkpoints.path, name
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        covered.add(gpu_type)
    assert covered == set(per_node), "every GPU type of the cluster spec needs its node agents"
    assert not objects("default", "DaemonSet")


@pytest.mark.e2e
def test_the_gpu_executor_service_is_one_recreated_pod_on_a_read_write_many_claim():
    executor = objects("gpu", "Deployment")["executor"]
    container = containers(executor)[0]
    assert executor["spec"]["replicas"] == 1 and executor["spec"]["strategy"]["type"] == "Recreate"
    assert option(container, "--executors") == "real" and option(container, "--node") is None
    assert "GOODPUT_EXECUTORS" not in env_of(container)  # services.executor, not services.simulated
    assert re.fullmatch(r"file:///\S+", option(container, "--checkpoints"))
    [claim] = objects("gpu", "PersistentVolumeClaim").values()
    assert claim["metadata"]["name"] == "checkpoints"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every node reads and writes the checkpoints"
    assert "storageClassName" not in claim["spec"]  # the operator's: a class with RWX
    assert mount_of(executor, "checkpoints") == urllib.parse.urlparse(option(container, "--checkpoints")).path
    for service in ("profiler", "api"):  # measured profiles; the applications the live agents run
        assert option(containers(objects("gpu", "Deployment")[service])[0], "--executors") == "real", service
    # The default build: the simulated executor plays the whole cluster, exactly one; the zoo's profiles.
    simulated = objects("default", "Deployment")["executor"]
    assert simulated["spec"]["replicas"] == 1 and simulated["spec"]["strategy"]["type"] == "Recreate"
    assert env_of(containers(simulated)[0])["GOODPUT_EXECUTORS"]["value"] == "simulated"
    for service in ("profiler", "api"):
        assert option(containers(objects("default", "Deployment")[service])[0], "--executors") is None, service
    assert not objects("default", "PersistentVolumeClaim")


# ---- compose -------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_the_compose_file_passes_the_compose_schema_and_runs_the_stack(tmp_path):
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    schema = json.loads(
        importlib.resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    )
    jsonschema.validate(compose, schema, cls=jsonschema.Draft202012Validator)
    services = compose["services"]
    assert {"nats", "jaeger", *SERVICES} <= set(services)
    nats_conf = DEPLOY / "docker" / "nats.conf"
    assert f"./{nats_conf.relative_to(DEPLOY)}:/etc/nats/nats.conf:ro" in services["nats"]["volumes"]
    assert re.search(r"^jetstream\s*{", nats_conf.read_text(), re.M)
    check = check_nats_conf(nats_conf.read_text(), tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    # nats-auth renders every role's user into the volume the server reads where nats.conf includes it
    include = os.path.normpath(
        os.path.join("/etc/nats", re.search(r"^include (\S+)", nats_conf.read_text(), re.M).group(1))
    )
    auth = services["nats-auth"]
    out = auth["command"][auth["command"].index("--out") + 1]
    volume = next(v.split(":")[0] for v in auth["volumes"] if v.split(":")[1] == os.path.dirname(out))
    assert f"{volume}:{os.path.dirname(include)}:ro" in services["nats"]["volumes"]
    assert services["nats"]["depends_on"]["nats-auth"]["condition"] == "service_completed_successfully"
    assert auth["command"][auth["command"].index("--passwords") + 1] == "/run/secrets"
    assert set(auth["secrets"]) == set(ACCESS) == set(compose["secrets"]) - {"metrics-token"}
    for role in ACCESS:
        assert compose["secrets"][role] == {"environment": f"{permissions.PASSWORD_ENV_PREFIX}{role.upper()}"}
    assert compose["secrets"]["metrics-token"] == {"environment": "GOODPUT_METRICS_TOKEN"}  # none in the repo
    roles = {**{name: name for name in SERVICES}, "live-run": "operator"}
    for name, role in roles.items():
        service = services[name]
        env = service["environment"]
        assert env.get("GOODPUT_SERVICE", name) == name
        assert env[SERVER_ENV] == "nats://nats:4222" and env["GOODPUT_NATS_USER"] == role, name
        token = [{"source": "metrics-token", "target": "metrics-token"}] if name in SERVICES else []
        assert service["secrets"] == [{"source": role, "target": "nats-password"}, *token], name  # its own only
        assert env["GOODPUT_NATS_PASSWORD_FILE"] == "/run/secrets/nats-password"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
        assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        for volume in service.get("volumes", []):
            assert (DEPLOY / volume.split(":")[0]).exists(), volume
        if name in SERVICES:
            assert service["healthcheck"]["test"] == ["CMD", "python", "-m", "deploy.probe", SERVICE_NAMES[name]]
            metrics = service["command"][service["command"].index("--metrics-port") :]
            assert metrics[:4] == ["--metrics-port", str(METRICS_PORT), "--metrics-host", "0.0.0.0"], name
            assert env["GOODPUT_METRICS_TOKEN_FILE"] == "/run/secrets/metrics-token", name
    assert services["policy"]["deploy"]["replicas"] >= 2


# ---- images --------------------------------------------------------------------------------------


def pip_steps(commands: list[str]) -> list[list[str]]:
    """What each `pip install` installs, in order: options and shell expansions left out, the
    project's extras dropped (the images install no dev tools)."""
    steps = []
    for command in commands:
        for part in re.split(r"&&|;", command):
            words = shlex.split(part)
            if "pip" in words and "install" in words[words.index("pip") :]:
                after = words[words.index("install", words.index("pip")) + 1 :]
                kept = [w for w in after if "$" not in w and (not w.startswith("-") or w in ("-e", "--editable"))]
                steps.append([re.sub(r"^\.\[[\w,-]+\]$", ".", w) for w in kept])
    return steps


def makefile_install() -> list[str]:
    recipe = (ROOT / "Makefile").read_text().split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    return [line.strip() for line in recipe.splitlines() if line.startswith("\t") and "pip install" in line]


def dockerfile_runs(path: Path) -> list[str]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [line.strip()[4:] for line in text.splitlines() if line.strip().startswith("RUN ")]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.executor"])
def test_the_images_install_as_the_makefile_does(dockerfile):
    expected = pip_steps(makefile_install())
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(dep for dep in dependencies if dep.startswith("torch"))
    # torch first and pinned, then the training library, then the project on it
    assert expected == [["pip"], [torch_pin], ["-e", "./train"], ["-e", "."]], expected
    assert pip_steps(dockerfile_runs(DEPLOY / "docker" / dockerfile)) == expected
    text = (DEPLOY / "docker" / dockerfile).read_text()
    assert re.search(r"^USER (?!root|0\b)\S+", text, re.M), "the image must not run as root"
    assert (DEPLOY / "docker" / f"{dockerfile}.dockerignore").is_file()


def test_the_install_comparison_notices_a_difference():
    assert pip_steps(["python -m pip install torch==2.13.0", "pip install ."]) != pip_steps(makefile_install())
    assert pip_steps(["python -m pip install -e . && pip install torch==2.13.0"]) == [["-e", "."], ["torch==2.13.0"]]


# ---- the probe and the live run ------------------------------------------------------------------


async def probe(service: str, server: str | None = None, env: dict | None = None) -> tuple[int, str]:
    """Run `python -m deploy.probe` as the probes do (without `server`: the URL in $GOODPUT_NATS_URL);
    its exit code and output."""
    options = ["--server", server] if server is not None else []
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "deploy.probe",
        service,
        *options,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), timeout=30)
    return process.returncode, out.decode()


async def test_the_probe_passes_while_a_service_answers_and_fails_clearly_when_none_does(nats_server, name_prefix):
    name = f"{name_prefix}-svc"
    assert await probe(name, nats_server) == (
        1,
        f"probe: no instance of service {name!r} is registered on NATS at {nats_server}\n",
    )
    bus = await Bus.connect(nats_server, "probe-test", max_reconnect_attempts=1)
    try:
        service = await new_service(bus, name, "a service for the probe to find")
        await service.start()
        code, out = await probe(name, nats_server)
        assert code == 0 and out.startswith(f"probe: {name} answers"), out
        await service.stop()
        assert (await probe(name, nats_server))[0] == 1
    finally:
        await bus.close()


@pytest.mark.e2e
async def test_the_probe_says_when_nats_cannot_be_reached_without_showing_the_password():
    url = f"nats://goodput:{PASSWORD}@127.0.0.1:{free_loopback_port()}"
    code, out = await probe("placer", url)
    assert code == 2 and "cannot reach NATS at nats://goodput:***@127.0.0.1:" in out, out
    assert PASSWORD not in out


def nats_conf_on_loopback(conf: str, me: int, client: int, http: int, routes: list[int], workdir: Path) -> str:
    """The Kubernetes nats.conf with its listeners, routes and paths moved to loopback and `workdir`."""
    swaps = [
        ("listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{client}"),
        ("http: 127.0.0.1:8222", f"http: 127.0.0.1:{http}"),
        ("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{routes[me]}"),
        ("store_dir: /data", f"store_dir: {workdir / 'jetstream'}"),
        ("pid_file: /var/run/nats/nats.pid", f"pid_file: {workdir / 'nats.pid'}"),
    ]
    swaps += [(f"nats://nats-{i}.nats-headless:6222", f"nats://127.0.0.1:{port}") for i, port in enumerate(routes)]
    for old, new in swaps:
        assert conf.count(old) == 1, f"nats.conf no longer has {old!r} once: update this test's rewrite"
        conf = conf.replace(old, new)
    return conf


@contextlib.contextmanager
def nats_cluster(workdir: Path) -> Iterator[tuple[list[str], list[int]]]:
    """Three nats-servers from the Kubernetes nats.conf, on loopback: client URLs (no credentials)
    and monitoring ports."""
    conf = (K8S / "base" / "nats.conf").read_text()
    ports = [[free_loopback_port() for _ in range(3)] for _ in range(3)]  # client, http, route per server
    routes = [p[2] for p in ports]
    processes = []
    try:
        for i, (client, http, _) in enumerate(ports):
            home = workdir / f"nats-{i}"
            (home / "etc").mkdir(parents=True)
            (home / "etc" / "nats.conf").write_text(nats_conf_on_loopback(conf, i, client, http, routes, home))
            render_auth(home / "etc")  # as the pod's init container does
            with open(home / "log", "wb") as log:
                processes.append(
                    subprocess.Popen(
                        [str(nats_server_binary()), "-c", str(home / "etc" / "nats.conf")],
                        env={"POD_NAME": f"nats-{i}"},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        yield [f"nats://127.0.0.1:{p[0]}" for p in ports], [p[1] for p in ports]
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_healthy(http_ports: list[int], logs: Path, timeout_s: float = 20.0) -> None:
    """Until every server's /healthz says ok (JetStream current included)."""
    deadline = time.monotonic() + timeout_s
    waiting = set(http_ports)
    while waiting:
        for port in sorted(waiting):
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
                    if json.load(answer).get("status") == "ok":
                        waiting.discard(port)
        if waiting and time.monotonic() > deadline:
            raise AssertionError(
                "the NATS cluster did not become healthy:\n"
                + "\n".join((path.read_text(errors="replace")[-2000:]) for path in sorted(logs.glob("nats-*/log")))
            )
        time.sleep(0.05)


def role_env(role: str, workdir: Path, server: str) -> dict[str, str]:
    """A pod's NATS environment for `role`: the URL, its user, its password file."""
    password_file = workdir / f"{role}.password"
    password_file.write_text(PASSWORDS[role])
    return {SERVER_ENV: server, "GOODPUT_NATS_USER": role, "GOODPUT_NATS_PASSWORD_FILE": str(password_file)}


async def test_provisioning_asks_again_while_a_forming_cluster_sees_no_peer_and_stops_at_a_real_refusal():
    calls = []

    async def placed_on_the_third_ask():
        calls.append(1)
        if len(calls) < 3:  # as a meta leader answers before it has heard from every peer
            raise nats.js.errors.BadRequestError(
                code=400, err_code=10005, description="no suitable peers for placement"
            )

    await storage._patiently(placed_on_the_third_ask)
    assert len(calls) == 3

    async def refused():
        calls.append(1)
        raise nats.js.errors.BadRequestError(code=400, err_code=10058, description="stream name already in use")

    with pytest.raises(nats.js.errors.BadRequestError, match="already in use"):
        await storage._patiently(refused)
    assert len(calls) == 4


@pytest.mark.e2e
async def test_the_nats_config_forms_a_jetstream_cluster_that_serves_each_role(tmp_path):
    with nats_cluster(tmp_path) as (urls, http_ports):
        await asyncio.to_thread(wait_healthy, http_ports, tmp_path)
        # As the manifests set it: every stream and KV bucket a process creates is kept on all three.
        os.environ[REPLICAS_ENV] = "3"
        try:
            bus = await Bus.connect(
                urls[0],
                "replicas-test",
                max_reconnect_attempts=1,
                **connect_options(environ=role_env("operator", tmp_path, urls[0])),
            )
        finally:
            del os.environ[REPLICAS_ENV]
        try:
            await storage.provision(bus)  # the live-run Job's setup, as the operator
            for name in (*storage.STREAMS, *(bucket.stream for bucket in storage.BUCKETS.values())):
                info = await bus.js.stream_info(name)
                assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2, name  # + the leader
        finally:
            await bus.close()
        command = [sys.executable, "-m", "services.placer", "--cluster", str(K8S / "base" / "cluster.yaml")]
        log = tmp_path / "placer.log"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("GOODPUT_NATS_")}
        with open(log, "wb") as output:
            placer = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**clean, **role_env("placer", tmp_path, urls[0])},
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 60
            # as in the placer's pod: its role from the environment, on another server of the cluster
            while (result := await probe("placer", env=role_env("placer", tmp_path, urls[1])))[0] != 0:
                assert placer.poll() is None and time.monotonic() < deadline, f"{result}\n{log.read_text()[-3000:]}"
                await asyncio.sleep(0.2)
            code, out = await probe("placer", urls[2])
            assert code == 2 and "Authorization Violation" in out, out
            wrong = {**role_env("placer", tmp_path, urls[2]), "GOODPUT_NATS_USER": "policy"}  # the placer's file
            code, out = await probe("placer", env=wrong)
            assert code == 2 and "Authorization Violation" in out, out
        finally:
            placer.send_signal(signal.SIGTERM)
            placer.wait(timeout=20)
        assert "ermissions violation" not in log.read_text(), log.read_text()
        code, out = await probe("placer", env=role_env("placer", tmp_path, urls[0]))
        assert code == 1 and "no instance of service 'placer'" in out, out


async def test_the_live_run_is_created_once_with_the_settings_asked_for(nats_server, name_prefix):
    request = live_request(f"{name_prefix}-live", "pollux:p=-1", str(K8S / "base" / "cluster.yaml"), 30.0, 2.0)
    assert await create_live_run(nats_server, request, wait_s=5) is None
    other = live_request(request.run_id, "sia", "sia-hetero-64", 60.0, 1.0)
    assert await create_live_run(nats_server, other, wait_s=5) == request  # left as it was
    bus = await Bus.connect(nats_server, "live-run-test", max_reconnect_attempts=1)
    try:
        stored = (await (await bus.kv(subjects.RUNS_BUCKET, RunCheckpoint)).get(request.run_id)).value.request
    finally:
        await bus.close()
    # A round every 30 s of wall time, each 60 s of the (simulated, twice as fast) cluster's clock.
    assert (stored.live, stored.policy, stored.policy_options, stored.round_s, stored.speed) == (
        True,
        "pollux",
        {"p": -1},
        60.0,
        2.0,
    )
    with pytest.raises(ValueError, match="unknown policy"):
        live_request("x", "nope", "sia-hetero-64", 60.0, 1.0)
