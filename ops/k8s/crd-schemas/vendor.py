#!/usr/bin/env python3
"""Write the OpenAPI v3 schema of each CRD given as one JSON file per served version, for
ops/validate-deploy.py to check the custom resources of ops/k8s with (kubernetes-validate knows
only the built-in kinds). Descriptions are dropped (they do not take part in validation).

    vendor.py CRD.yaml...

writes <group>_<version>_<kind lowercased>.json beside this script. The files here came from
prometheus-operator v0.93.0 (example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml)
and cert-manager v1.21.0-beta.0 (deploy/crds/cert-manager.io_{certificates,issuers}.yaml),
both Apache-2.0.
"""
import json
import pathlib
import sys

import yaml


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


here = pathlib.Path(__file__).parent
for path in sys.argv[1:]:
    crd = yaml.safe_load(pathlib.Path(path).read_text())
    spec = crd["spec"]
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        schema = strip(version["schema"]["openAPIV3Schema"])
        name = f"{spec['group']}_{version['name']}_{spec['names']['kind'].lower()}.json"
        (here / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
        print(name)
