"""Prompt templates: ``"a photo of a {c}."``, formatted with ``str.format(c=classname)``.

``{c}`` is the only field (``{{`` and ``}}`` are literal braces). A template with another
field (``{x}``, ``{}``, ``{0}``), a conversion or format spec (``{c!r}``, ``{c:>9}``), or an
unmatched brace would raise inside ``format`` long after the file was read; blank lines are
not templates (each would be the same empty prompt for every class, and still score).
:func:`check_templates` says which, in one line naming the file, before anything runs.
"""

from __future__ import annotations

import string

from mmalign.errors import UsageError


def template_problem(template) -> str | None:
    """Why ``template`` is not a prompt template, or None."""
    if not isinstance(template, str):
        return f"is not text ({type(template).__name__})"
    if not template.strip():
        return "is blank"
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as e:  # a lone "{" or "}"
        return f"does not format ({e}; write {{{{ or }}}} for a literal brace)"
    for _literal, name, spec, conversion in fields:
        if name is None:
            continue
        if name != "c" or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            return f"has the field {shown}; {{c}} (the class name) is the only one"
    return None


def check_templates(templates, where: str, unit: str = "template") -> None:
    """A one-line UsageError naming ``where`` (a file, a key) and the first bad template, or nothing;
    ``unit``: what the position counts (``line`` for a file of one template a line)."""
    if not isinstance(templates, (list, tuple)) or not templates:
        raise UsageError(f"{where}: no templates (a list of prompts with {{c}})")
    for i, template in enumerate(templates):
        why = template_problem(template)
        if why is not None:
            raise UsageError(f"{where}: {unit} {i + 1} {str(template)[:80]!r} {why}")
