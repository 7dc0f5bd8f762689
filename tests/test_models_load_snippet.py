"""The README's Python snippet runs without a torch warning (issue 39, point 6): ``logit_scale``
is a plain float. Run with warnings as errors, as the README writes it."""

import re
import warnings
from pathlib import Path

from PIL import Image

from tests.searchdata import save_random_model

ROOT = Path(__file__).resolve().parents[1]


def test_readme_snippet_prints_no_warning(tmp_path, capsys):
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(import mmalign\nm = mmalign\.load.*?)```", readme, re.S).group(1)
    assert "m.logit_scale" in snippet
    model = save_random_model(tmp_path / "model", seed=3)
    code = snippet.replace('"runs/quickstart"', repr(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        namespace = {"pil_image": Image.new("RGB", (40, 30), (200, 10, 10))}
        exec(compile(code, "README.md", "exec"), namespace)
        assert type(namespace["m"].logit_scale) is float
    assert "tensor(" in capsys.readouterr().out
