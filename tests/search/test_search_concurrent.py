"""One Searcher, many threads, no lock: each thread's hits equal the serial query's, and
texts encoded together in one batch equal each text encoded alone by the model itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmalign.search.searcher import Searcher
from tests.harness.searchdata import save_random_model
from tests.harness.searchindex import unit_vectors, write_index_dir
from tests.harness.threads import run_threads

pytest.importorskip("faiss")

DIM = 32
TEXTS = [f"a photo of thing number {i} in {c}" for i, c in enumerate(["red", "blue", "green", "grey"] * 6)]


@pytest.fixture(scope="module")
def searcher(tmp_path_factory):
    root = tmp_path_factory.mktemp("concurrent")
    model = save_random_model(root / "model", seed=11, embed_dim=DIM)
    write_index_dir(
        root / "idx", unit_vectors(np.random.default_rng(0), 3000, DIM), 3, names=("image", "text")
    )
    s = Searcher(root / "idx", model)
    yield s
    s.close()


def test_concurrent_texts_equal_each_text_encoded_alone(searcher):
    model, tokenizer = searcher.source.model, searcher.source.tokenizer
    sizes = []
    forward = model.encode_text

    def counted(tokens):
        sizes.append(len(tokens))
        return forward(tokens)

    model.encode_text = counted  # records the batch sizes the worker used
    try:
        got = run_threads(lambda i: searcher.encode_text([TEXTS[i]])[0], len(TEXTS), together=True)
    finally:
        del model.encode_text
    with torch.no_grad():
        alone = [forward(tokenizer([t])).float().numpy()[0] for t in TEXTS]  # the model, one text per call
    assert sum(sizes) == len(TEXTS)
    for g, a in zip(got, alone):
        assert isinstance(g, np.ndarray), g
        np.testing.assert_allclose(g, a, atol=1e-5, rtol=0)


def test_many_threads_get_the_serial_hits(searcher):
    queries = [(TEXTS[i], 3 + i % 5, "image" if i % 3 else "text", i % 2 == 0) for i in range(len(TEXTS))]

    def ask(q):
        return searcher.text(q[0], k=q[1], against=q[2], dedupe=q[3])

    serial = [ask(q) for q in queries]
    for _ in range(3):
        parallel = run_threads(lambda i: ask(queries[i]), len(queries), together=True)
        for got, want in zip(parallel, serial):
            assert isinstance(got, list), got
            assert [h.row for h in got] == [h.row for h in want]
            np.testing.assert_allclose([h.score for h in got], [h.score for h in want], atol=1e-5)
            assert [h.url for h in got] == [h.url for h in want]


def test_concurrent_vector_searches_and_metadata(searcher):
    rng = np.random.default_rng(1)
    blocks = [unit_vectors(rng, 1 + i % 3, DIM) for i in range(16)]
    serial = [searcher.search_vectors(b, k=7) for b in blocks]
    parallel = run_threads(lambda i: searcher.search_vectors(blocks[i], k=7), len(blocks), together=True)
    assert [[[h.row for h in q] for q in hits] for hits in parallel] == [
        [[h.row for h in q] for q in hits] for hits in serial
    ]
    rows = run_threads(lambda i: searcher.metadata([i, 2999 - i]), 16, together=True)
    assert rows == [searcher.metadata([i, 2999 - i]) for i in range(16)]


def test_a_bad_query_fails_alone(searcher):
    def ask(i):
        if i == 0:
            return searcher.search_vectors(np.zeros((1, DIM + 1), np.float32), k=3)  # wrong dim
        return searcher.text(TEXTS[i], k=2)

    out = run_threads(ask, 8, together=True)
    assert "do not match the index dim" in str(out[0])
    assert all(isinstance(h, list) and len(h) == 2 for h in out[1:])
