#!/usr/bin/env python3
"""The official `openai` client against scd's HTTP API (actors/tests/integration/gateway.rs runs this).

    openai-check.py BASE_URL API_KEY MODEL [DOCUMENT_ID]

Prints one JSON object: the models listed, a streamed and a plain chat completion of the same
greedy request, a text completion, and the errors of bad requests as the client sees them.
"""
import json
import sys
import urllib.error
import urllib.request

import openai

base, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
document = sys.argv[4] if len(sys.argv) > 4 else None
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=300)
messages = [{"role": "user", "content": "Write one line about mail servers."}]
greedy = {"max_tokens": 12, "temperature": 0, "extra_body": {"scd_mode": "scd"}}
out = {"models": sorted(m.id for m in client.models.list().data)}

pieces, finish, roles = [], None, []
for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **greedy):
    choice = chunk.choices[0]
    if choice.delta.role:
        roles.append(choice.delta.role)
    if choice.delta.content:
        pieces.append(choice.delta.content)
    if choice.finish_reason:
        finish = choice.finish_reason
out["stream"] = {"pieces": pieces, "finish": finish, "roles": roles}

r = client.chat.completions.create(model=model, messages=messages, **greedy)
out["chat"] = {
    "text": r.choices[0].message.content,
    "finish": r.choices[0].finish_reason,
    "completion_tokens": r.usage.completion_tokens,
    "prompt_tokens": r.usage.prompt_tokens,
}

if document:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "When is the server down?"}],
        max_tokens=12,
        temperature=0,
        extra_body={"scd_documents": [document]},
    )
    out["documents"] = {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason}

c = client.completions.create(
    model=model, prompt="From: dana@lists.example.org\nSubject: Re:", max_tokens=8, temperature=0
)
out["completion"] = {"text": c.choices[0].text, "finish": c.choices[0].finish_reason}


def error(call):
    try:
        call()
    except openai.APIStatusError as e:
        return {"status": e.status_code, "body": e.body}
    return None


out["unknown_model"] = error(
    lambda: client.chat.completions.create(model="nope", messages=messages, max_tokens=4)
)
out["too_long"] = error(
    lambda: client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "word " * 9000}], max_tokens=4
    )
)


def raw(path, body=None, headers=None):
    """A request the client would not send; the status and JSON body of the answer."""
    req = urllib.request.Request(base + path, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return {"status": r.status, "body": json.load(r)}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": json.load(e)}


auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
out["bad_json"] = raw("/chat/completions", b"{not json", auth)
out["no_key"] = raw("/models")
print(json.dumps(out))
