"""Checks on client JSON Schemas (response_format, tool parameters) that need no model: what the
grammar compiler would accept but could never generate, refused here with the schema's `param`.

    check_schema(schema, "tools[0].function.parameters")

- `x-guidance` (the grammar options) must be an object;
- a local `$ref` ("#", "#/$defs/x") must point at something in the schema;
- no schema may reach itself through `$ref`, `allOf`, `anyOf` or `oneOf` alone, with no JSON
  value in between ({"$ref": "#"}, or definitions referring to each other): such a rule never
  produces a token, and a constraint built from it fails in the middle of generation.
  Recursion through a property or an item (a tree, a linked list) is fine.
"""
from urllib.parse import unquote

from .checks import fail

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "dependentSchemas")
_MISSING = object()


def check_schema(schema, param):
    """Refuses (400 naming `param`) the schemas described in the module docstring."""
    options = schema.get("x-guidance", {})
    if not isinstance(options, dict):
        fail(param, f"'{param}.x-guidance' must be an object of grammar options.")
    nodes = _reachable(schema, param)
    stuck = _ungrounded(nodes)
    if stuck is not None:
        fail(param, f"'{param}' refers to itself through $ref at '{stuck[:200]}' with no value in between, "
                    f"so no JSON can satisfy it.")


def _reachable(root, param):
    """{id(node): (node, pointer, $ref target or None)} for every subschema reached from the root,
    local $refs followed."""
    nodes, stack = {}, [(root, "#")]
    while stack:
        node, pointer = stack.pop()
        if not isinstance(node, dict) or id(node) in nodes:
            continue
        target = _ref_target(node, root, param)
        nodes[id(node)] = (node, pointer, target)
        if target is not None:
            stack.append((target, node["$ref"]))
        stack.extend(_children(node, pointer))
    return nodes


def _children(node, pointer):
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield node[key], f"{pointer}/{key}"
    for key in _LIST:
        if isinstance(node.get(key), list):
            yield from ((s, f"{pointer}/{key}/{i}") for i, s in enumerate(node[key]))
    for key in _MAP:
        if isinstance(node.get(key), dict):
            yield from ((s, f"{pointer}/{key}/{name}") for name, s in node[key].items())


def _ref_target(node, root, param):
    """The subschema a local "$ref" names; None without one (or for a non-local ref, which the
    compiler refuses itself)."""
    ref = node.get("$ref")
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    target = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict):
            target = target.get(part, _MISSING)
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            target = _MISSING
        if target is _MISSING:
            fail(param, f"'{param}' has a $ref to '{ref[:200]}', which the schema does not define.")
    return target


def _edges(node, target):
    """(must, either): the subschemas a node is made of with no JSON in between: all of `must`
    ($ref, allOf), and one of `either` (anyOf, oneOf) when there are any."""
    must = [target] if isinstance(target, dict) else []
    must += _schemas(node.get("allOf"))
    either = _schemas(node.get("anyOf")) + _schemas(node.get("oneOf"))
    return [id(s) for s in must], [id(s) for s in either]


def _schemas(value):
    return [s for s in value if isinstance(s, dict)] if isinstance(value, list) else []


def _ungrounded(nodes):
    """The pointer of a node that can never be finished without passing through itself, or None.

    A node is grounded when all of its `must` parts are and, if it has `either` parts, one of
    them is: found by propagating from the nodes with no parts (a worklist, linear in the size)."""
    need, parents, ready = {}, {}, []
    for key, (node, _, target) in nodes.items():
        must, either = _edges(node, target)
        need[key] = len(must) + (1 if either else 0)
        for child in must:
            parents.setdefault(child, []).append((key, False))
        for child in either:
            parents.setdefault(child, []).append((key, True))
        if need[key] == 0:
            ready.append(key)
    grounded, either_met = set(ready), set()
    while ready:
        child = ready.pop()
        for parent, is_either in parents.get(child, ()):
            if is_either:
                if parent in either_met:
                    continue
                either_met.add(parent)
            need[parent] -= 1
            if need[parent] == 0:
                grounded.add(parent)
                ready.append(parent)
    stuck = [pointer for key, (_, pointer, _) in nodes.items() if key not in grounded]
    return min(stuck, key=len) if stuck else None
