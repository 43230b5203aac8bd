"""Checks on client JSON Schemas (response_format, tool parameters) that need no model: what the
grammar compiler would accept but could never generate, refused here with the schema's `param`.

    check_schema(schema, "tools[0].function.parameters")

- `x-guidance` (the grammar options) must be an object;
- a local `$ref` ("#", "#/$defs/x") must point at something in the schema;
- a path from the root through subschemas and $refs may be at most MAX_DEPTH long, and at most
  MAX_MERGED_PATTERNS `pattern`s may meet under allOf (both bound the compiler's stack and time);
- no schema may require itself with no way to end: through `$ref`, `allOf`, `anyOf`/`oneOf`
  (every branch), required properties or the items of a non-empty array ({"$ref": "#"},
  definitions referring to each other, an object whose required property is itself). No finite
  JSON value matches such a schema, and a constraint built from it fails in the middle of
  generation. Recursion through an optional property or item (a tree, a linked list) is fine;
- no `maximum` or `exclusiveMaximum` may be at or below -2**63 (MIN_INT_BOUND) as a double.
"""
from urllib.parse import unquote

from .checks import fail

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "dependentSchemas")
_MISSING = object()
# NOTE(stack): the grammar compiler recurses along a schema's $ref chains and overflows the native
# stack (a crash of the whole process) somewhere past 1,500 levels; real schemas need a few dozen.
MAX_DEPTH = 128
# NOTE(compile-time): where schemas are merged (allOf, $ref with siblings), the compiler intersects
# their `pattern`s, and its time doubles with each one past ~15 (20: seconds; 24: minutes), all on
# the compute thread. Counted over everything under a merge, which is generous.
MAX_MERGED_PATTERNS = 8
# NOTE(int-bound): the grammar compiler reads an integer's bounds as 64-bit integers, saturating;
# an upper bound that lands on -2**63 sends its range-to-regex step into endless recursion, and the
# stack overflow kills the process with every stream on it ({"type": "integer", "minimum": -1e308,
# "maximum": -1e308}; every llguidance from 1.0.0 to 1.9.1, whatever the thread's stack size).
# Checked on every subschema, typed or not: allOf and $ref carry a bound to an integer elsewhere.
MIN_INT_BOUND = -2 ** 63
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum")
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
                "$id", "$schema", "$anchor", "x-guidance"}


def check_schema(schema, param):
    """Refuses (400 naming `param`) the schemas described in the module docstring."""
    options = schema.get("x-guidance", {})
    if not isinstance(options, dict):
        fail(param, f"'{param}.x-guidance' must be an object of grammar options.")
    nodes = _reachable(schema, param)
    depth = _depth(nodes, schema)
    if depth > MAX_DEPTH:
        fail(param, f"'{param}' nests {depth} schemas deep through $ref; the limit is {MAX_DEPTH}.")
    merged = _merged_patterns(nodes)
    if merged > MAX_MERGED_PATTERNS:
        fail(param, f"'{param}' intersects {merged} 'pattern's through allOf or $ref siblings; the limit is "
                    f"{MAX_MERGED_PATTERNS}.")
    for node, pointer, _, _ in nodes.values():
        for key in _UPPER_BOUNDS:
            bound = node.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and _double(bound) <= MIN_INT_BOUND:
                fail(param, f"'{param}' has '{key}' {_double(bound):g} at '{pointer[:200]}'; an upper bound must be above "
                            f"{MIN_INT_BOUND}.")
    stuck = _ungrounded(nodes)
    if stuck is not None:
        fail(param, f"'{param}' can never be satisfied: through $ref, '{stuck[:200]}' requires itself "
                    f"with no way to end, so no finite JSON value matches it.")


def _double(number):
    """The number as the compiler reads it: a double (-2**63 + 1 is -2**63 there)."""
    try:
        return float(number)
    except OverflowError:
        return float("-inf") if number < 0 else float("inf")


def _reachable(root, param):
    """{id(node): (node, pointer, $ref target or None, [child ids])} for every subschema reached
    from the root, local $refs followed (the target is a child too)."""
    nodes, stack = {}, [(root, "#")]
    while stack:
        node, pointer = stack.pop()
        if not isinstance(node, dict) or id(node) in nodes:
            continue
        target = _ref_target(node, root, param)
        children = list(_children(node, pointer)) + ([(target, node["$ref"])] if target is not None else [])
        nodes[id(node)] = (node, pointer, target, [id(c) for c, _ in children if isinstance(c, dict)])
        stack.extend(children)
    return nodes


def _depth(nodes, root):
    """The most subschemas on one path from the root, $refs followed, recursion not unrolled
    (a depth-first walk that ignores edges back into the path)."""
    depth, state, stack = {}, {}, [(id(root), 0)]
    while stack:
        key, i = stack.pop()
        state[key] = "open"
        kids = nodes[key][3]
        if i < len(kids):
            stack.append((key, i + 1))
            if kids[i] not in state:
                stack.append((kids[i], 0))
            continue
        depth[key] = 1 + max((depth[k] for k in kids if k in depth), default=0)
    return depth[id(root)]


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


def _merged_patterns(nodes):
    """How many subschemas with a `pattern` lie under a merge: an allOf of two or more, or an
    allOf or $ref with sibling keywords (annotations aside). One walk over the graph."""
    seen, stack = set(), [key for key, (node, *_) in nodes.items() if _merges(node)]
    while stack:
        key = stack.pop()
        if key not in seen:
            seen.add(key)
            stack.extend(nodes[key][3])
    return sum(1 for key in seen if "pattern" in nodes[key][0])


def _merges(node):
    parts = _schemas(node.get("allOf")) + ([node["$ref"]] if "$ref" in node else [])
    own = set(node) - _ANNOTATIONS - {"allOf", "$ref", "$defs", "definitions"}
    return len(parts) > 1 or (len(parts) == 1 and bool(own))


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
    """(must, either): the subschemas every value of a node holds: all of `must` ($ref, allOf,
    required properties, the items of a non-empty array), and one of `either` (anyOf, oneOf)
    when there are any."""
    must = [target] if isinstance(target, dict) else []
    must += _schemas(node.get("allOf")) + _required(node) + _first_items(node)
    either = _schemas(node.get("anyOf")) + _schemas(node.get("oneOf"))
    return [id(s) for s in must], [id(s) for s in either]


def _required(node):
    props, required = node.get("properties"), node.get("required")
    if not isinstance(props, dict) or not isinstance(required, list):
        return []
    return [props[k] for k in required if isinstance(k, str) and isinstance(props.get(k), dict)]


def _first_items(node):
    least = node.get("minItems")
    if not isinstance(least, int) or isinstance(least, bool) or least < 1:
        return []
    prefix = _schemas(node.get("prefixItems"))[:least]
    items = node.get("items")
    rest = [items] if isinstance(items, dict) and least > len(prefix) else []
    return prefix + rest


def _schemas(value):
    return [s for s in value if isinstance(s, dict)] if isinstance(value, list) else []


def _ungrounded(nodes):
    """The pointer of a node that no finite value satisfies, or None.

    A node is grounded when all of its `must` parts are and, if it has `either` parts, one of
    them is: found by propagating from the nodes with no parts (a worklist, linear in the size)."""
    need, parents, ready = {}, {}, []
    for key, (node, _, target, _) in nodes.items():
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
    stuck = [pointer for key, (_, pointer, _, _) in nodes.items() if key not in grounded]
    return min(stuck, key=len) if stuck else None
