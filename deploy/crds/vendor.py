#!/usr/bin/env python3
"""Re-vendors deploy/crds/ from git clones of the upstream repositories.

Not run by CI: scripts/validate_deploy.sh reads the files this writes. Run it
by hand when moving to a new upstream release, after changing the pins below
(and the manifests that name them):

    python3 deploy/crds/vendor.py \
        --gateway-api     ~/src/gateway-api \
        --gie             ~/src/gateway-api-inference-extension \
        --envoy-gateway   ~/src/envoy-gateway \
        --llm-d-router    ~/src/llm-d-router

Each argument is a clone (or bare mirror) that has the pinned tag. Every file
is read with `git show TAG:PATH`, so the clones' work trees are never used;
the tag must resolve to the commit pinned here, or nothing is written.

Writes, beside this script:
  - the CRDs (verbatim, with a two-line header naming their source);
  - llm-d-router-plugin-types.txt: every plugin type the llm-d router's
    endpoint picker registers at its tag (cmd/epp/runner/runner.go,
    registerInTreePlugins), each resolved from its Go constant;
  - llm-d-router-feature-gates.txt: the feature gates its config loader knows;
  - llm-d-router-config-fields.json: the JSON field names (and Go types) of
    the EndpointPickerConfig API's structs, and of the parameters of the
    plugins deploy/epp-config.yaml configures with parameters (the EPP
    decodes both strictly: an unknown field stops it).
"""

import argparse
import json
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent

# (repository, tag, commit, path in the repository, file written here)
CRDS = [
    ("kubernetes-sigs/gateway-api", "v1.6.1", "8bb74df00e56ec8f944d48c25e6c1c9c2f6848e3",
     "config/crd/standard/gateway.networking.k8s.io_gatewayclasses.yaml",
     "gateway.networking.k8s.io_gatewayclasses.yaml"),
    ("kubernetes-sigs/gateway-api", "v1.6.1", "8bb74df00e56ec8f944d48c25e6c1c9c2f6848e3",
     "config/crd/standard/gateway.networking.k8s.io_gateways.yaml",
     "gateway.networking.k8s.io_gateways.yaml"),
    ("kubernetes-sigs/gateway-api", "v1.6.1", "8bb74df00e56ec8f944d48c25e6c1c9c2f6848e3",
     "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml",
     "gateway.networking.k8s.io_httproutes.yaml"),
    ("kubernetes-sigs/gateway-api-inference-extension", "v1.6.0",
     "992e5c292afb248801ce8d9234eb5b9d28eea231",
     "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",
     "inference.networking.k8s.io_inferencepools.yaml"),
    ("envoyproxy/gateway", "v1.9.0", "39763b1c07ec30a5526fe70434a2cfe4181de642",
     "charts/gateway-helm/charts/crds/crds/generated/gateway.envoyproxy.io_securitypolicies.yaml",
     "gateway.envoyproxy.io_securitypolicies.yaml"),
]

ROUTER = ("llm-d/llm-d-router", "v0.10.0", "71f4f0999f95b96c49a9d0c4afbd18dfdb943c26")
ROUTER_MODULE = "github.com/llm-d/llm-d-router/"
RUNNER = "cmd/epp/runner/runner.go"
CONFIG_TYPES = "apix/config/v1alpha1/endpointpickerconfig_types.go"
# plugin type -> (file, the struct its factory decodes `parameters` into)
PLUGIN_PARAMETERS = {
    "metrics-data-source": (
        "pkg/epp/framework/plugins/datalayer/source/metrics/datasource.go",
        "metricsDatasourceParams"),
    "core-metrics-extractor": (
        "pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go",
        "modelServerExtractorParams"),
    # The nested (current) format its config parser tries first, strictly.
    "disagg-profile-handler": (
        "pkg/epp/framework/plugins/scheduling/profilehandler/disagg/disagg_profile_handler.go",
        "DisaggProfileHandlerParameters"),
}


def git(repo_dir, *args):
    return subprocess.run(["git", "-C", str(repo_dir), *args], check=True,
                          capture_output=True, text=True).stdout


def checked_commit(repo_dir, tag, commit):
    got = git(repo_dir, "rev-parse", f"{tag}^{{commit}}").strip()
    if got != commit:
        sys.exit(f"{repo_dir}: {tag} is {got}, pinned {commit}: update the pin on purpose")


def vendor_crds(dirs):
    for repo, tag, commit, path, out in CRDS:
        repo_dir = dirs[repo]
        checked_commit(repo_dir, tag, commit)
        text = git(repo_dir, "show", f"{tag}:{path}")
        header = (f"# Vendored from github.com/{repo} {tag} ({commit}), {path}.\n"
                  f"# Do not edit: deploy/crds/vendor.py rewrites it.\n")
        (HERE / out).write_text(header + text)
        print(f"wrote {out}")


def go_files(repo_dir, tag, package_dir):
    names = git(repo_dir, "ls-tree", "--name-only", f"{tag}:{package_dir}").split()
    return [f"{package_dir}/{n}" for n in names
            if n.endswith(".go") and not n.endswith("_test.go")]


def resolve_const(repo_dir, tag, package_dir, ident, imports, depth=0):
    """The string value of Go constant `ident` in `package_dir`."""
    pattern = re.compile(r"\b" + re.escape(ident) + r"\b(?:\s+\w+)?\s*=\s*(\"[^\"]*\"|[\w.]+)")
    for path in go_files(repo_dir, tag, package_dir):
        source = git(repo_dir, "show", f"{tag}:{path}")
        for match in pattern.finditer(source):
            value = match.group(1)
            if value.startswith('"'):
                return value.strip('"')
            if depth < 3:
                if "." in value:
                    alias, name = value.split(".", 1)
                    file_imports = go_imports(source)
                    if alias in file_imports:
                        return resolve_const(repo_dir, tag, file_imports[alias], name,
                                             imports, depth + 1)
                else:
                    return resolve_const(repo_dir, tag, package_dir, value, imports, depth + 1)
    raise SystemExit(f"cannot resolve {package_dir}.{ident}")


def go_imports(source):
    imports = {}
    for alias, path in re.findall(r'^\s*(\w+)?\s*"(github\.com/llm-d/llm-d-router/[^"]+)"',
                                  source, re.M):
        rel = path[len(ROUTER_MODULE):]
        imports[alias or rel.rsplit("/", 1)[-1]] = rel
    return imports


def vendor_router(repo_dir):
    repo, tag, commit = ROUTER
    checked_commit(repo_dir, tag, commit)
    source = git(repo_dir, "show", f"{tag}:{RUNNER}")
    body = source[source.index("func (r *Runner) registerInTreePlugins()"):]
    body = body[:body.index("\n}\n")]
    imports = go_imports(source)
    types = {}
    for call, alias, ident in re.findall(
            r"fwkplugin\.(Register\w*)\(\s*(\w+)\.(\w+)\s*,", body):
        value = resolve_const(repo_dir, tag, imports[alias], ident, imports)
        deprecated = call.startswith("RegisterDeprecated")
        types[value] = types.get(value, False) or deprecated
    lines = [f"# Plugin types the llm-d router's endpoint picker registers:",
             f"# github.com/{repo} {tag} ({commit}),",
             f"# {RUNNER}, func registerInTreePlugins, each Register*(pkg.Const, ...)",
             f"# resolved to the constant's string. '(deprecated)' marks RegisterDeprecated*.",
             f"# Do not edit: deploy/crds/vendor.py rewrites it."]
    for value in sorted(types):
        lines.append(value + (" (deprecated)" if types[value] else ""))
    (HERE / "llm-d-router-plugin-types.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote llm-d-router-plugin-types.txt ({len(types)} types)")

    gates = []
    for ident in re.findall(r"loader\.RegisterFeatureGate\(\s*(\w+\.\w+)", source):
        alias, name = ident.split(".", 1)
        gates.append(resolve_const(repo_dir, tag, imports[alias], name, imports))
    lines = [f"# Feature gates the llm-d router's config loader accepts:",
             f"# github.com/{repo} {tag} ({commit}), {RUNNER}, loader.RegisterFeatureGate(...).",
             f"# Do not edit: deploy/crds/vendor.py rewrites it."]
    (HERE / "llm-d-router-feature-gates.txt").write_text("\n".join(lines + sorted(gates)) + "\n")
    print(f"wrote llm-d-router-feature-gates.txt ({len(gates)} gates)")


def go_structs(source):
    """{struct name: {json field: Go type}} of every struct in `source`;
    an inline embedded type is listed under the field name "<inline>"."""
    structs = {}
    for name, body in re.findall(r"^\s*(?:type\s+)?(\w+)\s+struct\s*{(.*?)^\s*}", source, re.M | re.S):
        fields = {}
        for line in body.splitlines():
            line = line.split("//", 1)[0].strip()
            m = re.match(r"^(?:(\w+)\s+)?([\w.*\[\]]+)\s+`json:\"([^\"]*)\"", line)
            if not m:
                continue
            json_name = m.group(3).split(",")[0]
            fields[json_name or "<inline>"] = m.group(2)
        structs[name] = fields
    return structs


def go_named_types(source):
    """{name: underlying type} of `type Name string|int|bool` declarations."""
    return dict(re.findall(r"^type\s+(\w+)\s+(string|int|bool|float64)\s*$", source, re.M))


def vendor_config_fields(repo_dir):
    repo, tag, commit = ROUTER
    api = go_structs(git(repo_dir, "show", f"{tag}:{CONFIG_TYPES}"))
    parameters = {}
    for plugin, (path, struct) in PLUGIN_PARAMETERS.items():
        source = git(repo_dir, "show", f"{tag}:{path}")
        structs = go_structs(source)
        if struct not in structs:
            sys.exit(f"{path}: no struct {struct}")
        parameters[plugin] = {"root": struct, "structs": structs, "types": go_named_types(source),
                              "source": path}
    out = {
        "source": f"github.com/{repo} {tag} ({commit})",
        "api": {"root": "EndpointPickerConfig", "structs": api, "source": CONFIG_TYPES},
        "parameters": parameters,
        "note": "Do not edit: deploy/crds/vendor.py rewrites it.",
    }
    (HERE / "llm-d-router-config-fields.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print("wrote llm-d-router-config-fields.json")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway-api", required=True, type=pathlib.Path)
    parser.add_argument("--gie", required=True, type=pathlib.Path)
    parser.add_argument("--envoy-gateway", required=True, type=pathlib.Path)
    parser.add_argument("--llm-d-router", required=True, type=pathlib.Path)
    args = parser.parse_args()
    dirs = {
        "kubernetes-sigs/gateway-api": args.gateway_api,
        "kubernetes-sigs/gateway-api-inference-extension": args.gie,
        "envoyproxy/gateway": args.envoy_gateway,
    }
    vendor_crds(dirs)
    vendor_router(args.llm_d_router)
    vendor_config_fields(args.llm_d_router)


if __name__ == "__main__":
    main()
