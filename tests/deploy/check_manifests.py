#!/usr/bin/env python3
"""Checks the deployment files against the Kubernetes schemas and against the binaries.

For every kustomization under k8s/ (base, each overlay, load-test):
  1. `kubectl kustomize` renders it;
  2. every object validates strictly (no unknown fields) against the Kubernetes schemas of the
     oldest and newest supported versions (kubernetes-validate, offline), the ServiceMonitor
     against tests/deploy/servicemonitor.schema.json;
  3. every container runs the binary its image holds with flags that binary accepts: the
     flag files are taken from the rendered ConfigMaps, $(VAR)s from the env, and the binary
     is run with --check_flags (the CLI's `load`, which has no such mode, must fail only to
     reach the server);
  4. ports, probes, Services, network policies, mounts, drain times and pairings agree with the
     flags (see check_pod and check_cluster).
scripts/deploy/dev_certs.sh issues certificates for exactly the names the manifests dial.
And for the Dockerfiles: multi-stage, non-root, ENTRYPOINT a binary the build stage builds,
EXPOSE the ports the manifests use, CMD flags accepted; scripts/docker/runtime_packages.sh
names packages that hold every library the binaries load.

Usage: check_manifests.py --bin-dir build/bin. Exit 77 (skipped) when kubectl is missing.
"""

import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
K8S = os.path.join(ROOT, "k8s")
SKIP = 77
# Oldest supported (native sidecars, the preStop sleep action, the pod-index label) and newest.
KUBERNETES_VERSIONS = ["1.30.0", "1.37.0"]
IMAGE_BINARY = {"infinigen-router": "infinigen-router", "infinigen-worker": "infinigen-worker",
                "infinigen-kvstore": "infinigen-kvstore"}
DOCKERFILES = {"infinigen-router": "router/Dockerfile", "infinigen-worker": "gpu_worker/Dockerfile",
               "infinigen-kvstore": "kv_store/Dockerfile"}
PORT_FLAGS = ("listen", "http_listen", "metrics_port", "ucx_port")


def reexec_in_venv():
    """kubernetes-validate comes from PyPI: scripts/setup.sh puts it in the project's venv."""
    try:
        import kubernetes_validate  # noqa: F401
        import yaml  # noqa: F401
        return
    except ImportError:
        pass
    cache = os.environ.get("INFINIGEN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "infinigen")
    python = os.path.join(cache, "venv", "bin", "python")
    if os.path.exists(python) and os.path.realpath(sys.executable) != os.path.realpath(python):
        os.execv(python, [python] + sys.argv)
    sys.exit("kubernetes-validate is not installed: run scripts/setup.sh")


class Problems:
    def __init__(self):
        self.items = []

    def add(self, where, what):
        self.items.append(f"{where}: {what}")


def render(path):
    out = subprocess.run(["kubectl", "kustomize", path], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {path} failed:\n{out.stderr}")
    import yaml
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def name_of(obj):
    return f"{obj['kind']}/{obj['metadata']['name']}"


def validate_schemas(where, objects, problems):
    import jsonschema
    import kubernetes_validate
    with open(os.path.join(ROOT, "tests", "deploy", "servicemonitor.schema.json")) as f:
        service_monitor = json.load(f)
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            try:
                jsonschema.validate(obj, service_monitor)
            except jsonschema.ValidationError as e:
                problems.add(f"{where} {name_of(obj)}", e.message)
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.add(f"{where} {name_of(obj)} (Kubernetes {version})", e.message)
            except kubernetes_validate.SchemaNotFoundError as e:
                problems.add(f"{where} {name_of(obj)}", f"no schema: {e}")


def pod_templates(objects):
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield obj, obj["spec"]["template"]


def containers(pod_spec):
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def binary_of(container):
    image = container["image"].rsplit("/", 1)[-1].split(":")[0]
    if container.get("command"):
        return os.path.basename(container["command"][0]), image
    for key, binary in IMAGE_BINARY.items():
        if image == key or image == key.replace("infinigen-", ""):
            return binary, key
    return None, image


def expand_env(arg, container):
    """$(VAR) as Kubernetes expands it: literal values; fields as in pod 0 of namespace
    infinigen."""
    env = {}
    for e in container.get("env", []):
        field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[e["name"]] = e.get("value", "infinigen" if field == "metadata.namespace" else "0")
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def mounted_file(pod_spec, container, path, configmaps):
    """The content of `path` inside the container, when a ConfigMap provides it."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        prefix = m["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            v = volumes.get(m["name"], {})
            if "configMap" in v:
                data = configmaps.get(v["configMap"]["name"], {})
                return data.get(path[len(prefix):])
    return None


def is_mounted(container, path):
    return any(path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
               for m in container.get("volumeMounts", []))


def effective_args(pod_spec, container, configmaps, tmp, where, problems):
    """Command-line arguments with flag files written to `tmp`; also the flags, in order."""
    args, flags = [], {}
    for raw in container.get("args", []):
        arg = expand_env(raw, container)
        if arg.startswith("--flagfile="):
            paths = []
            for path in arg[len("--flagfile="):].split(","):
                content = mounted_file(pod_spec, container, path, configmaps)
                if content is None:
                    problems.add(where, f"flag file {path} is not in a mounted ConfigMap")
                    continue
                local = os.path.join(tmp, f"{len(os.listdir(tmp))}-{os.path.basename(path)}")
                with open(local, "w") as f:
                    f.write(content)
                paths.append(local)
                for line in content.splitlines():
                    line = line.strip()
                    if line.startswith("--") and "=" in line:
                        k, v = line[2:].split("=", 1)
                        flags[k] = v
            args.append("--flagfile=" + ",".join(paths))
        else:
            args.append(arg)
            if arg.startswith("--") and "=" in arg:
                k, v = arg[2:].split("=", 1)
                flags[k] = v
    return args, flags


def port_of(value):
    return int(value.rsplit(":", 1)[1]) if ":" in value else int(value)


def check_binary_accepts(bin_dir, binary, args, where, problems, shown=None):
    """Runs the binary on `args`; `shown` is how a problem names them (the manifests' spelling)."""
    shown = shlex.join(shown if shown is not None else args)
    exe = os.path.join(bin_dir, binary)
    if binary == "infinigen":
        # `infinigen load` has no --check_flags: the flags are fine when only the server is
        # missing (exit 1, "cannot reach"); a flag error exits 2.
        out = subprocess.run([exe] + args + ["--wait-seconds=0"], capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 1 or "cannot reach" not in out.stderr:
            problems.add(where, f"infinigen {shown}: exit {out.returncode}: "
                         f"{out.stderr.strip()}")
        return
    out = subprocess.run([exe] + args + ["--check_flags"], capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        problems.add(where, f"{binary} rejects {shown}: {out.stderr.strip()}")


def bytes_of(quantity):
    """A Kubernetes memory quantity ("62Gi", "512Mi") in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(quantity))
    return int(m.group(1)) * units.get(m.group(2), 1) if m else 0


def check_store_memory(cwhere, spec, container, flags, problems):
    """--capacity_mb is repeated as a memory (or huge-page) limit and as the shm volume's size:
    each must hold the arena."""
    if "capacity_mb" not in flags:
        return
    arena = int(flags["capacity_mb"]) << 20
    limits = container.get("resources", {}).get("limits", {})
    held = bytes_of(limits.get("hugepages-2Mi", limits.get("memory", "0")))
    if held < arena:
        problems.add(cwhere, f"the memory limit ({held} bytes) is below --capacity_mb ({arena})")
    if "shm_path" in flags:
        directory = os.path.dirname(flags["shm_path"])
        names = [m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == directory]
        for v in spec.get("volumes", []):
            if v["name"] in names:
                size = bytes_of(v.get("emptyDir", {}).get("sizeLimit", "0"))
                if v.get("emptyDir", {}).get("medium") != "Memory" or size < arena:
                    problems.add(cwhere, f"--shm_path: volume {v['name']} is not a memory-backed "
                                 f"emptyDir of at least --capacity_mb ({arena} bytes)")


def check_pod(where, obj, template, configmaps, bin_dir, problems, tmp):
    """One workload: flags accepted, ports/probes/mounts consistent, hardened, drained in time."""
    spec = template["spec"]
    pod_security = spec.get("securityContext", {})
    grace = spec.get("terminationGracePeriodSeconds", 30)
    result = []
    for c in containers(spec):
        cwhere = f"{where} {name_of(obj)} container {c['name']}"
        binary, image = binary_of(c)
        if binary is None:
            problems.add(cwhere, f"image {image} is none of ours")
            continue
        d = tempfile.mkdtemp(dir=tmp)
        args, flags = effective_args(spec, c, configmaps, d, cwhere, problems)
        if binary == "infinigen":
            # `infinigen load` reads its TLS files at start: one on a mounted volume (a Secret,
            # there in the cluster) is stood in for by a PEM block; any other is a problem.
            for i, arg in enumerate(args):
                k, _, v = arg[2:].partition("=")
                if k in ("tls-ca", "tls-cert", "tls-key") and v.startswith("/"):
                    if not is_mounted(c, v):
                        problems.add(cwhere, f"--{k}={v} is on no mounted volume")
                    local = os.path.join(d, f"stand-in-{k}.pem")
                    with open(local, "w") as f:
                        f.write("-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n")
                    args[i] = f"--{k}={local}"
        check_binary_accepts(bin_dir, binary, args, cwhere, problems, c.get("args", []))
        # Security: non-root, read-only root, no privilege escalation, memory limit.
        sc = c.get("securityContext", {})
        if not (sc.get("runAsNonRoot") or pod_security.get("runAsNonRoot")):
            problems.add(cwhere, "runAsNonRoot is not set")
        if not sc.get("readOnlyRootFilesystem"):
            problems.add(cwhere, "readOnlyRootFilesystem is not true")
        if sc.get("allowPrivilegeEscalation", True):
            problems.add(cwhere, "allowPrivilegeEscalation is not false")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            problems.add(cwhere, "capabilities are not dropped")
        if "memory" not in c.get("resources", {}).get("limits", {}):
            problems.add(cwhere, "no memory limit")
        if binary == "infinigen":
            result.append({"container": c, "binary": binary, "flags": {}, "ports": {}})
            continue
        # Every port a flag opens is declared, and every declared port is opened by a flag.
        declared = {p["containerPort"]: p.get("name") for p in c.get("ports", [])}
        opened = {port_of(flags[f]) for f in PORT_FLAGS if f in flags and port_of(flags[f]) > 0}
        for p in sorted(opened - set(declared)):
            problems.add(cwhere, f"port {p} (from the flags) is not a containerPort")
        for p in sorted(set(declared) - opened):
            problems.add(cwhere, f"containerPort {p} is opened by no flag")
        listen = port_of(flags.get("listen", "0"))
        if "listen" in flags and not flags["listen"].startswith("0.0.0.0:"):
            problems.add(cwhere, f"--listen={flags['listen']}: probes and peers need 0.0.0.0")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c and c[probe].get("grpc", {}).get("port") != listen:
                problems.add(cwhere, f"{probe} does not check the gRPC port {listen}")
        if "readinessProbe" not in c or "livenessProbe" not in c:
            problems.add(cwhere, "needs gRPC readiness and liveness probes")
        # Files the flags name are mounted (flag files, TLS, API keys, models, the shm arena).
        for k, v in flags.items():
            if v.startswith("/") and not is_mounted(c, v) and not (
                    k == "shm_path" and is_mounted(c, os.path.dirname(v))):
                problems.add(cwhere, f"--{k}={v} is on no mounted volume")
        check_store_memory(cwhere, spec, c, flags, problems)
        drain = int(flags.get("drain_seconds", "0"))
        if grace <= drain:
            problems.add(cwhere, f"terminationGracePeriodSeconds {grace} <= --drain_seconds {drain}")
        result.append({"container": c, "binary": binary, "flags": flags, "ports": declared,
                       "sidecar": c in spec.get("initContainers", [])})
    return result


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def check_cluster(where, objects, pods, problems):
    """Across objects: Services, the router's workers, the workers' stores, network policies."""
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    services = by_kind.get("Service", {})
    for svc in services.values():
        backing = [p for p in pods if selects(svc["spec"]["selector"], p["labels"])]
        if not backing:
            problems.add(f"{where} {name_of(svc)}", "selects no pod")
        # Named target ports resolve against regular containers only (not sidecars).
        names, numbers = {}, set()
        for p in backing:
            for c in p["containers"]:
                numbers |= set(c["ports"])
                if not c.get("sidecar"):
                    names.update({n: port for port, n in c["ports"].items()})
        for sp in svc["spec"]["ports"]:
            target = sp["targetPort"]
            if backing and (target not in numbers if isinstance(target, int) else
                            names.get(target) != sp["port"]):
                problems.add(f"{where} {name_of(svc)}",
                             f"port {sp['name']} {sp['port']} -> {sp['targetPort']} matches no "
                             "containerPort of that name and number")
    for p in pods:
        for c in p["containers"]:
            f = c["flags"]
            cwhere = f"{where} {p['name']} container {c['container']['name']}"
            # The router's workers: a headless Service whose pods listen on that port.
            for target in (f["workers"].split(",") if "workers" in f else []):
                m = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", target)
                if not m:
                    problems.add(cwhere, f"--workers {target}: not dns:///service:port")
                    continue
                svc = services.get(m.group(1))
                if svc is None or svc["spec"].get("clusterIP") != "None":
                    problems.add(cwhere, f"--workers: no headless Service {m.group(1)}")
                    continue
                ok = any(selects(svc["spec"]["selector"], q["labels"]) and
                         any(d["binary"] == "infinigen-worker" and
                             port_of(d["flags"]["listen"]) == int(m.group(2))
                             for d in q["containers"]) for q in pods)
                if not ok:
                    problems.add(cwhere, f"--workers {target}: no worker listens there")
            # The worker's store: in the pod (127.0.0.1) or store N of a headless Service.
            if c["binary"] == "infinigen-worker" and f.get("kv_transport") in ("shm", "ucx", "grpc"):
                store = f.get("kv_store", "")
                host, port = store.rsplit(":", 1)
                stores = [d for d in p["containers"] if d["binary"] == "infinigen-kvstore"]
                if host == "127.0.0.1":
                    if not any(port_of(d["flags"]["listen"]) == int(port) for d in stores):
                        problems.add(cwhere, f"--kv_store={store}: no store in the pod listens")
                    if f["kv_transport"] == "shm":
                        shm = [d["flags"].get("shm_path", "") for d in stores]
                        if not shm or not shm[0] or not is_mounted(
                                c["container"], os.path.dirname(shm[0])):
                            problems.add(cwhere, "shm: the store's --shm_path is not mounted here")
                else:
                    m = re.fullmatch(r"([a-z0-9-]+)-0\.([a-z0-9-]+)(\.[a-z0-9.-]+)?", host)
                    sts = by_kind.get("StatefulSet", {}).get(m.group(1)) if m else None
                    workers = by_kind.get("StatefulSet", {}).get(p["name"])
                    if sts is None or sts["spec"]["serviceName"] != m.group(2) or \
                            services.get(m.group(2), {}).get("spec", {}).get("clusterIP") != "None":
                        problems.add(cwhere, f"--kv_store={store}: not store N of a StatefulSet "
                                     "behind a headless Service")
                    elif workers and sts["spec"]["replicas"] < workers["spec"]["replicas"]:
                        problems.add(cwhere, "fewer stores than workers: worker N has no store N")
                    if f["kv_transport"] == "ucx" and sts is not None:
                        sts_flags = [d["flags"] for q in pods if q["name"] == m.group(1)
                                     for d in q["containers"]]
                        if not sts_flags or int(sts_flags[0].get("ucx_port", "0")) == 0:
                            problems.add(cwhere, "ucx: the stores serve no --ucx_port")
    # Network policies open ports the selected pods have, UCX ranges match UCX_TCP_PORT_RANGE.
    for np in by_kind.get("NetworkPolicy", {}).values():
        selected = [p for p in pods if selects(np["spec"]["podSelector"]["matchLabels"],
                                               p["labels"])]
        if not selected:
            problems.add(f"{where} {name_of(np)}", "selects no pod")
        have = set()
        ranges = set()
        for p in selected:
            for c in p["containers"]:
                have |= set(c["ports"])
                for e in c["container"].get("env", []):
                    if e["name"] == "UCX_TCP_PORT_RANGE":
                        lo, hi = e["value"].split("-")
                        ranges.add((int(lo), int(hi)))
        for rule in np["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if "endPort" in port:
                    if (port["port"], port["endPort"]) not in ranges:
                        problems.add(f"{where} {name_of(np)}", f"range {port['port']}-"
                                     f"{port['endPort']} is no UCX_TCP_PORT_RANGE of its pods")
                elif port["port"] not in have:
                    problems.add(f"{where} {name_of(np)}", f"port {port['port']}: no such port")


def check_kustomization(path, bin_dir, problems, tmp):
    where = os.path.relpath(path, ROOT)
    objects = render(path)
    validate_schemas(where, objects, problems)
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    pods = []
    for obj, template in pod_templates(objects):
        found = check_pod(where, obj, template, configmaps, bin_dir, problems, tmp)
        pods.append({"name": obj["metadata"]["name"], "labels": template["metadata"]["labels"],
                     "containers": found})
    if os.path.basename(path) != "load-test":
        check_cluster(where, objects, pods, problems)
    return objects, pods


def check_dockerfiles(bin_dir, all_pods, problems, tmp):
    ports_by_binary = {}
    for p in all_pods:
        for c in p["containers"]:
            ports_by_binary.setdefault(c["binary"], set()).update(c["ports"])
    for binary, rel in DOCKERFILES.items():
        where = rel
        text = open(os.path.join(ROOT, rel)).read()
        lines = [ln for ln in re.sub(r"\\\n", " ", text).splitlines() if ln.strip()
                 and not ln.lstrip().startswith("#")]
        stages = [i for i, ln in enumerate(lines) if ln.upper().startswith("FROM ")]
        if len(stages) < 2:
            problems.add(where, "not multi-stage")
            continue
        final = lines[stages[-1]:]
        # The targets of the build stage's `scripts/docker/build.sh OUT TARGET...` (one RUN).
        built = []
        for ln in lines[stages[0]:stages[-1]]:
            m = re.search(r"scripts/docker/build\.sh\s+\S+\s+(.+)$", ln)
            if m:
                built = m.group(1).split()
        user = [ln.split()[1] for ln in final if ln.upper().startswith("USER ")]
        if not user or user[-1].split(":")[0] in ("0", "root") or not user[-1][0].isdigit():
            problems.add(where, "the final stage does not run as a numeric non-root USER")
        entry = [json.loads(ln.split(None, 1)[1]) for ln in final if ln.upper().startswith("ENTRYPOINT ")]
        if not entry or os.path.basename(entry[-1][0]) != binary or binary not in built:
            problems.add(where, f"ENTRYPOINT is not {binary} built by scripts/docker/build.sh")
        exposed = {int(p) for ln in final if ln.upper().startswith("EXPOSE ")
                   for p in ln.split()[1:]}
        if binary in ports_by_binary and exposed != ports_by_binary[binary]:
            problems.add(where, f"EXPOSE {sorted(exposed)} but the manifests use "
                         f"{sorted(ports_by_binary[binary])}")
        cmd = [json.loads(ln.split(None, 1)[1]) for ln in final if ln.upper().startswith("CMD ")]
        if cmd:
            check_binary_accepts(bin_dir, binary, cmd[-1], where + " CMD", problems)
    # The runtime stage installs what the binaries load.
    binaries = [os.path.join(bin_dir, b) for b in DOCKERFILES]
    out = subprocess.run([os.path.join(ROOT, "scripts", "docker", "runtime_packages.sh")] + binaries,
                         capture_output=True, text=True)
    if out.returncode != 0:
        problems.add("scripts/docker/runtime_packages.sh", out.stderr.strip())
        return
    files = set()
    for package in out.stdout.split():
        listed = subprocess.run(["dpkg-query", "-L", package], capture_output=True, text=True)
        files |= {os.path.realpath(f) for f in listed.stdout.split()}
    for b in binaries:
        for line in subprocess.run(["ldd", b], capture_output=True, text=True).stdout.splitlines():
            parts = line.split()
            if (len(parts) >= 3 and parts[1] == "=>" and os.path.realpath(parts[2]) not in files
                    # the CUDA runtime and cuBLAS come with the worker's nvidia/cuda base image
                    and not os.path.realpath(parts[2]).startswith("/usr/local/cuda")):
                problems.add("scripts/docker/runtime_packages.sh",
                             f"{parts[2]} ({os.path.basename(b)}) is in none of {out.stdout.split()}")


def check_dev_certs(all_pods, problems, tmp):
    """scripts/deploy/dev_certs.sh issues certificates for the names the manifests dial."""
    out = os.path.join(tmp, "certs")
    run = subprocess.run([os.path.join(ROOT, "scripts", "deploy", "dev_certs.sh"), out],
                         capture_output=True, text=True)
    if run.returncode != 0:
        problems.add("scripts/deploy/dev_certs.sh", run.stderr.strip())
        return
    dialled = {("router", "infinigen-router")}
    for p in all_pods:
        for c in p["containers"]:
            f = c["flags"]
            for target in (f["workers"].split(",") if "workers" in f else []):
                dialled.add(("worker", target[len("dns:///"):].rsplit(":", 1)[0]))
            if c["binary"] == "infinigen-worker" and "kv_store" in f:
                # Another pod's ordinal than the one the flags were checked with.
                dialled.add(("kvstore", f["kv_store"].rsplit(":", 1)[0].replace("-0.", "-7.")))
    for service, name in sorted(dialled):
        kind = "-verify_ip" if re.fullmatch(r"[0-9.]+", name) else "-verify_hostname"
        v = subprocess.run(["openssl", "verify", "-CAfile", os.path.join(out, "ca.crt"), kind,
                            name, os.path.join(out, service + ".crt")],
                           capture_output=True, text=True)
        if v.returncode != 0:
            problems.add("scripts/deploy/dev_certs.sh",
                         f"the {service} certificate does not name {name}: {v.stdout}{v.stderr}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    a = parser.parse_args()
    if subprocess.run(["sh", "-c", "command -v kubectl"], capture_output=True).returncode != 0:
        print("SKIP: kubectl (with kustomize) is not installed; the manifests are not checked")
        return SKIP
    reexec_in_venv()
    problems = Problems()
    all_pods = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(K8S, "base"), os.path.join(K8S, "load-test")] + sorted(
            glob.glob(os.path.join(K8S, "overlays", "*")))
        for path in paths:
            objects, pods = check_kustomization(path, a.bin_dir, problems, tmp)
            all_pods += pods
            print(f"{os.path.relpath(path, ROOT)}: {len(objects)} objects, "
                  f"{sum(len(p['containers']) for p in pods)} containers")
        check_dockerfiles(a.bin_dir, all_pods, problems, tmp)
        check_dev_certs(all_pods, problems, tmp)
    for p in problems.items:
        print("PROBLEM " + p)
    print(f"{len(problems.items)} problems")
    return 1 if problems.items else 0


if __name__ == "__main__":
    sys.exit(main())
