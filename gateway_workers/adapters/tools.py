"""A request's tools, whatever dialect declared them: canonical function tools for the chat template, and the way
back from a call the model wrote to the call each dialect answers with.

Canonical tools are `{"type": "function", "function": {"name", "description"?, "parameters"?}}`, so one session
can mix dialects and still render the same prompt. Besides plain functions:
- a custom (freeform) tool is declared as a function with one string parameter, `input`, whose description tells
  its format (text, or a grammar: told, not enforced); a call of it comes back as a custom call with that input;
- the tools of a namespace (Responses) are declared as functions named `namespace__name`, and their calls come
  back under the namespace;
- a hosted tool (one the provider runs, or whose schema only the provider knows) cannot be called through the
  gateway: it is left out and noted in `ToolSet.hosted`, for the app to count or refuse (`--hosted-tools`).
Pure translation; must not import the app.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import orjson

from gateway_workers.adapters.common import bad, invalid_type, missing, wrong_value

NAMESPACE_SEPARATOR = "__"
CUSTOM_INPUT = "input"  # the one parameter a custom tool is declared with
# The tool names both APIs accept: OpenAI up to 64 characters, Anthropic up to 128 (`max_name`).
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]+")
MAX_FLAT_NAME = 128  # a namespace's tool, flattened: the two names and the separator
_NO_NAMESPACES: Mapping[str, tuple[str, str]] = MappingProxyType({})
_NO_NAMES: frozenset[str] = frozenset()


class ToolSet:
    """A request's tools: `tools` for the template (None: none), and what maps calls back to the wire.

    `custom`: canonical names of custom tools; `namespaced`: canonical name -> (namespace, name); `hosted`:
    (param, type) of each hosted tool left out; `ignored`: ignored fields seen on the definitions, by name.
    Built on every request: a plain slotted class, cheaper to make than a frozen dataclass.
    """

    __slots__ = ("tools", "custom", "namespaced", "hosted", "ignored")

    def __init__(self, tools: list[dict[str, Any]] | None = None, custom: frozenset[str] = frozenset(),
                 namespaced: Mapping[str, tuple[str, str]] = _NO_NAMESPACES, hosted: tuple[tuple[str, str], ...] = (),
                 ignored: frozenset[str] = frozenset()) -> None:
        self.tools, self.custom, self.namespaced, self.hosted, self.ignored = tools, custom, namespaced, hosted, ignored

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToolSet) and all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    def __hash__(self) -> int:  # equal sets declare the same hosted tools (a parsed request is a dataclass field)
        return hash(self.hosted)

    def __repr__(self) -> str:
        return f"ToolSet(tools={self.tools!r}, custom={self.custom!r}, hosted={self.hosted!r})"

    def wire_name(self, name: str) -> tuple[str | None, str]:
        """(namespace or None, name) of a call to the canonical tool `name`."""
        return self.namespaced.get(name, (None, name)) if self.namespaced else (None, name)


NO_TOOLS = ToolSet()


def tool_list(raw: Any) -> list[Any]:
    """A request's `tools`: an array, or none."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid_type("tools", "an array", raw)
    return raw


def custom_input(arguments: Any) -> str:
    """A custom tool's input from a call's canonical arguments: `{"input": text}` as the tool is declared; any other
    arguments the model wrote, as their JSON text."""
    if type(arguments) is dict and len(arguments) == 1 and type(arguments.get(CUSTOM_INPUT)) is str:
        return arguments[CUSTOM_INPUT]
    return arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()


def custom_arguments(text: Any, where: str, param: str) -> dict[str, Any]:
    """The canonical arguments of an echoed custom call's input."""
    if not isinstance(text, str):
        raise invalid_type(f"{where}.input", "a string", text, param)
    return {CUSTOM_INPUT: text}


def _custom_schema(fmt: Any, where: str, param: str) -> dict[str, Any]:
    """A custom tool's parameters: one string, `input`, described by the tool's format."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        told = "Freeform text."
    elif kind == "grammar":
        grammar = fmt.get("grammar") if isinstance(fmt.get("grammar"), dict) else fmt
        syntax, definition = grammar.get("syntax"), grammar.get("definition")
        if not isinstance(syntax, str) or not isinstance(definition, str):
            raise bad(f"{where}: a grammar format needs a string 'syntax' and 'definition'", param,
                      "missing_required_parameter")
        told = f"Text in this {syntax} grammar:\n{definition}"
    else:
        raise wrong_value(f"{where}.format.type", kind, ("text", "grammar"), param)
    return {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string", "description": told}},
            "required": [CUSTOM_INPUT]}


class ToolCollector:
    """Builds a request's `ToolSet` one declared tool at a time (each dialect reads its own shapes). What only
    some requests have (custom, namespaced or hosted tools, ignored fields) is made when first needed."""

    __slots__ = ("param", "max_name", "tools", "custom", "namespaced", "hosted", "ignored", "_names", "_mapped")

    def __init__(self, param: str = "tools", max_name: int = 64) -> None:
        self.param, self.max_name = param, max_name
        self.tools: list[dict[str, Any]] = []
        self.custom: set[str] | None = None
        self.namespaced: dict[str, tuple[str, str]] | None = None
        self.hosted: list[tuple[str, str]] | None = None
        self.ignored: set[str] | None = None
        self._names: set[str] | None = None  # every name, once a name must map back (unique among all)
        self._mapped: set[str] | None = None  # names a call must map back from

    def function(self, name: Any, description: Any, parameters: Any, where: str,
                 namespace: str | None = None) -> None:
        """One function tool; `parameters` an object schema, or None."""
        # the schema of a function's arguments: an object schema (as both APIs require)
        if parameters is not None and type(parameters) is not dict:
            raise invalid_type(f"{where}.parameters", "an object (a JSON schema)", parameters, self.param)
        if parameters is not None and parameters.get("type", "object") != "object":
            raise bad(f"{where}: the parameters schema must be an object schema (type 'object')", self.param,
                      "invalid_value")
        self._add(name, description, parameters, where, namespace)

    def custom_tool(self, name: Any, description: Any, fmt: Any, where: str, namespace: str | None = None) -> None:
        self._add(name, description, _custom_schema(fmt, where, self.param), where, namespace, custom=True)

    def hosted_tool(self, where: str, kind: str) -> None:
        if self.hosted is None:
            self.hosted = []
        self.hosted.append((where, kind))

    def notice(self, tool: Mapping[str, Any], ignored: frozenset[str], label: str = "tools") -> None:
        """Note the ignored fields a definition carries (counted by name in `/metrics`)."""
        if not ignored.isdisjoint(tool):
            if self.ignored is None:
                self.ignored = set()
            self.ignored.update(f"{label}.{key}" for key in tool if key in ignored)

    def result(self) -> ToolSet:
        if not self.tools and self.hosted is None and self.ignored is None:
            return NO_TOOLS
        return ToolSet(self.tools or None, frozenset(self.custom) if self.custom else _NO_NAMES,
                       self.namespaced or _NO_NAMESPACES, tuple(self.hosted) if self.hosted else (),
                       frozenset(self.ignored) if self.ignored else _NO_NAMES)

    def _add(self, name: Any, description: Any, parameters: Any, where: str, namespace: str | None,
             custom: bool = False) -> None:
        if not isinstance(name, str) or not name:
            if name == "":
                raise bad(f"Invalid '{where}.name': empty string.", self.param, "empty_string")
            raise missing(f"{where}.name", self.param) if name is None else invalid_type(
                f"{where}.name", "a string", name, self.param)
        if len(name) > self.max_name or not _TOOL_NAME.fullmatch(name):
            raise bad(f"{where}: the name {name[:self.max_name]!r} must be 1 to {self.max_name} of a-z, A-Z, 0-9, "
                      "'_' and '-'", self.param, "invalid_value")
        if description is not None and not isinstance(description, str):
            raise invalid_type(f"{where}.description", "a string", description, self.param)
        canonical = name if namespace is None else f"{namespace}{NAMESPACE_SEPARATOR}{name}"
        mapped = custom or namespace is not None
        if mapped or self._mapped is not None:
            self._unique(canonical, mapped, where)
        if custom:
            self.custom = self.custom or set()
            self.custom.add(canonical)
        if namespace is not None:
            self.namespaced = self.namespaced or {}
            self.namespaced[canonical] = (namespace, name)
        function: dict[str, Any] = {"name": canonical}
        if description is not None:
            function["description"] = description
        if parameters is not None:
            function["parameters"] = parameters
        self.tools.append({"type": "function", "function": function})

    def _unique(self, canonical: str, mapped: bool, where: str) -> None:
        """A name a call maps back from (a custom tool's, a namespace's) is the only tool of that name."""
        if len(canonical) > MAX_FLAT_NAME:
            raise bad(f"{where}: the namespace and tool name together are over {MAX_FLAT_NAME} characters",
                      self.param, "invalid_value")
        if self._names is None or self._mapped is None:
            self._names = {tool["function"]["name"] for tool in self.tools}
            self._mapped = set()
        if canonical in self._mapped or (mapped and canonical in self._names):
            raise bad(f"{where}: the tool name {canonical!r} is declared twice (a namespace's tools are named "
                      f"'namespace{NAMESPACE_SEPARATOR}name')", self.param, "invalid_value")
        self._names.add(canonical)
        if mapped:
            self._mapped.add(canonical)
