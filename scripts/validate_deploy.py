#!/usr/bin/env python3
"""Validates the Kubernetes manifests under deploy/ (run by scripts/validate_deploy.sh).

What is checked, for every YAML file in deploy/ (deploy/crds/ aside):

1. Schemas.
   - Every core Kubernetes object against the Kubernetes API's own schemas
     for one Kubernetes version (kubernetes-validate, strict: an unknown
     field is an error, as `kubectl apply`'s default strict field
     validation makes it).
   - Every custom resource (InferencePool, Gateway, GatewayClass, HTTPRoute,
     SecurityPolicy) against the openAPIV3Schema of its version in the CRDs
     vendored under deploy/crds/ (see its README), made strict the same way
     (an object with `properties` and neither `additionalProperties` nor
     x-kubernetes-preserve-unknown-fields takes no other field). Not
     evaluated: the CRDs' CEL rules (x-kubernetes-validations), which only an
     API server runs.
   - The endpoint picker's EndpointPickerConfigs (every key of its
     ConfigMap; not a custom resource): apiVersion and kind, every field
     name against the API's Go types, every plugin type against the types
     llm-d router registers, the feature gates, every pluginRef, and the
     parameters of the plugins whose parameter types are vendored (any other
     plugin given parameters is an error: nothing here could check them).
     Its scheduling: one profile handler; disagg-profile-handler's profiles
     exist, its deciders.prefill names a P/D decider, its decode profile has
     decode-filter and its prefill profile prefill-filter.
2. The deployment hangs together.
   - kustomization.yaml lists every manifest but secrets.yaml, and each once,
     except the Bulkhead Deployments' files: it lists one topology, prefill
     and decode or both alone, never a mix (llm-d's prefill-filter and
     decode-filter both keep role-both pods).
   - Every namespaced object is in the Namespace of namespace.yaml.
   - The Bulkhead policies (policy.yaml): TOML; every field one that
     host/src/config.rs (and the structs it uses) declares; each role's rules
     (prefill: transfer_listen and no prefill_peers; decode: prefill_peers
     and no transfer_listen; both: neither); the three files equal but for
     their role lines; txn_ops_max within etcd's --max-txn-ops; the etcd
     endpoints are the StatefulSet's members; prefill_peers is the headless
     prefill Service's port, and the decode side's transfer_tls.server_name
     (when set) is its host.
   - Each Bulkhead Deployment: its command, role label and policy key agree;
     it gets every variable its policy needs from a Secret of secrets.yaml
     (key_env, the admin token, the transfer secret for prefill and decode);
     every file its policy names is mounted; its ports are its policy's
     listeners; liveness is /healthz and readiness /readyz on the inference
     port; it runs as non-root, read-only, every capability dropped.
   - The InferencePool selects every Bulkhead pod (the P/D picker needs the
     prefill pods as candidates too), its target port is their inference
     port, their llm-d.ai/engine-type is vllm, its picker is a Service that
     selects the picker's pods; the picker scrapes the pool's admin port; the
     config --config-file names fits the topology listed (a prefill stage
     exactly when prefill and decode pods are listed).
   - The ext_authz Service selects no prefill pod.
   - The HTTPRoute, Gateway, GatewayClass, SecurityPolicy and Services refer
     to objects and ports that exist.
3. With --bulkhead BIN: `BIN check --config POLICY --role ROLE` passes for
   each policy (the real parser and capacity checks), the model path pointed
   at a local copy of the file (--models DIR).

Every failure is printed as `FILE: OBJECT: WHERE: WHY`; the exit status is 1
when there is any. --selftest breaks copies of deploy/ in known ways and
checks that each is refused for the expected reason.
"""

import argparse
import copy
import functools
import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

import jsonschema
import yaml

try:
    from yaml import CSafeLoader as SafeLoader
except ImportError:  # pragma: no cover
    from yaml import SafeLoader

import kubernetes_validate
from kubernetes_validate import utils as kv_utils

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOT_IN_KUSTOMIZATION = {"kustomization.yaml", "secrets.yaml"}
# The two topologies kustomization.yaml may list (by the roles of the
# Bulkhead Deployments in the files it lists).
TOPOLOGIES = ({"prefill", "decode"}, {"both"})
# llm-d router v0.10.0's profile handlers and P/D deciders (plugin types).
PROFILE_HANDLERS = {"single-profile-handler", "disagg-profile-handler",
                    "data-parallel-profile-handler", "header-profile-handler",
                    "pd-profile-handler"}
PD_DECIDERS = {"always-disagg-pd-decider", "prefix-based-pd-decider"}
CLUSTER_SCOPED_CORE = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                       "StorageClass", "CustomResourceDefinition"}
# The Bulkhead policy's [server] lines that differ between roles.
ROLE_KEYS = {"role", "transfer_listen", "prefill_peers", "transfer_frame_timeout_ms",
             "transfer_tls"}
ROLES = ("both", "prefill", "decode")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

# kubernetes-validate reads and parses a schema file at every call; the
# files never change during a run.
kv_utils.schema_contents = functools.lru_cache(maxsize=None)(kv_utils.schema_contents)


class Failures:
    def __init__(self):
        self.items = []

    def add(self, file, obj, where, why):
        self.items.append(f"{file}: {obj}: {where}: {why}")


def obj_name(doc):
    meta = doc.get("metadata") or {}
    return f"{doc.get('kind', '?')}/{meta.get('name', '?')}"


def json_path(path):
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".") or "(root)"


# ---------------------------------------------------------------- loading

def load_documents(deploy, failures):
    """[(file name, doc)] of every manifest, deploy/crds/ aside."""
    docs = []
    for path in sorted(deploy.glob("*.yaml")):
        try:
            loaded = list(yaml.load_all(path.read_text(), Loader=SafeLoader))
        except yaml.YAMLError as error:
            failures.add(path.name, "-", "YAML", str(error).replace("\n", " "))
            continue
        for doc in loaded:
            if doc is None:
                continue
            if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
                failures.add(path.name, "-", "(root)", "not a Kubernetes object (apiVersion, kind)")
                continue
            docs.append((path.name, doc))
    return docs


@functools.lru_cache(maxsize=None)
def load_crds(crd_dir):
    """{(group/version, kind): (schema, scope)} of the vendored CRDs."""
    crds = {}
    for path in sorted(pathlib.Path(crd_dir).glob("*.yaml")):
        for doc in yaml.load_all(path.read_text(), Loader=SafeLoader):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if not version.get("served", True):
                    continue
                schema = strict_schema(version["schema"]["openAPIV3Schema"])
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                crds[key] = (schema, spec["scope"], path.name)
    return crds


def strict_schema(schema):
    """The schema with unknown fields refused wherever the API server
    would refuse them under strict field validation."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    # metadata is checked as ObjectMeta by check_metadata, whatever the CRD says.
    if "metadata" in schema.get("properties", {}):
        schema["properties"]["metadata"] = {"type": "object"}
    return schema


# ---------------------------------------------------------------- schemas

def check_metadata(file, doc, failures):
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        failures.add(file, obj_name(doc), "metadata.name", "missing")
        return
    name = meta["name"]
    if len(name) > 253 or not DNS_SUBDOMAIN.match(name):
        failures.add(file, obj_name(doc), "metadata.name", f"{name!r} is not a DNS subdomain")
    for field in ("labels", "annotations"):
        values = meta.get(field) or {}
        if not isinstance(values, dict):
            failures.add(file, obj_name(doc), f"metadata.{field}", "not a map")
            continue
        for key, value in values.items():
            if not isinstance(value, str):
                failures.add(file, obj_name(doc), f"metadata.{field}.{key}",
                             f"{value!r} is not a string")
            elif field == "labels" and (len(value) > 63 or not LABEL_VALUE.match(value)):
                failures.add(file, obj_name(doc), f"metadata.labels.{key}",
                             f"{value!r} is not a label value")


def check_schemas(docs, crds, k8s_version, failures, counts):
    for file, doc in docs:
        if doc["kind"] == "Kustomization":
            continue
        check_metadata(file, doc, failures)
        key = (doc["apiVersion"], doc["kind"])
        if key in crds:
            schema, scope, crd_file = crds[key]
            validator = jsonschema.Draft4Validator(schema)
            errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
            for error in errors:
                failures.add(file, obj_name(doc), json_path(error.absolute_path),
                             f"{error.message} (CRD {crd_file})")
            if scope == "Namespaced" and not (doc.get("metadata") or {}).get("namespace"):
                failures.add(file, obj_name(doc), "metadata.namespace", "missing (namespaced kind)")
            if scope == "Cluster" and (doc.get("metadata") or {}).get("namespace"):
                failures.add(file, obj_name(doc), "metadata.namespace", "set on a cluster-scoped kind")
            counts["custom"] += 1
            continue
        group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
        if group and "." in group and not group.endswith(".k8s.io"):
            failures.add(file, obj_name(doc), "apiVersion",
                         f"{doc['apiVersion']} {doc['kind']} has no vendored CRD in deploy/crds/")
            continue
        try:
            kubernetes_validate.validate(doc, k8s_version, strict=True)
            counts["core"] += 1
        except kubernetes_validate.ValidationError as error:
            failures.add(file, obj_name(doc), json_path(error.absolute_path),
                         f"{error.message} (Kubernetes {k8s_version})")
        except kubernetes_validate.SchemaNotFoundError as error:
            failures.add(file, obj_name(doc), "apiVersion", error.message)


# ---------------------------------------------------------------- the EPP config

def load_epp_types(crd_dir):
    types, deprecated = set(), set()
    for line in (crd_dir / "llm-d-router-plugin-types.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split()[0]
        types.add(name)
        if "(deprecated)" in line:
            deprecated.add(name)
    gates = {line.strip() for line in
             (crd_dir / "llm-d-router-feature-gates.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    fields = json.loads((crd_dir / "llm-d-router-config-fields.json").read_text())
    return types, deprecated, gates, fields


def check_go_fields(value, struct, structs, where, report, types=None):
    """Checks `value` against the Go struct `struct`'s JSON fields, the way
    a strict json/yaml decoder of the EPP would; `types` maps named Go types
    (`type StageOrder string`) to what they are."""
    fields = dict(structs[struct])
    if fields.pop("<inline>", None) == "metav1.TypeMeta":
        fields["apiVersion"] = "string"
        fields["kind"] = "string"
    if not isinstance(value, dict):
        report(where, f"must be an object ({struct})")
        return
    for key, item in value.items():
        if key not in fields:
            report(f"{where}.{key}".lstrip("."),
                   f"unknown field (the EPP decodes {struct} strictly: {sorted(fields)})")
            continue
        check_go_value(item, fields[key], structs, f"{where}.{key}".lstrip("."), report, types)


def check_go_value(value, go_type, structs, where, report, types=None):
    go_type = go_type.lstrip("*")
    go_type = (types or {}).get(go_type, go_type)
    if go_type.startswith("[]"):
        if not isinstance(value, list):
            report(where, f"must be a list ({go_type})")
            return
        for i, item in enumerate(value):
            check_go_value(item, go_type[2:], structs, f"{where}[{i}]", report, types)
        return
    if go_type in structs:
        check_go_fields(value, go_type, structs, where, report, types)
        return
    ok = {
        "string": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float64": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "FeatureGates": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "metav1.Duration": lambda v: isinstance(v, str),
        "resource.Quantity": lambda v: isinstance(v, (str, int, float)) and not isinstance(v, bool),
        "json.RawMessage": lambda v: True,
    }.get(go_type)
    if ok is None:
        report(where, f"the validator knows no Go type {go_type}")
    elif not ok(value):
        report(where, f"{value!r} is not a {go_type}")


def check_epp_config(file, doc, key, text, crd_dir, failures):
    """Returns the parsed config (or None)."""
    where_doc = f"{obj_name(doc)} data.{key}"

    def report(where, why):
        failures.add(file, where_doc, where or "(root)", why)

    try:
        config = yaml.load(text, Loader=SafeLoader)
    except yaml.YAMLError as error:
        report("(root)", f"YAML: {error}")
        return None
    types, deprecated, gates, fields = load_epp_types(crd_dir)
    if not isinstance(config, dict):
        report("(root)", "not a map")
        return None
    if config.get("apiVersion") != "llm-d.ai/v1alpha1":
        report("apiVersion", f"{config.get('apiVersion')!r}, not llm-d.ai/v1alpha1")
    if config.get("kind") != "EndpointPickerConfig":
        report("kind", f"{config.get('kind')!r}, not EndpointPickerConfig")
    api = fields["api"]
    check_go_fields(config, api["root"], api["structs"], "", report)
    for gate in config.get("featureGates") or []:
        if gate not in gates:
            report("featureGates", f"unknown feature gate {gate!r} (known: {sorted(gates)})")
    names = {}
    for i, plugin in enumerate(config.get("plugins") or []):
        if not isinstance(plugin, dict):
            continue
        kind = plugin.get("type")
        name = plugin.get("name") or kind
        if kind not in types:
            report(f"plugins[{i}].type",
                   f"unknown plugin type {kind!r}: llm-d router {fields['source']} registers no such type")
        elif kind in deprecated:
            report(f"plugins[{i}].type", f"plugin type {kind!r} is deprecated")
        if name in names:
            report(f"plugins[{i}].name", f"plugin name {name!r} is used twice")
        names[name] = kind
        if "parameters" in plugin:
            spec = fields["parameters"].get(kind)
            if spec is None:
                report(f"plugins[{i}].parameters",
                       f"parameters for {kind!r}, whose parameter type is not vendored "
                       f"(deploy/crds/vendor.py PLUGIN_PARAMETERS)")
            else:
                check_go_fields(plugin["parameters"], spec["root"], spec["structs"],
                                f"plugins[{i}].parameters", report, spec.get("types"))

    def ref(where, value):
        if value not in names:
            report(where, f"pluginRef {value!r} names no plugin of plugins[]")

    for i, profile in enumerate(config.get("schedulingProfiles") or []):
        for j, plugin in enumerate((profile or {}).get("plugins") or []):
            ref(f"schedulingProfiles[{i}].plugins[{j}].pluginRef", (plugin or {}).get("pluginRef"))
    for i, source in enumerate(((config.get("dataLayer") or {}).get("sources")) or []):
        ref(f"dataLayer.sources[{i}].pluginRef", source.get("pluginRef"))
        for j, extractor in enumerate(source.get("extractors") or []):
            ref(f"dataLayer.sources[{i}].extractors[{j}].pluginRef", extractor.get("pluginRef"))
    flow = config.get("flowControl") or {}
    for band_key in ("defaultPriorityBand", "defaultNegativePriorityBand"):
        band = flow.get(band_key) or {}
        for ref_key in ("fairnessPolicyRef", "orderingPolicyRef"):
            if band.get(ref_key):
                ref(f"flowControl.{band_key}.{ref_key}", band[ref_key])
    if flow.get("usageLimitPolicyPluginRef"):
        ref("flowControl.usageLimitPolicyPluginRef", flow["usageLimitPolicyPluginRef"])
    if flow and "flowControl" not in (config.get("featureGates") or []):
        report("flowControl", "configured, but the flowControl feature gate is off")
    check_epp_scheduling(config, names, report)
    return config


def epp_profiles(config):
    """{profile name: [the types of the plugins it refers to]}."""
    types = {(p.get("name") or p.get("type")): p.get("type")
             for p in config.get("plugins") or [] if isinstance(p, dict)}
    return {(profile or {}).get("name"): [types.get((ref or {}).get("pluginRef"))
                                          for ref in (profile or {}).get("plugins") or []]
            for profile in config.get("schedulingProfiles") or []}


def epp_prefill_stage(config):
    """Whether the config's profile handler schedules a prefill stage: a
    disagg-profile-handler with deciders.prefill."""
    for plugin in config.get("plugins") or []:
        if isinstance(plugin, dict) and plugin.get("type") == "disagg-profile-handler":
            return bool((((plugin.get("parameters") or {}).get("deciders")) or {}).get("prefill"))
    return False


def check_epp_scheduling(config, names, report):
    """The profile handler and its profiles, the way llm-d router v0.10.0's
    handlers read them (pkg/epp/framework/plugins/scheduling/profilehandler)."""
    handlers = [(i, p) for i, p in enumerate(config.get("plugins") or [])
                if isinstance(p, dict) and p.get("type") in PROFILE_HANDLERS]
    if len(handlers) != 1:
        report("plugins", f"{len(handlers)} profile handlers; the scheduler takes exactly one")
        return
    i, handler = handlers[0]
    profiles = epp_profiles(config)
    if handler["type"] == "single-profile-handler":
        if len(profiles) != 1:
            report("schedulingProfiles", f"{len(profiles)} profiles for single-profile-handler, which runs one")
        return
    if handler["type"] != "disagg-profile-handler":
        return
    params = handler.get("parameters") or {}
    where = f"plugins[{i}].parameters"
    named = params.get("profiles") or {}
    deciders = params.get("deciders") or {}
    if deciders.get("encode"):
        report(f"{where}.deciders.encode", "an encode stage: Bulkhead has no encode pods")
    decode = named.get("decode") or "decode"
    prefill = named.get("prefill") or "prefill"
    # (profile, the role filter it needs, why it must exist)
    wanted = [(decode, "decode-filter", "the decode stage always runs")]
    decider = deciders.get("prefill")
    if decider:
        if decider not in names:
            report(f"{where}.deciders.prefill", f"{decider!r} names no plugin of plugins[]")
        elif names[decider] not in PD_DECIDERS:
            report(f"{where}.deciders.prefill",
                   f"{decider!r} is a {names[decider]}, not a P/D decider ({sorted(PD_DECIDERS)})")
        wanted.append((prefill, "prefill-filter", "deciders.prefill is set"))
    for profile, role_filter, why in wanted:
        if profile not in profiles:
            report("schedulingProfiles", f"no profile {profile!r}, which {handler['type']} runs ({why})")
        elif role_filter not in profiles[profile]:
            report(f"schedulingProfiles.{profile}",
                   f"profile {profile!r} has no {role_filter}: it would choose among pods of any role")


# ---------------------------------------------------------------- the Bulkhead policy

@functools.lru_cache(maxsize=None)
def rust_fields(file, struct):
    """The serde field names of `pub struct STRUCT` in a Rust source file."""
    source = (ROOT / file).read_text()
    match = re.search(r"pub struct " + struct + r"\s*{(.*?)\n}", source, re.S)
    if not match:
        raise SystemExit(f"validate_deploy: no `pub struct {struct}` in {file}: update the validator")
    fields, skip = set(), False
    for line in match.group(1).splitlines():
        line = line.strip()
        if line.startswith("#[serde(skip"):
            skip = True
            continue
        found = re.match(r"pub (\w+):", line)
        if found:
            if not skip:
                fields.add(found.group(1))
            skip = False
    return frozenset(fields)


POLICY_TABLES = {
    # path in the policy: (file, struct)
    (): ("host/src/config.rs", "Config"),
    ("server",): ("host/src/config.rs", "ServerConfig"),
    ("server", "tls"): ("host/src/config.rs", "TlsConfig"),
    ("server", "transfer_tls"): ("host/src/config.rs", "TransferTlsConfig"),
    ("store",): ("host/src/config.rs", "StoreConfig"),
    ("store", "etcd"): ("host/src/store/etcd_storage.rs", "EtcdOptions"),
    ("engine",): ("host/src/config.rs", "EngineConfig"),
    ("plugins",): ("host/src/config.rs", "PluginsConfig"),
    ("models", "*"): ("host/src/store/records.rs", "ModelSpec"),
    ("tenants", "*"): ("host/src/config.rs", "TenantConfig"),
}


def check_policy_fields(policy, report):
    def walk(table, path):
        spec = POLICY_TABLES.get(path)
        if spec is None:
            return
        known = rust_fields(*spec)
        for key, value in table.items():
            if key not in known:
                report(".".join(path + (key,)),
                       f"unknown field (serde denies it: {spec[1]} in {spec[0]} has {sorted(known)})")
                continue
            sub = path + (key,)
            if isinstance(value, dict):
                if sub + ("*",) in POLICY_TABLES:
                    for name, item in value.items():
                        if isinstance(item, dict):
                            walk_item(item, sub + ("*",), f"{'.'.join(sub)}.{name}")
                else:
                    walk(value, sub)
            elif isinstance(value, list) and sub + ("*",) in POLICY_TABLES:
                for i, item in enumerate(value):
                    if isinstance(item, dict):
                        walk_item(item, sub + ("*",), f"{'.'.join(sub)}[{i}]")

    def walk_item(item, path, label):
        known = rust_fields(*POLICY_TABLES[path])
        for key in item:
            if key not in known:
                report(f"{label}.{key}", f"unknown field ({POLICY_TABLES[path][1]} has {sorted(known)})")

    walk(policy, ())


def host_port(addr):
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else None


# ---------------------------------------------------------------- consistency

class Index:
    def __init__(self, docs):
        self.docs = docs
        self.by_kind = {}
        for file, doc in docs:
            self.by_kind.setdefault(doc["kind"], []).append((file, doc))

    def all(self, kind):
        return self.by_kind.get(kind, [])

    def get(self, kind, name):
        for file, doc in self.all(kind):
            if (doc.get("metadata") or {}).get("name") == name:
                return file, doc
        return None, None


def pod_templates(index):
    """[(file, workload, pod template)] of Deployments and StatefulSets."""
    out = []
    for kind in ("Deployment", "StatefulSet"):
        for file, doc in index.all(kind):
            template = ((doc.get("spec") or {}).get("template")) or {}
            out.append((file, doc, template))
    return out


def labels_match(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_ports(template):
    ports = {}
    for container in ((template.get("spec") or {}).get("containers")) or []:
        for port in container.get("ports") or []:
            ports[port.get("name")] = port.get("containerPort")
    return ports


def resolve_target(template, target):
    ports = container_ports(template)
    if isinstance(target, int):
        return target if target in ports.values() else None
    return ports.get(target)


def check_consistency(deploy, docs, failures, crd_dir):
    index = Index(docs)

    # kustomization.yaml lists every manifest but secrets.yaml, once each,
    # and of the Bulkhead Deployments' files one topology's.
    manifests = {p.name for p in deploy.glob("*.yaml")}
    role_files = {}
    for file, doc in index.all("Deployment"):
        for role in ROLES:
            if doc["metadata"].get("name") == f"bulkhead-{role}":
                role_files[role] = file
    listed_roles = set(role_files)
    kfile, kdoc = None, None
    for file, doc in index.all("Kustomization"):
        kfile, kdoc = file, doc
    if kdoc is None:
        failures.add("kustomization.yaml", "-", "(root)", "missing")
    else:
        listed = kdoc.get("resources") or []
        for name in sorted(set(x for x in listed if listed.count(x) > 1)):
            failures.add(kfile, "Kustomization", "resources", f"{name} is listed twice")
        for name in listed:
            if name not in manifests:
                failures.add(kfile, "Kustomization", "resources", f"{name} does not exist")
        for name in sorted(manifests - NOT_IN_KUSTOMIZATION - set(role_files.values()) - set(listed)):
            failures.add(kfile, "Kustomization", "resources", f"{name} is not listed")
        for name in sorted(NOT_IN_KUSTOMIZATION & set(listed)):
            failures.add(kfile, "Kustomization", "resources",
                         f"{name} must not be listed (`apply -k` would overwrite real secrets)")
        listed_roles = {role for role, file in role_files.items() if file in listed}
        if listed_roles not in TOPOLOGIES:
            failures.add(kfile, "Kustomization", "resources",
                         f"lists Bulkhead roles {sorted(listed_roles)}: list prefill and decode "
                         f"({role_files.get('prefill')}, {role_files.get('decode')}) or both alone "
                         f"({role_files.get('both')}), never a mix: llm-d's prefill-filter and "
                         f"decode-filter both keep role-both pods")

    # One namespace for everything namespaced.
    namespaces = [d["metadata"]["name"] for _, d in index.all("Namespace")]
    if len(namespaces) != 1:
        failures.add("namespace.yaml", "-", "(root)", f"expected one Namespace, found {namespaces}")
        return
    ns = namespaces[0]
    crds = load_crds(str(crd_dir))
    for file, doc in docs:
        kind = doc["kind"]
        if kind in ("Kustomization",) or kind in CLUSTER_SCOPED_CORE:
            continue
        crd = crds.get((doc["apiVersion"], kind))
        if crd and crd[1] == "Cluster":
            continue
        got = (doc.get("metadata") or {}).get("namespace")
        if got != ns:
            failures.add(file, obj_name(doc), "metadata.namespace", f"{got!r}, not {ns!r}")

    secrets = {d["metadata"]["name"]: set((d.get("stringData") or {}) | (d.get("data") or {}))
               for _, d in index.all("Secret")}
    configmaps = {d["metadata"]["name"]: d.get("data") or {} for _, d in index.all("ConfigMap")}

    def check_secret_ref(file, doc, where, name, key):
        if name not in secrets:
            failures.add(file, obj_name(doc), where, f"Secret {name!r} is not in secrets.yaml")
        elif key is not None and key not in secrets[name]:
            failures.add(file, obj_name(doc), where, f"Secret {name!r} has no key {key!r}")

    # Every Secret and ConfigMap a pod reads exists, with the keys it reads.
    for file, doc, template in pod_templates(index):
        spec = template.get("spec") or {}
        for c, container in enumerate(spec.get("containers") or []):
            for e, env in enumerate(container.get("env") or []):
                ref = ((env.get("valueFrom") or {}).get("secretKeyRef"))
                if ref:
                    check_secret_ref(file, doc, f"containers[{c}].env[{e}]", ref.get("name"), ref.get("key"))
        for v, volume in enumerate(spec.get("volumes") or []):
            sources = []
            if "secret" in volume:
                sources.append(("secret", {"name": volume["secret"].get("secretName"),
                                           "items": volume["secret"].get("items")}))
            if "configMap" in volume:
                sources.append(("configMap", volume["configMap"]))
            for source in (volume.get("projected") or {}).get("sources") or []:
                for kind in ("secret", "configMap"):
                    if kind in source:
                        sources.append((kind, source[kind]))
            for kind, source in sources:
                where = f"volumes[{v}] ({volume.get('name')})"
                if kind == "secret":
                    for item in source.get("items") or [None]:
                        check_secret_ref(file, doc, where, source.get("name"),
                                         item and item.get("key"))
                else:
                    data = configmaps.get(source.get("name"))
                    if data is None:
                        failures.add(file, obj_name(doc), where, f"ConfigMap {source.get('name')!r} does not exist")
                        continue
                    for item in source.get("items") or []:
                        if item.get("key") not in data:
                            failures.add(file, obj_name(doc), where,
                                         f"ConfigMap {source.get('name')!r} has no key {item.get('key')!r}")

    # Services select pods that have the ports they target.
    templates = pod_templates(index)
    for file, svc in index.all("Service"):
        spec = svc.get("spec") or {}
        selector = spec.get("selector") or {}
        chosen = [t for _, _, t in templates if labels_match(selector, (t.get("metadata") or {}).get("labels") or {})]
        if not chosen:
            failures.add(file, obj_name(svc), "spec.selector", f"{selector} selects no pod template")
            continue
        for i, port in enumerate(spec.get("ports") or []):
            target = port.get("targetPort", port.get("port"))
            for template in chosen:
                if resolve_target(template, target) is None:
                    failures.add(file, obj_name(svc), f"spec.ports[{i}].targetPort",
                                 f"{target!r} is no port of a pod it selects")

    # PodDisruptionBudgets select something.
    for file, pdb in index.all("PodDisruptionBudget"):
        selector = (((pdb.get("spec") or {}).get("selector")) or {}).get("matchLabels") or {}
        if not any(labels_match(selector, (t.get("metadata") or {}).get("labels") or {}) for _, _, t in templates):
            failures.add(file, obj_name(pdb), "spec.selector", "selects no pod template")

    check_bulkhead(index, ns, failures, secrets)
    check_gateway_objects(index, ns, failures, crd_dir, listed_roles)


def etcd_flag(args, flag):
    for arg in args:
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def check_bulkhead(index, ns, failures, secrets):
    pfile, pcm = index.get("ConfigMap", "bulkhead-policy")
    if pcm is None:
        failures.add("policy.yaml", "ConfigMap/bulkhead-policy", "(root)", "missing")
        return
    policies = {}
    for role in ROLES:
        key = f"{role}.toml"
        text = (pcm.get("data") or {}).get(key)

        def report(where, why, key=key):
            failures.add(pfile, f"ConfigMap/bulkhead-policy data.{key}", where, why)

        if text is None:
            report("(root)", "missing")
            continue
        try:
            policy = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            report("(root)", f"TOML: {error}")
            continue
        policies[role] = policy
        check_policy_fields(policy, report)
        server = policy.get("server") or {}
        if server.get("role", "both") != role:
            report("server.role", f"{server.get('role')!r} in the {role} policy")
        listen, peers = server.get("transfer_listen"), server.get("prefill_peers") or []
        if role == "prefill" and (not listen or peers):
            report("server", "role prefill needs transfer_listen and no prefill_peers")
        if role == "decode" and (listen or not peers):
            report("server", "role decode needs prefill_peers and no transfer_listen")
        if role == "both" and (listen or peers):
            report("server", "role both takes neither transfer_listen nor prefill_peers")
        if role != "both" and not server.get("transfer_tls"):
            report("server.transfer_tls", "a transfer link between pods must use mutual TLS")

    # The three policies are one but for the role lines.
    def without_role(policy):
        policy = copy.deepcopy(policy)
        for key in ROLE_KEYS:
            policy.get("server", {}).pop(key, None)
        return policy

    if "both" in policies:
        base = without_role(policies["both"])
        for role in ("prefill", "decode"):
            if role in policies and without_role(policies[role]) != base:
                diff = sorted(k for k in set(base) | set(without_role(policies[role]))
                              if base.get(k) != without_role(policies[role]).get(k))
                failures.add(pfile, f"ConfigMap/bulkhead-policy data.{role}.toml", ",".join(diff),
                             "differs from both.toml beyond the role lines "
                             f"({', '.join(sorted(ROLE_KEYS))})")

    # etcd: txn_ops_max within --max-txn-ops; the endpoints are its members.
    efile, etcd = index.get("StatefulSet", "etcd")
    any_policy = next(iter(policies.values()), None)
    if etcd is not None and any_policy is not None:
        store = any_policy.get("store") or {}
        options = store.get("etcd") or {}
        container = etcd["spec"]["template"]["spec"]["containers"][0]
        args = container.get("args") or []
        max_ops = etcd_flag(args, "--max-txn-ops")
        txn = options.get("txn_ops_max", 128)
        if store.get("backend") != "etcd":
            failures.add(pfile, "ConfigMap/bulkhead-policy", "store.backend",
                         f"{store.get('backend')!r}: the deployment runs etcd for a shared store")
        if max_ops is None:
            failures.add(efile, obj_name(etcd), "args", "no --max-txn-ops (etcd's default is 128)")
            max_ops = "128"
        if int(txn) > int(max_ops):
            failures.add(pfile, "ConfigMap/bulkhead-policy", "store.etcd.txn_ops_max",
                         f"{txn} exceeds etcd's --max-txn-ops={max_ops} ({efile})")
        for flag, want in (("--auto-compaction-mode", "periodic"), ("--auto-compaction-retention", "1h")):
            if etcd_flag(args, flag) != want:
                failures.add(efile, obj_name(etcd), "args", f"{flag} is not {want}")
        replicas = etcd["spec"].get("replicas", 1)
        service = etcd["spec"].get("serviceName")
        client_port = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}.get("client")
        want = {f"https://{etcd['metadata']['name']}-{i}.{service}:{client_port}" for i in range(replicas)}
        got = set(options.get("endpoints") or [])
        if got != want:
            failures.add(pfile, "ConfigMap/bulkhead-policy", "store.etcd.endpoints",
                         f"{sorted(got)} are not the StatefulSet's members {sorted(want)}")
        initial = etcd_flag(args, "--initial-cluster") or ""
        if len(initial.split(",")) != replicas:
            failures.add(efile, obj_name(etcd), "args", f"--initial-cluster names {len(initial.split(','))} members, replicas is {replicas}")
        hsvc_file, hsvc = index.get("Service", service)
        if hsvc is None or (hsvc.get("spec") or {}).get("clusterIP") != "None":
            failures.add(efile, obj_name(etcd), "spec.serviceName", f"{service!r} is not a headless Service here")

    # Each role's Deployment runs its policy.
    for role in ROLES:
        dfile, dep = index.get("Deployment", f"bulkhead-{role}")
        if dep is None:
            continue
        check_bulkhead_deployment(index, ns, dfile, dep, role, policies.get(role), failures)

    # prefill_peers is the headless prefill Service.
    decode = policies.get("decode")
    if decode is not None:
        sfile, svc = index.get("Service", "bulkhead-prefill")
        for peer in (decode.get("server") or {}).get("prefill_peers") or []:
            host, port = host_port(peer)
            if svc is None:
                failures.add(pfile, "ConfigMap/bulkhead-policy data.decode.toml", "server.prefill_peers",
                             "no Service bulkhead-prefill")
                break
            names = {svc["metadata"]["name"], f"{svc['metadata']['name']}.{ns}",
                     f"{svc['metadata']['name']}.{ns}.svc", f"{svc['metadata']['name']}.{ns}.svc.cluster.local"}
            ports = {p.get("port") for p in svc["spec"].get("ports") or []}
            if host not in names or port not in ports:
                failures.add(pfile, "ConfigMap/bulkhead-policy data.decode.toml", "server.prefill_peers",
                             f"{peer!r} is not the bulkhead-prefill Service ({sorted(names)}, ports {sorted(ports)})")
            if svc["spec"].get("clusterIP") != "None":
                failures.add(sfile, obj_name(svc), "spec.clusterIP",
                             "must be None (headless): decode pods dial the prefill pods themselves, "
                             "and check the picker's x-prefiller-host-port against its addresses")
            server_name = ((decode.get("server") or {}).get("transfer_tls") or {}).get("server_name")
            if server_name is not None and server_name != host:
                failures.add(pfile, "ConfigMap/bulkhead-policy data.decode.toml",
                             "server.transfer_tls.server_name",
                             f"{server_name!r} is not the prefill_peers host {host!r} (the name the "
                             f"prefill certificate carries)")


def check_bulkhead_deployment(index, ns, file, dep, role, policy, failures):
    def report(where, why):
        failures.add(file, obj_name(dep), where, why)

    template = dep["spec"]["template"]
    labels = (template.get("metadata") or {}).get("labels") or {}
    if labels.get("llm-d.ai/role") != role:
        report("spec.template.metadata.labels", f"llm-d.ai/role is {labels.get('llm-d.ai/role')!r}, not {role!r}")
    if labels.get("app.kubernetes.io/name") != "bulkhead":
        report("spec.template.metadata.labels", "app.kubernetes.io/name is not bulkhead")
    spec = template["spec"]
    containers = spec.get("containers") or []
    if len(containers) != 1:
        report("spec.template.spec.containers", "expected one container")
        return
    c = containers[0]
    command = (c.get("command") or []) + (c.get("args") or [])
    config_path = None
    if command[:2] != ["bulkhead", "serve"]:
        report("containers[0].command", f"{command[:2]} is not bulkhead serve")
    if "--config" in command:
        config_path = command[command.index("--config") + 1]
    else:
        report("containers[0].command", "no --config")
    if "--role" not in command or command[command.index("--role") + 1] != role:
        report("containers[0].command", f"not --role {role}")

    # The files the pod has: every (mountPath / item path) of its volumes.
    volumes = {v.get("name"): v for v in spec.get("volumes") or []}
    files, policy_keys = set(), []
    for mount in c.get("volumeMounts") or []:
        volume = volumes.get(mount.get("name"))
        if volume is None:
            report("containers[0].volumeMounts", f"volume {mount.get('name')!r} is not defined")
            continue
        sources = [volume] + list((volume.get("projected") or {}).get("sources") or [])
        for source in sources:
            for kind in ("configMap", "secret"):
                if kind in source:
                    for item in source[kind].get("items") or []:
                        files.add(f"{mount['mountPath'].rstrip('/')}/{item['path']}")
                        if kind == "configMap" and source[kind].get("name") == "bulkhead-policy":
                            policy_keys.append((f"{mount['mountPath'].rstrip('/')}/{item['path']}", item["key"]))
    if config_path and (config_path, f"{role}.toml") not in policy_keys:
        report("volumes", f"--config {config_path} is not the bulkhead-policy key {role}.toml")

    env = {e.get("name"): e for e in c.get("env") or []}
    server_name = ((env.get("BULKHEAD_SERVER_NAME") or {}).get("valueFrom") or {}).get("fieldRef") or {}
    if server_name.get("fieldPath") != "metadata.name":
        report("containers[0].env", "BULKHEAD_SERVER_NAME is not the pod's name (fieldRef metadata.name)")
    needed = ["BULKHEAD_ADMIN_TOKEN"]
    if role != "both":
        needed.append("BULKHEAD_TRANSFER_SECRET")
    if policy is not None:
        for name, tenant in (policy.get("tenants") or {}).items():
            if tenant.get("key_env"):
                needed.append(tenant["key_env"])
    for var in needed:
        if not ((env.get(var) or {}).get("valueFrom") or {}).get("secretKeyRef"):
            report("containers[0].env", f"{var} does not come from a Secret")

    ports = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
    if policy is not None:
        server = policy.get("server") or {}
        for field, name in (("listen", "http"), ("admin_listen", "admin")):
            _, port = host_port(server.get(field, ""))
            if ports.get(name) != port:
                report("containers[0].ports", f"port {name} is {ports.get(name)}, server.{field} is {port}")
        if role == "prefill":
            _, port = host_port(server.get("transfer_listen", ""))
            if ports.get("transfer") != port:
                report("containers[0].ports", f"port transfer is {ports.get('transfer')}, server.transfer_listen is {port}")
        elif "transfer" in ports:
            report("containers[0].ports", f"a {role} pod has no transfer listener")
        named = []
        tls = server.get("transfer_tls") or {}
        named += [tls[k] for k in ("cert_pem", "key_pem", "ca_pem") if k in tls]
        etcd = (policy.get("store") or {}).get("etcd") or {}
        named += [etcd[k] for k in ("ca_file", "cert_file", "key_file") if k in etcd]
        for path in named:
            if path not in files:
                report("volumes", f"the policy names {path}, which no volume of the pod provides")
        mounts = {m.get("mountPath"): m for m in c.get("volumeMounts") or []}
        store_path = (policy.get("store") or {}).get("path")
        if store_path not in mounts or mounts[store_path].get("readOnly"):
            report("containers[0].volumeMounts", f"[store] path {store_path} is not a writable mount")
        for model in policy.get("models") or []:
            parent = str(pathlib.PurePosixPath(model.get("path", "")).parent)
            if parent not in mounts:
                report("containers[0].volumeMounts", f"model {model.get('id')}: {parent} is not mounted")

    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = (c.get(probe) or {}).get("httpGet") or {}
        port = get.get("port")
        port = ports.get(port, port)
        if get.get("path") != path or port != ports.get("http"):
            report(f"containers[0].{probe}", f"must be GET {path} on the inference port")
    sc = c.get("securityContext") or {}
    psc = spec.get("securityContext") or {}
    if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
        report("securityContext", "runAsNonRoot is not set")
    if not sc.get("readOnlyRootFilesystem"):
        report("containers[0].securityContext", "readOnlyRootFilesystem is not set")
    if sc.get("allowPrivilegeEscalation") is not False:
        report("containers[0].securityContext", "allowPrivilegeEscalation is not false")
    if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
        report("containers[0].securityContext", "capabilities are not all dropped")
    resources = c.get("resources") or {}
    if not resources.get("requests") or not resources.get("limits"):
        report("containers[0].resources", "requests and limits must both be set")


def check_gateway_objects(index, ns, failures, crd_dir, listed_roles):
    templates = pod_templates(index)

    # The InferencePool: every Bulkhead pod, whatever its role; its picker.
    pool_file, pool = index.get("InferencePool", "bulkhead")
    pool_templates = []
    picker_file, picker = None, None
    if pool is None:
        failures.add("inferencepool.yaml", "InferencePool/bulkhead", "(root)", "missing")
    else:
        spec = pool.get("spec") or {}
        selector = ((spec.get("selector") or {}).get("matchLabels")) or {}
        for file, workload, template in templates:
            labels = (template.get("metadata") or {}).get("labels") or {}
            role = labels.get("llm-d.ai/role")
            selected = labels_match(selector, labels)
            if role in ROLES and not selected:
                failures.add(pool_file, obj_name(pool), "spec.selector",
                             f"does not select {obj_name(workload)} (role {role}): the picker chooses "
                             f"decode pods and names prefill pods from the pool's pods")
            if selected and labels.get("app.kubernetes.io/name") != "bulkhead":
                failures.add(pool_file, obj_name(pool), "spec.selector",
                             f"selects {obj_name(workload)}, which is no Bulkhead pod")
            if selected:
                pool_templates.append(template)
                if labels.get("llm-d.ai/engine-type") != "vllm":
                    failures.add(file, obj_name(workload), "spec.template.metadata.labels",
                                 "llm-d.ai/engine-type is not vllm: the picker's core-metrics-extractor "
                                 "would not read its vLLM-named gauges")
        for i, target in enumerate(spec.get("targetPorts") or []):
            for template in pool_templates:
                if container_ports(template).get("http") != target.get("number"):
                    failures.add(pool_file, obj_name(pool), f"spec.targetPorts[{i}]",
                                 f"{target.get('number')} is not the pods' inference port")
        ref = spec.get("endpointPickerRef") or {}
        picker_file, picker = index.get("Service", ref.get("name"))
        if picker is None:
            failures.add(pool_file, obj_name(pool), "spec.endpointPickerRef",
                         f"no Service {ref.get('name')!r}")
        else:
            ports = {p.get("port") for p in picker["spec"].get("ports") or []}
            if (ref.get("port") or {}).get("number") not in ports:
                failures.add(pool_file, obj_name(pool), "spec.endpointPickerRef.port",
                             f"not a port of Service {ref.get('name')} ({sorted(ports)})")

    # The picker: its config, its pool, and where it scrapes.
    efile, epp = index.get("Deployment", "bulkhead-epp")
    if epp is not None:
        c = epp["spec"]["template"]["spec"]["containers"][0]
        args = dict(a.split("=", 1) for a in c.get("args") or [] if a.startswith("--") and "=" in a)
        if pool is not None and args.get("--pool-name") != pool["metadata"]["name"]:
            failures.add(efile, obj_name(epp), "args", f"--pool-name is not {pool['metadata']['name']}")
        config_path = args.get("--config-file", "")
        mounts = {m.get("name"): m.get("mountPath") for m in c.get("volumeMounts") or []}
        volumes = {v.get("name"): v for v in epp["spec"]["template"]["spec"].get("volumes") or []}
        config, found = None, False
        # Every key of a ConfigMap the picker mounts is a configuration: the
        # one --config-file names, and the other topology's.
        configs = {}
        for name, mount in mounts.items():
            cm = (volumes.get(name) or {}).get("configMap")
            if not cm:
                continue
            cfile, cdoc = index.get("ConfigMap", cm.get("name"))
            if cdoc is None:
                continue
            for key, text in sorted((cdoc.get("data") or {}).items()):
                parsed = check_epp_config(cfile, cdoc, key, text, crd_dir, failures)
                if parsed:
                    configs[key] = (cfile, parsed)
            if config_path.startswith(mount.rstrip("/") + "/"):
                key = config_path[len(mount.rstrip("/")) + 1:]
                if key not in (cdoc.get("data") or {}):
                    failures.add(efile, obj_name(epp), "args", f"--config-file {config_path}: ConfigMap {cm.get('name')} has no key {key}")
                else:
                    found = True
                    config = configs.get(key, (None, None))[1]
                    used = (cfile, key)
        if not found:
            failures.add(efile, obj_name(epp), "args", f"--config-file {config_path!r} is no ConfigMap key it mounts")
        for key, (cfile, parsed) in configs.items():
            for plugin in parsed.get("plugins") or []:
                if isinstance(plugin, dict) and plugin.get("type") == "metrics-data-source":
                    params = plugin.get("parameters") or {}
                    for template in pool_templates:
                        admin = container_ports(template).get("admin")
                        if params.get("port") != admin:
                            failures.add(cfile, f"ConfigMap/bulkhead-epp data.{key}", "metrics-data-source.parameters.port",
                                         f"{params.get('port')} is not the pods' admin port {admin}, where /metrics is")
                    if params.get("path", "/metrics") != "/metrics":
                        failures.add(cfile, f"ConfigMap/bulkhead-epp data.{key}", "metrics-data-source.parameters.path",
                                     "Bulkhead serves /metrics")
        # The configuration in use fits the topology kustomization.yaml lists.
        if config:
            cfile, key = used
            prefill_stage = epp_prefill_stage(config)
            if listed_roles == {"prefill", "decode"} and not prefill_stage:
                failures.add(efile, obj_name(epp), "args",
                             f"--config-file {config_path}: data.{key} schedules no prefill stage, but "
                             f"prefill and decode pods are listed (use the disagg-profile-handler "
                             f"configuration, epp-config.yaml)")
            if listed_roles == {"both"} and prefill_stage:
                failures.add(efile, obj_name(epp), "args",
                             f"--config-file {config_path}: data.{key} schedules a prefill stage, but only "
                             f"role-both pods are listed (prefill-filter keeps them: use the one-profile "
                             f"configuration, epp-config-both.yaml)")
        if picker is not None and not labels_match(picker["spec"].get("selector") or {},
                                                   epp["spec"]["template"]["metadata"].get("labels") or {}):
            failures.add(picker_file, obj_name(picker), "spec.selector", "does not select the picker's pods")

    # Routes, gateways, the class, and the policy attached.
    for file, route in index.all("HTTPRoute"):
        for i, parent in enumerate(route["spec"].get("parentRefs") or []):
            gfile, gw = index.get("Gateway", parent.get("name"))
            if gw is None:
                failures.add(file, obj_name(route), f"spec.parentRefs[{i}]", f"no Gateway {parent.get('name')!r}")
            elif parent.get("sectionName") and parent["sectionName"] not in {
                    l.get("name") for l in gw["spec"].get("listeners") or []}:
                failures.add(file, obj_name(route), f"spec.parentRefs[{i}].sectionName",
                             f"Gateway {gw['metadata']['name']} has no listener {parent['sectionName']!r}")
        for r, rule in enumerate(route["spec"].get("rules") or []):
            for b, backend in enumerate(rule.get("backendRefs") or []):
                if backend.get("kind") == "InferencePool":
                    if backend.get("group") != "inference.networking.k8s.io":
                        failures.add(file, obj_name(route), f"spec.rules[{r}].backendRefs[{b}].group",
                                     "an InferencePool is in inference.networking.k8s.io")
                    if index.get("InferencePool", backend.get("name"))[1] is None:
                        failures.add(file, obj_name(route), f"spec.rules[{r}].backendRefs[{b}]",
                                     f"no InferencePool {backend.get('name')!r}")
    for file, gw in index.all("Gateway"):
        if index.get("GatewayClass", gw["spec"].get("gatewayClassName"))[1] is None:
            failures.add(file, obj_name(gw), "spec.gatewayClassName", "no such GatewayClass here")
        for i, listener in enumerate(gw["spec"].get("listeners") or []):
            for ref in ((listener.get("tls") or {}).get("certificateRefs")) or []:
                if not any(d["metadata"]["name"] == ref.get("name") and d.get("type") == "kubernetes.io/tls"
                           for _, d in index.all("Secret")):
                    failures.add(file, obj_name(gw), f"spec.listeners[{i}].tls",
                                 f"no kubernetes.io/tls Secret {ref.get('name')!r} in secrets.yaml")
    for file, policy in index.all("SecurityPolicy"):
        spec = policy.get("spec") or {}
        for i, target in enumerate(spec.get("targetRefs") or []):
            if index.get(target.get("kind"), target.get("name"))[1] is None:
                failures.add(file, obj_name(policy), f"spec.targetRefs[{i}]",
                             f"no {target.get('kind')} {target.get('name')!r}")
        http = (spec.get("extAuth") or {}).get("http") or {}
        if http:
            if http.get("path") != "/ext-authz":
                failures.add(file, obj_name(policy), "spec.extAuth.http.path",
                             f"{http.get('path')!r}: Bulkhead serves ext_authz under /ext-authz")
            if "x-llm-d-inference-fairness-id" not in (http.get("headersToBackend") or []):
                failures.add(file, obj_name(policy), "spec.extAuth.http.headersToBackend",
                             "must carry x-llm-d-inference-fairness-id to the picker")
            for i, backend in enumerate(http.get("backendRefs") or []):
                sfile, svc = index.get("Service", backend.get("name"))
                if svc is None:
                    failures.add(file, obj_name(policy), f"spec.extAuth.http.backendRefs[{i}]",
                                 f"no Service {backend.get('name')!r}")
                    continue
                port = next((p for p in svc["spec"].get("ports") or [] if p.get("port") == backend.get("port")), None)
                chosen = [t for _, _, t in templates
                          if labels_match(svc["spec"].get("selector") or {}, (t.get("metadata") or {}).get("labels") or {})]
                if any(((t.get("metadata") or {}).get("labels") or {}).get("llm-d.ai/role") == "prefill"
                       for t in chosen):
                    failures.add(file, obj_name(policy), f"spec.extAuth.http.backendRefs[{i}]",
                                 f"Service {svc['metadata']['name']} selects prefill pods, which serve no "
                                 f"client and whose inference port the gateway may not reach "
                                 f"(networkpolicies.yaml)")
                if port is None or any(resolve_target(t, port.get("targetPort", port.get("port")))
                                       != container_ports(t).get("http") for t in chosen):
                    failures.add(file, obj_name(policy), f"spec.extAuth.http.backendRefs[{i}].port",
                                 "is not the Bulkhead inference port (ext_authz is served there)")


# ---------------------------------------------------------------- bulkhead check

def run_bulkhead_check(deploy, binary, models, failures):
    docs = [d for _, d in load_documents(deploy, Failures()) if d.get("kind") == "ConfigMap"
            and d["metadata"]["name"] == "bulkhead-policy"]
    if not docs:
        return
    with tempfile.TemporaryDirectory() as tmp:
        for key, text in sorted(docs[0]["data"].items()):
            role = key.removesuffix(".toml")
            policy = tomllib.loads(text)
            for model in policy.get("models") or []:
                local = pathlib.Path(models) / pathlib.PurePosixPath(model["path"]).name
                if not local.exists():
                    failures.add("policy.yaml", f"data.{key}", f"models {model['id']}",
                                 f"--bulkhead given, but {local} does not exist (--models DIR)")
                    return
                text = text.replace(f'"{model["path"]}"', json.dumps(str(local)))
            store = policy.get("store", {}).get("path")
            if store:
                text = text.replace(f'"{store}"', json.dumps(f"{tmp}/store-{role}"))
            # The policy's own contract, not a cluster's store (none runs here):
            # with backend "sled" and no store yet, `check` reads the policy.
            text = re.sub(r'(?m)^(\s*backend\s*=\s*)"etcd"', r'\1"sled"', text)
            path = pathlib.Path(tmp) / key
            path.write_text(text)
            result = subprocess.run([binary, "check", "--config", str(path), "--role", role],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                why = (result.stderr.strip() or result.stdout.strip()).splitlines()
                failures.add("policy.yaml", f"ConfigMap/bulkhead-policy data.{key}",
                             f"bulkhead check --role {role}", " | ".join(why[-3:]))
            else:
                print(f"  bulkhead check --role {role}: {result.stdout.strip().splitlines()[-1]}")


# ---------------------------------------------------------------- driver

def validate(deploy, k8s_version, quiet=False):
    failures = Failures()
    crd_dir = deploy / "crds"
    docs = load_documents(deploy, failures)
    counts = {"core": 0, "custom": 0}
    crds = load_crds(str(crd_dir))
    check_schemas(docs, crds, k8s_version, failures, counts)
    try:
        check_consistency(deploy, docs, failures, crd_dir)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as error:
        # A shape the schemas refused already, most likely: say so, still fail.
        failures.add("deploy/", "-", "consistency checks",
                     f"stopped at {type(error).__name__}: {error} (fix the errors above first)")
    if not quiet:
        files = len({f for f, _ in docs})
        print(f"  {len(docs)} objects in {files} files: {counts['core']} core objects against the "
              f"Kubernetes {k8s_version} schemas, {counts['custom']} custom resources against "
              f"{len(crds)} vendored CRD versions, the EndpointPickerConfigs, the policies")
    return failures


SELFTEST = [
    # (file, old text, new text, a fragment the failure must contain)
    ("bulkhead-both.yaml", "  replicas: 2\n", '  replicas: "three"\n',
     "bulkhead-both.yaml: Deployment/bulkhead-both: spec.replicas: 'three' is not of type 'integer'"),
    ("inferencepool.yaml", """  selector:
    matchLabels:
      app.kubernetes.io/name: bulkhead
""", "", "InferencePool/bulkhead: spec: 'selector' is a required property"),
    # The old single-pool shape: the pool without the prefill pods.
    ("inferencepool.yaml", "      app.kubernetes.io/name: bulkhead\n  #",
     "      app.kubernetes.io/name: bulkhead\n      app.kubernetes.io/component: server\n  #",
     "does not select Deployment/bulkhead-prefill (role prefill)"),
    ("inferencepool.yaml", "    failureMode: FailClose", "    failureMode: FailShut",
     "spec.endpointPickerRef.failureMode: 'FailShut' is not one of"),
    ("httproute.yaml", "      timeouts:", "      timeout:",
     "HTTPRoute/bulkhead: spec.rules[0]: Additional properties are not allowed ('timeout'"),
    ("ext-authz.yaml", "      headersToBackend:", "      headersToBackends:",
     "SecurityPolicy/bulkhead-ext-authz: spec.extAuth.http: Additional properties are not allowed"),
    ("gateway.yaml", "      protocol: HTTPS", "      protocol: 443",
     "Gateway/bulkhead: spec.listeners[0].protocol: 443 is not of type 'string'"),
    ("networkpolicies.yaml", "  policyTypes:\n    - Ingress\n  ingress:\n    - from:\n        - namespaceSelector:",
     "  policyTypes:\n    - Ingress\n  ingres:\n    - from:\n        - namespaceSelector:",
     "NetworkPolicy/bulkhead-server: spec: Additional properties are not allowed ('ingres'"),
    ("epp-config.yaml", "      - type: queue-scorer", "      - type: queue-scorrer",
     "unknown plugin type 'queue-scorrer'"),
    ("epp-config.yaml", "          interval: 200ms", "          intervall: 200ms",
     "plugins[0].parameters.intervall: unknown field"),
    ("epp-config.yaml", "    kind: EndpointPickerConfig", "    kind: EndpointPickerConfiguration",
     "kind: 'EndpointPickerConfiguration', not EndpointPickerConfig"),
    ("epp-config.yaml", "          port: 8081", "          port: 8080",
     "8080 is not the pods' admin port 8081"),
    ("policy.yaml", 'txn_ops_max = 1024', 'txn_ops_max = 4096',
     "store.etcd.txn_ops_max: 4096 exceeds etcd's --max-txn-ops=1024"),
    ("policy.yaml", '    prefill_peers = ["bulkhead-prefill.bulkhead.svc.cluster.local:9090"]\n', "",
     "role decode needs prefill_peers and no transfer_listen"),
    ("policy.yaml", "    offline = \"serve-known\"", "    offline_mode = \"serve-known\"",
     "store.offline_mode: unknown field"),
    ("bulkhead-decode.yaml", """            - name: BULKHEAD_KEY_BETA
              valueFrom:
                secretKeyRef:
                  name: bulkhead-tenant-keys
                  key: BULKHEAD_KEY_BETA
""", "", "BULKHEAD_KEY_BETA does not come from a Secret"),
    ("bulkhead-prefill.yaml", "                    - key: tls.key\n                      path: transfer/key.pem\n", "",
     "the policy names /etc/bulkhead/transfer/key.pem, which no volume of the pod provides"),
    ("kustomization.yaml", "  - ext-authz.yaml\n", "", "ext-authz.yaml is not listed"),
    # The P/D configuration and the topology.
    ("kustomization.yaml", "  - bulkhead-decode.yaml\n", "  - bulkhead-decode.yaml\n  - bulkhead-both.yaml\n",
     "lists Bulkhead roles ['both', 'decode', 'prefill']"),
    ("epp.yaml", "--config-file=/config/epp-config.yaml", "--config-file=/config/epp-config-both.yaml",
     "data.epp-config-both.yaml schedules no prefill stage, but prefill and decode pods are listed"),
    ("epp-config.yaml", "            prefill: always-disagg-pd-decider", "            prefill: always-disagg-pd",
     "deciders.prefill: 'always-disagg-pd' names no plugin"),
    ("epp-config.yaml", "          deciders:", "          decider:",
     "parameters.decider: unknown field"),
    ("epp-config.yaml", "      - name: prefill\n        plugins:\n          - pluginRef: prefill-filter",
     "      - name: prefill\n        plugins:\n          - pluginRef: decode-filter",
     "profile 'prefill' has no prefill-filter"),
    ("bulkhead-prefill.yaml", "        llm-d.ai/engine-type: vllm\n", "",
     "Deployment/bulkhead-prefill: spec.template.metadata.labels: llm-d.ai/engine-type is not vllm"),
    ("policy.yaml", 'server_name = "bulkhead-prefill.bulkhead.svc.cluster.local"',
     'server_name = "bulkhead-prefill.bulkhead.svc"',
     "'bulkhead-prefill.bulkhead.svc' is not the prefill_peers host"),
    ("etcd.yaml", "      port: 2379\n      targetPort: client", "      port: 2379\n      targetPort: clients",
     "'clients' is no port of a pod it selects"),
]


def selftest(deploy, k8s_version):
    intact = validate(deploy, k8s_version, quiet=True)
    if intact.items:
        print("selftest: the intact deploy/ fails; run without --selftest first", file=sys.stderr)
        return 1
    bad = 0
    for file, old, new, expect in SELFTEST:
        with tempfile.TemporaryDirectory() as tmp:
            copy_dir = pathlib.Path(tmp) / "deploy"
            shutil.copytree(deploy, copy_dir)
            path = copy_dir / file
            text = path.read_text()
            if text.count(old) < 1:
                print(f"selftest: {file}: the text to break is gone: {old!r}", file=sys.stderr)
                bad += 1
                continue
            path.write_text(text.replace(old, new, 1))
            failures = validate(copy_dir, k8s_version, quiet=True)
            hit = [f for f in failures.items if expect in f]
            if hit:
                print(f"  refused as expected: {hit[0]}")
            else:
                bad += 1
                sys.stdout.flush()
                print(f"selftest: breaking {file} ({old.strip()[:40]!r} -> {new.strip()[:40]!r}) "
                      f"was not refused with {expect!r}; got: {failures.items or 'no failure'}",
                      file=sys.stderr)
    sys.stdout.flush()
    if bad:
        print(f"selftest: {bad} of {len(SELFTEST)} broken copies were not refused as expected", file=sys.stderr)
        return 1
    print(f"selftest: ok, the intact deploy/ passes and {len(SELFTEST)} broken copies are each refused")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deploy", type=pathlib.Path, default=ROOT / "deploy")
    parser.add_argument("--kubernetes-version", default="1.33")
    parser.add_argument("--bulkhead", help="a bulkhead binary: run `bulkhead check` on each policy")
    parser.add_argument("--models", default=str(ROOT / ".cache" / "models"),
                        help="where --bulkhead finds the policy's model files by name")
    parser.add_argument("--selftest", action="store_true")
    args = parser.parse_args()
    deploy = args.deploy.resolve()
    if args.selftest:
        return selftest(deploy, args.kubernetes_version)
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}"
                         for p in ("kubernetes-validate", "jsonschema", "PyYAML"))
    print(f"validate_deploy: {deploy.relative_to(ROOT) if deploy.is_relative_to(ROOT) else deploy}, "
          f"Kubernetes {args.kubernetes_version} ({versions})")
    failures = validate(deploy, args.kubernetes_version)
    if args.bulkhead:
        run_bulkhead_check(deploy, args.bulkhead, args.models, failures)
    sys.stdout.flush()
    for item in failures.items:
        print(item, file=sys.stderr)
    if failures.items:
        print(f"validate_deploy: {len(failures.items)} failures", file=sys.stderr)
        return 1
    print("validate_deploy: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
