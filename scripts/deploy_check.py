#!/usr/bin/env python3
"""Renders every Kustomize directory under deploy/ and validates what comes out, offline.

- Kubernetes objects: against the Kubernetes OpenAPI schemas of each version in --kube-versions
  (PyPI kubernetes-validate, strict: an unknown field is an error, as `kubectl apply` makes it).
- InferencePool and HTTPRoute: against the OpenAPI v3 schema of the CRDs vendored in deploy/crds
  (jsonschema, unknown fields rejected), after applying the schema's defaults as the API server
  does, and with every x-kubernetes-validations CEL rule evaluated (cel-python), except
  transition rules (`oldSelf`: updates only).
- References the API server cannot see across objects: selectors that match no pod template,
  an InferencePool's picker Service and port, an HTTPRoute's InferencePool, ConfigMaps, service
  accounts, volumes and named ports that do not exist.

`--self-test DIR` renders each case directory under DIR (a kustomization with an `expect` file
holding a substring of the error it must produce) and fails unless every case is rejected with
its message: the checker is shown to catch what it claims to catch.

Exit status 0 when everything is valid; 1 with one line per problem otherwise.
"""

import argparse
import copy
import pathlib
import re
import subprocess
import sys

import celpy
import jsonschema
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class Problems(list):
    def add(self, where, message):
        self.append(f"{where}: {message}")


def render(directory, kubectl):
    """The objects `kubectl kustomize DIR` renders (kustomize's deprecation warnings ignored)."""
    out = subprocess.run(
        [*kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed: {out.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def name_of(obj):
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('name')}"


# --- CRDs -----------------------------------------------------------------------------------


class Crd:
    """One served version of a vendored CRD: its schema, made strict, and its CEL rules."""

    def __init__(self, path):
        crd = yaml.safe_load(path.read_text())
        self.group = crd["spec"]["group"]
        self.kind = crd["spec"]["names"]["kind"]
        self.schemas = {
            v["name"]: v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v.get("served")
        }
        self.validators = {
            version: jsonschema.Draft202012Validator(strict_schema(schema))
            for version, schema in self.schemas.items()
        }

    def validate(self, obj, problems, cel):
        where = name_of(obj)
        version = obj["apiVersion"].split("/", 1)[1]
        if version not in self.schemas:
            problems.add(where, f"{self.group} serves no version {version} (CRD has {sorted(self.schemas)})")
            return
        for error in self.validators[version].iter_errors(obj):
            path = ".".join(str(p) for p in error.absolute_path) or "(root)"
            problems.add(where, f"{path}: {error.message}")
        defaulted = copy.deepcopy(obj)
        apply_defaults(self.schemas[version], defaulted)
        cel.check(self.schemas[version], defaulted, where, "", problems)


def strict_schema(schema):
    """The CRD's structural schema as JSON Schema with unknown fields rejected (the API server
    would prune them, and `kubectl apply` with strict field validation rejects them)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if not isinstance(node, dict):
            return
        if node.get("nullable") and isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for key, child in node.get("properties", {}).items():
            walk(child)
        if isinstance(node.get("items"), dict):
            walk(node["items"])
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"])

    walk(schema)
    return schema


def apply_defaults(schema, value):
    """Fills in `default`s the way the API server does before running CEL rules."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                if key not in schema.get("properties", {}):
                    apply_defaults(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(schema["items"], item)


class Cel:
    """Evaluates x-kubernetes-validations rules; compiled programs are cached by rule text."""

    def __init__(self):
        self.env = celpy.Environment()
        self.programs = {}
        self.evaluated = 0
        self.skipped_transition = 0

    def check(self, schema, value, where, path, problems):
        for rule in schema.get("x-kubernetes-validations", []):
            text = rule["rule"]
            if "oldSelf" in text:
                self.skipped_transition += 1
                continue
            try:
                program = self.programs.get(text)
                if program is None:
                    program = self.env.program(self.env.compile(text))
                    self.programs[text] = program
                result = program.evaluate({"self": celpy.json_to_cel(value)})
            except Exception as e:  # a rule we cannot evaluate is a failure, never a pass
                problems.add(where, f"{path or '(root)'}: cannot evaluate CEL rule {text!r}: {e}")
                continue
            self.evaluated += 1
            if isinstance(result, celpy.CELEvalError):
                problems.add(where, f"{path or '(root)'}: CEL rule {text!r} failed to evaluate: {result}")
            elif result is not True and result != celpy.celtypes.BoolType(True):
                problems.add(where, f"{path or '(root)'}: {rule.get('message') or text}")
        if isinstance(value, dict):
            for key, sub in schema.get("properties", {}).items():
                if key in value:
                    self.check(sub, value[key], where, f"{path}.{key}" if path else key, problems)
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                self.check(schema["items"], item, where, f"{path}[{i}]", problems)


# --- Kubernetes objects ---------------------------------------------------------------------


def validate_builtin(obj, versions, problems):
    for version in versions:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.absolute_path) or "(root)"
            problems.add(name_of(obj), f"Kubernetes {version}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.add(name_of(obj), e.message)


def validate_names(obj, problems):
    name = (obj.get("metadata") or {}).get("name") or ""
    if obj.get("kind") == "Service":
        if len(name) > 63 or not DNS1035_LABEL.match(name):
            problems.add(name_of(obj), "a Service name must be a DNS-1035 label (a-z, 0-9, '-', <= 63)")
    elif len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
        problems.add(name_of(obj), "the name must be a DNS-1123 subdomain")


def pod_templates(objects):
    """(owner, namespace, template) for every object that carries a pod template."""
    for obj in objects:
        if obj.get("kind") in POD_TEMPLATE_KINDS:
            template = obj.get("spec", {}).get("template", {})
            yield name_of(obj), obj["metadata"].get("namespace"), template


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_references(objects, all_templates, problems):
    """What the API server cannot check across objects. `objects` is one render; a selector may
    match pods of any render (model servers and routers are applied separately)."""
    by_kind = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj

    for owner, _, template in pod_templates(objects):
        spec = template.get("spec", {})
        labels = template.get("metadata", {}).get("labels", {})
        for obj in objects:
            if name_of(obj) == owner:
                selector = obj["spec"].get("selector", {}).get("matchLabels", {})
                if not selects(selector, labels):
                    problems.add(owner, f"spec.selector {selector} does not match the template's labels {labels}")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for volume in volumes.values():
            ref = (volume.get("configMap") or {}).get("name")
            if ref and ref not in by_kind.get("ConfigMap", {}):
                problems.add(owner, f"volume {volume['name']} names ConfigMap {ref}, which is not rendered here")
        account = spec.get("serviceAccountName")
        if account and account not in by_kind.get("ServiceAccount", {}):
            problems.add(owner, f"serviceAccountName {account} is not rendered here")
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            where = f"{owner} container {container['name']}"
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    problems.add(where, f"volumeMount {mount['name']} has no volume")
            ports = {p.get("name") for p in container.get("ports", []) if p.get("name")}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                handler = container.get(probe) or {}
                for kind in ("httpGet", "tcpSocket"):
                    port = (handler.get(kind) or {}).get("port")
                    if isinstance(port, str) and port not in ports:
                        problems.add(where, f"{probe} uses port {port!r}, which the container does not name")

    for service in by_kind.get("Service", {}).values():
        selector = service["spec"].get("selector") or {}
        matched = [t for _, _, t in all_templates if selects(selector, t.get("metadata", {}).get("labels", {}))]
        if selector and not matched:
            problems.add(name_of(service), f"selector {selector} matches no pod template in deploy/")
        for port in service["spec"].get("ports", []):
            target = port.get("targetPort")
            if isinstance(target, str):
                named = {
                    p.get("name")
                    for t in matched
                    for c in t.get("spec", {}).get("containers", [])
                    for p in c.get("ports", [])
                }
                if target not in named:
                    problems.add(name_of(service), f"targetPort {target!r} is not a port name of the pods it selects")

    for pdb in by_kind.get("PodDisruptionBudget", {}).values():
        selector = pdb["spec"].get("selector", {}).get("matchLabels", {})
        if not any(selects(selector, t.get("metadata", {}).get("labels", {})) for _, _, t in all_templates):
            problems.add(name_of(pdb), f"selector {selector} matches no pod template in deploy/")

    for binding in by_kind.get("RoleBinding", {}).values():
        role = binding["roleRef"]["name"]
        if binding["roleRef"]["kind"] == "Role" and role not in by_kind.get("Role", {}):
            problems.add(name_of(binding), f"roleRef Role {role} is not rendered here")
        for subject in binding.get("subjects", []):
            if subject["kind"] == "ServiceAccount" and subject["name"] not in by_kind.get("ServiceAccount", {}):
                problems.add(name_of(binding), f"subject ServiceAccount {subject['name']} is not rendered here")

    for pool in by_kind.get("InferencePool", {}).values():
        spec = pool["spec"]
        selector = spec.get("selector", {}).get("matchLabels", {})
        targets = {p["number"] for p in spec.get("targetPorts", [])}
        pods = [t for _, _, t in all_templates if selects(selector, t.get("metadata", {}).get("labels", {}))]
        if not pods:
            problems.add(name_of(pool), f"selector {selector} matches no pod template in deploy/")
        for t in pods:
            served = {p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
            if not targets <= served:
                problems.add(name_of(pool), f"targetPorts {sorted(targets)} not all served by the selected pods ({sorted(served)})")
        picker = spec.get("endpointPickerRef", {})
        if picker.get("kind", "Service") == "Service":
            service = by_kind.get("Service", {}).get(picker.get("name"))
            if service is None:
                problems.add(name_of(pool), f"endpointPickerRef Service {picker.get('name')} is not rendered here")
            else:
                number = (picker.get("port") or {}).get("number")
                if number not in {p["port"] for p in service["spec"].get("ports", [])}:
                    problems.add(name_of(pool), f"endpointPickerRef port {number} is not a port of Service {picker.get('name')}")

    for route in by_kind.get("HTTPRoute", {}).values():
        for i, rule in enumerate(route["spec"].get("rules", [])):
            for ref in rule.get("backendRefs", []):
                if ref.get("kind") == "InferencePool" and ref["name"] not in by_kind.get("InferencePool", {}):
                    problems.add(name_of(route), f"rules[{i}] backendRef InferencePool {ref['name']} is not rendered here")


# --- Driver ---------------------------------------------------------------------------------


def check(directories, kubectl, versions, crds):
    """Problems found in the renders of `directories`, and counts for the summary."""
    problems = Problems()
    cel = Cel()
    renders = {}
    for directory in directories:
        try:
            renders[directory] = render(directory, kubectl)
        except RuntimeError as e:
            problems.append(str(e))
    all_templates = [t for objects in renders.values() for t in pod_templates(objects)]
    objects_checked = 0
    for directory, objects in renders.items():
        local = Problems()
        for obj in objects:
            objects_checked += 1
            validate_names(obj, local)
            group = obj["apiVersion"].split("/", 1)[0] if "/" in obj["apiVersion"] else ""
            crd = crds.get((group, obj["kind"]))
            if crd is not None:
                crd.validate(obj, local, cel)
            else:
                validate_builtin(obj, versions, local)
        check_references(objects, all_templates, local)
        rel = directory.relative_to(ROOT) if directory.is_relative_to(ROOT) else directory
        problems.extend(f"{rel}: {p}" for p in local)
    return problems, objects_checked, len(renders), cel


def kustomize_dirs(top):
    """The deployable Kustomize directories: those no other kustomization builds on (a base is
    checked through the overlays that use it)."""
    found = sorted(p.parent for p in top.rglob("kustomization.yaml"))
    used = set()
    for directory in found:
        k = yaml.safe_load((directory / "kustomization.yaml").read_text()) or {}
        for ref in k.get("bases", []) + k.get("resources", []):
            if (directory / ref).is_dir():
                used.add((directory / ref).resolve())
    return [d for d in found if d.resolve() not in used]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deploy", type=pathlib.Path, default=ROOT / "deploy")
    parser.add_argument("--kubectl", default="kubectl", help="the kubectl binary (with built-in kustomize)")
    parser.add_argument("--kube-versions", default="1.30,1.37", help="Kubernetes schema versions, comma-separated")
    parser.add_argument("--self-test", type=pathlib.Path, help="a directory of broken cases that must each fail")
    args = parser.parse_args()
    kubectl = [args.kubectl]
    versions = [v.strip() for v in args.kube_versions.split(",") if v.strip()]
    crds = {}
    for path in sorted((args.deploy / "crds").glob("*.yaml")):
        crd = Crd(path)
        crds[(crd.group, crd.kind)] = crd
    if len(crds) < 2:
        print(f"deploy-check: expected the InferencePool and HTTPRoute CRDs in {args.deploy / 'crds'}", file=sys.stderr)
        return 1

    if args.self_test:
        cases = sorted(p for p in args.self_test.iterdir() if (p / "kustomization.yaml").exists())
        if not cases:
            print(f"deploy-check: no cases in {args.self_test}", file=sys.stderr)
            return 1
        failures = 0
        for case in cases:
            expect = (case / "expect").read_text().strip()
            problems, _, _, _ = check([case], kubectl, versions, crds)
            if not any(expect in p for p in problems):
                failures += 1
                print(f"deploy-check self-test: {case.name} was not rejected with {expect!r}; got: {problems}", file=sys.stderr)
        print(f"deploy-check self-test: {len(cases) - failures} of {len(cases)} broken cases rejected as expected")
        return 1 if failures else 0

    directories = kustomize_dirs(args.deploy)
    problems, objects, renders, cel = check(directories, kubectl, versions, crds)
    for p in problems:
        print(f"deploy-check: {p}", file=sys.stderr)
    if problems:
        print(f"deploy-check: {len(problems)} problems in {renders} renders", file=sys.stderr)
        return 1
    print(
        f"deploy-check: {objects} objects in {renders} renders valid (Kubernetes {', '.join(versions)} "
        f"schemas, strict; CRDs {', '.join(sorted(k for _, k in crds))} with {cel.evaluated} CEL rule "
        f"evaluations, {cel.skipped_transition} transition rules skipped)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
