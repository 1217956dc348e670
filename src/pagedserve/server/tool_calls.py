"""Tool calling on /v1/chat/completions: the grammar for tool_choice, and parsing what the model wrote.

    tool_choice   decoding                                          the text becomes
    "none"        free                                              content
    "auto"        free (needs --enable-auto-tool-choice)            calls, read by --tool-call-parser
                                                                    (server/tool_parsers.py)
    "required"    JSON schema: [{"name": one of tools, "arguments": its parameters}, ...]   -> calls
    named         JSON schema: the function's parameters            -> one call (the text is its arguments)
"""
from __future__ import annotations

import json

from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.server.protocol import ChatCompletionRequest

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def tool_grammar(req: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The constraint that makes required / named tool choices produce valid calls; None for none / auto."""
    mode = req.tool_mode
    if mode in ("none", "auto"):
        return None
    if req.response_format is not None and req.response_format.type != "text" or req.structured_outputs:
        raise ValueError(f"tool_choice {mode!r} cannot be combined with response_format or structured_outputs")
    tools = {t.function.name: t.function.parameters or _EMPTY_PARAMETERS for t in req.tools or ()}
    if mode == "named":
        return StructuredOutputsParams(json=tools[req.tool_choice.function.name])
    defs: dict = {}
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _hoisted(name, params, defs)},
              "required": ["name", "arguments"]} for name, params in tools.items()]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": item, "minItems": 1}
    if defs:
        schema["$defs"] = defs
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def _hoisted(name: str, params: object, defs: dict) -> object:
    """params, moved under the combined schema's $defs when it uses $ref, so its references still resolve.

    A tool's "$ref": "#/$defs/X" means its own root; inside the array of calls the root is the array. So the
    tool's schema becomes $defs[name] (its own $defs / definitions become $defs["name.X"]) and every local
    reference is rewritten to match: "#" -> "#/$defs/name", "#/$defs/X/..." -> "#/$defs/name.X/...".
    """
    if not isinstance(params, dict) or '"$ref"' not in json.dumps(params):
        return params
    prefix = name.replace("~", "~0").replace("/", "~1")  # name as a JSON pointer token
    body = dict(params)
    own_defs = {**(body.pop("definitions", None) or {}), **(body.pop("$defs", None) or {})}

    def rewrite(node: object) -> object:
        if isinstance(node, list):
            return [rewrite(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            path = ref[1:]
            for section in ("/$defs/", "/definitions/"):
                if path.startswith(section):
                    out["$ref"] = f"#/$defs/{prefix}.{path[len(section):]}"
                    break
            else:
                out["$ref"] = f"#/$defs/{prefix}{path}"
        return out

    defs[name] = rewrite(body)
    for def_name, sub in own_defs.items():
        defs[f"{name}.{def_name}"] = rewrite(sub)
    return {"$ref": f"#/$defs/{prefix}"}
