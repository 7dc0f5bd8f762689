"""The manual's ``mmalign.load`` snippet (docs/search.md) runs without a torch warning (issue 39,
point 6): ``logit_scale`` is a plain float. Run with warnings as errors, as the page writes it."""

import warnings

from PIL import Image

from tests.harness.doc_snippets import snippet
from tests.harness.searchdata import save_random_model

PAGE = "docs/search.md"


def test_readme_snippet_prints_no_warning(tmp_path, capsys):
    code = snippet(PAGE, "tests/models/test_models_load_snippet.py::test_readme_snippet_prints_no_warning")
    assert code.startswith("import mmalign\nm = mmalign.load(") and "m.logit_scale" in code
    model = save_random_model(tmp_path / "model", seed=3)
    code = code.replace('"runs/quickstart"', repr(model))
    assert repr(model) in code
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        namespace = {"pil_image": Image.new("RGB", (40, 30), (200, 10, 10))}
        exec(compile(code, PAGE, "exec"), namespace)
        assert type(namespace["m"].logit_scale) is float
    assert "tensor(" in capsys.readouterr().out
