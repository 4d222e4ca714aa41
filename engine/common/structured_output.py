"""What a request's output must follow: a JSON schema, a regex, a choice of strings or a grammar.
Fronts check it when a request arrives; the core compiles it (engine/worker/grammar.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from baton.engine.common.errors import InvalidArgument, check

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
FIELD = "structured_output"


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One constraint: `kind` one of KINDS; `spec` its text (a JSON schema, a regex, an EBNF
    grammar in xgrammar's GBNF dialect, "" for json_object) or, for choice, the strings."""
    kind: str
    spec: str | tuple[str, ...] = ""

    def __post_init__(self):
        check(self.kind in KINDS, FIELD, f"must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            object.__setattr__(self, "spec", tuple(self.spec))
            check(self.spec and all(isinstance(c, str) and c for c in self.spec), f"{FIELD}.choice",
                  "must be a non-empty list of non-empty strings")
        elif self.kind != "json_object":
            check(isinstance(self.spec, str) and self.spec.strip(), f"{FIELD}.{self.kind}", "must not be empty")
        if self.kind == "json_schema":
            try:
                check(isinstance(json.loads(self.spec), dict), f"{FIELD}.json_schema", "must be a JSON object")
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"{FIELD}.json_schema", f"is not JSON: {e}") from None
