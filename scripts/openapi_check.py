#!/usr/bin/env python3
"""Validates real responses of the admin API against its own OpenAPI document.

    python3 scripts/openapi_check.py SPEC.json SAMPLES.json

SAMPLES.json is a list of {"method", "path" (the document's template, e.g.
"/admin/v1/tenants/{tenant}"), "status", "body" (parsed JSON, or null)}. Each
sample must have a documented response for its status, and a JSON body must
validate against that response's schema (JSON Schema 2020-12, as OpenAPI 3.1
uses; `$ref`s resolve inside the document). Exits 1 listing every failure.
Needs the `jsonschema` package (scripts/requirements.txt).
"""

import json
import sys

import jsonschema


def main() -> int:
    spec_path, samples_path = sys.argv[1:3]
    with open(spec_path) as f:
        spec = json.load(f)
    with open(samples_path) as f:
        samples = json.load(f)
    if not spec.get("openapi", "").startswith("3.1"):
        print(f"not an OpenAPI 3.1 document: {spec.get('openapi')}")
        return 1
    failures = []
    checked = 0
    for sample in samples:
        where = f"{sample['method'].upper()} {sample['path']} -> {sample['status']}"
        operation = spec["paths"].get(sample["path"], {}).get(sample["method"].lower())
        if operation is None:
            failures.append(f"{where}: the document has no such operation")
            continue
        response = operation.get("responses", {}).get(str(sample["status"]))
        if response is None:
            failures.append(f"{where}: status not documented")
            continue
        content = response.get("content", {}).get("application/json")
        if content is None:
            if sample["body"] is not None:
                failures.append(f"{where}: a JSON body where none is documented")
            continue
        # The response schema, with the document's components beside it so
        # that "#/components/schemas/X" resolves.
        schema = dict(content["schema"])
        schema["components"] = spec.get("components", {})
        validator = jsonschema.Draft202012Validator(schema)
        errors = sorted(validator.iter_errors(sample["body"]), key=lambda e: e.path)
        for error in errors:
            failures.append(f"{where}: {list(error.path)}: {error.message}")
        checked += 1
    for failure in failures:
        print(failure)
    print(f"openapi_check: {checked} bodies validated, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
