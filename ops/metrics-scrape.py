#!/usr/bin/env python3
"""Scrape a node's /metrics and parse it with the official Prometheus client's OpenMetrics
parser (actors/tests/integration/gateway.rs runs this).

    metrics-scrape.py URL

Prints a JSON list of samples: [name, labels, value].
"""
import json
import sys
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families

with urllib.request.urlopen(sys.argv[1], timeout=60) as r:
    kind = r.headers.get("Content-Type", "")
    text = r.read().decode()
if not kind.startswith("application/openmetrics-text"):
    sys.exit(f"content type {kind!r} is not OpenMetrics")
samples = [
    [s.name, s.labels, s.value]
    for family in text_string_to_metric_families(text)
    for s in family.samples
]
print(json.dumps(samples))
