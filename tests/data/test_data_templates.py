"""Prompt templates: ``{c}`` is the only field; ``{x}``, ``{}``, a lone brace or a blank line is
one line naming the file (a suite, a template set) and the template, never a traceback later."""

from __future__ import annotations

import pytest

from mmalign.data.templates import check_templates, template_problem
from mmalign.errors import UsageError

CASES = [
    "a photo of a {c}.",
    "{c}",
    "{{literal}} {c}",
    "no field",
    "{x}",
    "{}",
    "{0}",
    "a { b",
    "a } b",
    "{c!r}",
    "{c:>99999}",
    "{c.upper}",
    "{c[0]}",
    "",
    "   ",
    "{c} and {d}",
    "{{}}",
]


def _reference_ok(template: str) -> bool:
    """Naive: not blank, formats with c alone, and every field left after the literal braces is {c}."""
    if not template.strip():
        return False
    try:
        template.format(c="X")
    except (KeyError, IndexError, ValueError, AttributeError, TypeError):
        return False
    bare = template.replace("{{", "").replace("}}", "")
    return bare.count("{") == bare.count("{c}") and bare.count("}") == bare.count("{c}")


@pytest.mark.parametrize("template", CASES)
def test_template_problem_equals_the_naive_reference(template):
    assert (template_problem(template) is None) == _reference_ok(template), template_problem(template)


def test_check_templates_is_one_line_naming_the_place_and_the_template():
    check_templates(["a {c}.", "the {c}"], "x")
    for bad, words in [
        ("{x}", "field {x}"),
        ("{}", "field {}"),
        ("a {", "does not format"),
        ("", "is blank"),
    ]:
        with pytest.raises(UsageError) as e:
            check_templates(["a {c}.", bad], "suite s.yaml")
        message = str(e.value)
        assert message.startswith("suite s.yaml: template 2 ") and words in message and "\n" not in message


@pytest.mark.parametrize("bad", ["{x} of {c}", "a {}", "a lone { and {c}", ""])
def test_a_suite_file_with_a_bad_template_is_one_line(tmp_path, bad):
    import yaml

    from mmalign.evaluation.suite import load_suite

    suite = {
        "name": "s",
        "dataset": "x/{0..1}.tar",
        "tasks": [
            {
                "name": "zs",
                "type": "zeroshot",
                "label_field": "classname",
                "classnames": ["a", "b"],
                "templates": ["a photo of a {c}.", bad],
            }
        ],
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    with pytest.raises(UsageError) as e:
        load_suite(str(path))
    message = str(e.value)
    assert str(path) in message and f"template 2 {bad!r}" in message and "\n" not in message
    suite["tasks"][0]["templates"] = ["a photo of a {c}."]
    suite["dataset"] = {"type": "digits", "caption_templates": ["ok {c}", bad]}
    path.write_text(yaml.safe_dump(suite))
    with pytest.raises(UsageError, match="caption_templates'?: template 2"):
        load_suite(str(path))


def test_a_template_set_with_a_bad_template_is_one_line(tmp_path):
    from data_pipelines.sources import load_templates

    path = tmp_path / "set.yaml"
    path.write_text("templates: ['a {c}.', 'a {c} {x}']\n")
    with pytest.raises(UsageError) as e:
        load_templates(str(path))
    assert str(path) in str(e.value) and "template 2 'a {c} {x}' has the field {x}" in str(e.value)


def test_zero_shot_prompts_refuse_a_bad_template_in_one_line():
    from mmalign.evaluation.zeroshot import prompt_texts

    assert prompt_texts(["cat", "dog"], ["a {c}.", "{{x}} {c}"]) == ["a cat.", "{x} cat", "a dog.", "{x} dog"]
    with pytest.raises(UsageError, match=r"^zero-shot templates: template 1 '\{\}' has the field \{\}"):
        prompt_texts(["cat"], ["{}"])
