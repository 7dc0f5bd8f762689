"""Mined hard negatives end to end: the offline mining step (against a brute-force float64
reference), the rewritten shards (byte-identical apart from the added field), the loader's
``neg_tokens`` / ``neg_mask``, the config guards and a short training run."""

from __future__ import annotations

import json
import math
import tarfile

import numpy as np
import pytest
import torch

from data_pipelines.mine import mine, normalise_caption
from mmalign.cli import main
from mmalign.config import ConfigError, ModelConfig, load_config
from mmalign.data.shards import decode_sample, iter_tar_groups
from tests.data.test_data_loader import jpeg, loader_for, take, write_shard

K = 3


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    """A random micro model saved like a run's final/ (the mining step only needs some scorer)."""
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models import build_model
    from mmalign.models.io import save_pretrained
    from tests.harness import pick_seed

    torch.manual_seed(pick_seed(33))
    model = build_model(ModelConfig(preset="micro"))
    out = tmp_path_factory.mktemp("scorer") / "final"
    save_pretrained(model, out, preprocess=preprocess_cfg(model.image_size))
    return out


@pytest.fixture(scope="module")
def corpus(shapes_dir, micro_model):
    """Every train sample with the scorer's float64 embeddings: the brute-force reference's input."""
    import mmalign

    loaded = mmalign.load(micro_model)
    loaded.model.eval()
    samples = [
        decode_sample(raw)
        for url in sorted((shapes_dir / "train").glob("*.tar"))
        for raw in iter_tar_groups(str(url))
    ]
    images = torch.stack([loaded.preprocess(s["image"].convert("RGB")) for s in samples])
    img = loaded.encode_image(images).double().numpy()
    captions = [c for s in samples for c in s["captions"]]
    cap = loaded.encode_text(captions).double().numpy()
    owner = [i for i, s in enumerate(samples) for _ in s["captions"]]
    return {"samples": samples, "img": img, "cap": cap, "captions": captions, "owner": owner}


def reference(corpus, i, k, max_similarity=None, id_field=None, max_relative=None):
    """Image i's negatives by brute force: every caption, best first, explicit exclusion rules."""
    s = corpus["samples"]
    own = {normalise_caption(c) for c in s[i]["captions"]}
    positive = max(
        float(corpus["img"][i] @ corpus["cap"][r])
        for r in range(len(corpus["captions"]))
        if corpus["owner"][r] == i
    )
    cands = sorted(
        ((float(corpus["img"][i] @ corpus["cap"][r]), r) for r in range(len(corpus["captions"]))),
        reverse=True,
    )
    kept, seen = [], set()
    for sim, r in cands:
        j, text = corpus["owner"][r], normalise_caption(corpus["captions"][r])
        if j == i or text in own or text in seen:
            continue
        if id_field is not None and s[j]["json"].get(id_field) == s[i]["json"].get(id_field):
            continue
        seen.add(text)
        if max_similarity is not None and sim > max_similarity:
            continue
        if max_relative is not None and sim > max_relative * positive:
            continue
        kept.append((sim, corpus["captions"][r]))
        if len(kept) == k:
            break
    return kept


def members(path):
    with tarfile.open(path) as tar:
        return [(m.name, m.mode, m.mtime, tar.extractfile(m).read()) for m in tar if m.isreg()]


def check_against_reference(corpus, out, k, **rules):
    """Each mined sample's negatives equal the reference's (up to float32 near-ties at the cut)."""
    mined = {}
    for url in sorted(out.glob("*.tar")):
        for raw in iter_tar_groups(str(url)):
            mined[raw["__key__"]] = json.loads(raw["json"])["hard_negatives"]
    assert len(mined) == len(corpus["samples"])
    for i, sample in enumerate(corpus["samples"]):
        got, want = mined[sample["key"]], reference(corpus, i, k, **rules)
        assert len(got) == len(want) <= k  # fewer only when the rules leave fewer in the whole corpus
        sims = [n["similarity"] for n in got]
        assert sims == sorted(sims, reverse=True)
        np.testing.assert_allclose(sims, [w[0] for w in want], atol=2e-5)
        for n, (sim, caption) in zip(got, want):
            assert n["caption"] == caption or abs(n["similarity"] - sim) < 2e-5  # a tie may swap order
            assert normalise_caption(n["caption"]) not in {normalise_caption(c) for c in sample["captions"]}
            if rules.get("max_similarity") is not None:
                assert n["similarity"] <= rules["max_similarity"]
    return mined


@pytest.fixture(scope="module")
def mined_dir(shapes_dir, micro_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("mined") / "train"
    stats = mine(str(shapes_dir / "train"), micro_model, out, k=K, progress=False)
    return out, stats


def test_mined_negatives_match_brute_force_and_shards_are_otherwise_unchanged(shapes_dir, mined_dir, corpus):
    out, stats = mined_dir
    mined = check_against_reference(corpus, out, K)
    assert all(len(n) == K for n in mined.values())
    assert stats["mined_samples"] == len(corpus["samples"]) == 400
    assert stats["negatives_written"] == 400 * K and stats["samples_with_fewer_than_k"] == 0
    assert json.loads((out / "mine.json").read_text()) == stats
    for src in sorted((shapes_dir / "train").glob("*.tar")):
        before, after = members(src), members(out / src.name)
        assert [m[:3] for m in before] == [m[:3] for m in after]  # same members, order, mode, mtime
        for (name, _, _, a), (_, _, _, b) in zip(before, after):
            if name.endswith(".json"):
                meta = json.loads(b)
                assert len(meta.pop("hard_negatives")) == K
                assert meta == json.loads(a)
            else:
                assert a == b, name
        assert (out / src.with_suffix(".parquet").name).is_file()
    assert json.loads((out / "sizes.json").read_text()) == json.loads(
        (shapes_dir / "train" / "sizes.json").read_text()
    )


def test_similarity_threshold_filters_suspected_false_negatives(
    shapes_dir, micro_model, mined_dir, corpus, tmp_path
):
    _, first = mined_dir
    # a threshold inside the range of what the unfiltered pass kept, so it must bind
    threshold = round(first["negative_similarity"]["mean"], 4)
    stats = mine(
        str(shapes_dir / "train"), micro_model, tmp_path / "t", k=K, max_similarity=threshold, progress=False
    )
    check_against_reference(corpus, tmp_path / "t", K, max_similarity=threshold)
    assert stats["filtered_false_negatives"] == stats["filtered_absolute"] > 0
    assert stats["samples_with_filtered"] > 0 and stats["negative_similarity"]["max"] <= threshold


def test_relative_threshold_searches_deeper_for_images_that_need_it(
    shapes_dir, micro_model, corpus, tmp_path, monkeypatch
):
    import faiss

    widths = []
    real = faiss.IndexFlatIP.search
    monkeypatch.setattr(faiss.IndexFlatIP, "search", lambda self, x, w: widths.append(w) or real(self, x, w))
    # "not above the image's own caption": with a random scorer most nearest captions are above it
    stats = mine(
        str(shapes_dir / "train"), micro_model, tmp_path / "r", k=K, max_relative=1.0, progress=False
    )
    mined = check_against_reference(corpus, tmp_path / "r", K, max_relative=1.0)
    assert stats["filtered_relative"] > 0 and len(widths) > 1 and widths == sorted(widths)
    assert stats["negatives_written"] == sum(len(n) for n in mined.values())


def test_id_field_makes_same_id_samples_positives(shapes_dir, micro_model, corpus, tmp_path):
    stats = mine(
        f"{shapes_dir}/train/{{00000..00001}}.tar",
        micro_model,
        tmp_path / "ids",
        k=2,
        id_field="shape",
        progress=False,
    )
    mined = check_against_reference(corpus, tmp_path / "ids", 2, id_field="shape")
    shape_of = {s["key"]: s["json"]["shape"] for s in corpus["samples"]}
    for key, negatives in mined.items():
        assert all(shape_of[n["key"]] != shape_of[key] for n in negatives)
    assert stats["excluded_same_id"] > 0


def test_positives_duplicates_unreadable_samples_and_a_missing_json(micro_model, tmp_path):
    captions = ["a red circle", "A  red circle", "broken", "a blue square", "a green star"]
    samples = [(f"0000000{i}", {"jpg": jpeg((16, 16)), "txt": c.encode()}) for i, c in enumerate(captions)]
    samples[2] = ("00000002", {"jpg": b"not a jpeg", "txt": b"broken", "json": b"{}"})
    (tmp_path / "in").mkdir()
    write_shard(tmp_path / "in" / "00000.tar", samples)
    stats = mine(str(tmp_path / "in"), micro_model, tmp_path / "out", k=3, progress=False)
    assert stats["unreadable_copied_unchanged"] == {"corrupt_image": 1} and stats["json_added"] == 4
    assert stats["excluded_same_caption"] == 2  # 0 and 1 carry the same caption up to case and spaces
    groups = list(iter_tar_groups(str(tmp_path / "out" / "00000.tar")))
    assert [g["__key__"] for g in groups] == [k for k, _ in samples]
    assert groups[2]["json"] == b"{}" and groups[2]["jpg"] == b"not a jpeg"  # copied unchanged
    got = {
        g["__key__"]: {n["caption"] for n in json.loads(g["json"])["hard_negatives"]}
        for g in groups[:2] + groups[3:]
    }
    assert got["00000000"] == got["00000001"] == {"a blue square", "a green star"}  # not its positive
    # one slot per caption text: the two red circles count once
    assert len(got["00000003"]) == len(got["00000004"]) == 2
    assert "a blue square" in got["00000004"] and "a green star" in got["00000003"]
    assert stats["samples_with_fewer_than_k"] == 4 and stats["negatives_written"] == 8


def test_cli_mines_and_reports_mistakes_in_one_line(shapes_dir, micro_model, tmp_path, capsys):
    spec = f"{shapes_dir}/val/00000.tar"
    assert (
        main(
            [
                "mine",
                "--data",
                spec,
                "--model",
                str(micro_model),
                "--out",
                str(tmp_path / "m"),
                "-k",
                "2",
                "--max-similarity",
                "0.99",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "negatives for 120 samples" in capsys.readouterr().out
    for bad, msg in (
        (["-k", "0"], "-k"),
        (["--out", str(shapes_dir / "val")], "--out"),
        (["--out", str(tmp_path / "m")], "already holds"),
        (["--max-similarity", "2"], "cosine"),
    ):
        args = {"--data": spec, "--model": str(micro_model), "--out": str(tmp_path / "x"), "-k": "2"}
        args.update(dict(zip(bad[::2], bad[1::2])))
        assert main(["mine", *[x for kv in args.items() for x in kv], "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0]


# ------------------------------------------------------------------------- loader


def test_loader_emits_negative_tokens_and_masks(mined_dir, shapes_dir, tmp_path):
    out, _ = mined_dir
    loader = loader_for(f"{out}/{{00000..00001}}.tar", mode="epoch", workers=0, batch=6, hard_negatives=2)
    batch = next(iter(loader))
    assert batch.neg_tokens.shape == (6, 2, 12) and batch.neg_mask.all()
    by_key = {
        raw["__key__"]: json.loads(raw["json"])["hard_negatives"]
        for url in sorted(out.glob("*.tar"))
        for raw in iter_tar_groups(str(url))
    }
    from tests.data.test_data_loader import TOKENIZER

    for key, tokens in zip(batch.keys, batch.neg_tokens):
        want = TOKENIZER([n["caption"] for n in by_key[key][:2]])
        assert torch.equal(tokens, want)
    # unmined shards: every slot masked, nothing skipped
    plain = next(
        iter(loader_for(f"{shapes_dir}/train/00000.tar", mode="epoch", workers=0, batch=4, hard_negatives=2))
    )
    assert plain.neg_tokens.shape == (4, 2, 12) and not plain.neg_mask.any() and plain.skipped == {}


def test_loader_pads_short_lists_and_skips_malformed_ones(tmp_path):
    metas = [
        {"hard_negatives": [{"caption": "a"}, {"caption": "b"}, {"caption": "c"}]},
        {"hard_negatives": ["only one"]},
        {"hard_negatives": []},
        {"hard_negatives": "oops"},
        {"hard_negatives": [{"similarity": 0.3}]},
        {},
    ]
    samples = [
        (f"0000000{i}", {"jpg": jpeg(), "txt": b"x", "json": json.dumps(m).encode()})
        for i, m in enumerate(metas)
    ]
    write_shard(tmp_path / "00000.tar", samples)
    # one lane (a global batch of 1), no shuffling: the samples in write order
    batches = take(
        loader_for(f"{tmp_path}/00000.tar", mode="epoch", workers=0, batch=1, buffer=1, hard_negatives=2), 4
    )
    assert [b.keys[0] for b in batches] == ["00000000", "00000001", "00000002", "00000005"]
    assert [b.neg_mask.tolist()[0] for b in batches] == [
        [True, True],
        [True, False],
        [False, False],
        [False, False],
    ]
    assert batches[-1].skipped == {"bad_hard_negatives": 2}


# ------------------------------------------------------------------------- config and training


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data.hard_negatives=-1"], "data.hard_negatives"),
        (["data.hard_negatives=2", "loss.name=siglip", "model.init_logit_bias=-10"], "data.hard_negatives"),
        (["data.hard_negatives=2", "loss.hard_negative_beta=0.5"], "data.hard_negatives"),
        (["data.hard_negatives=2", "loss.debias_prior=0.1"], "data.hard_negatives"),
        (["data.hard_negatives=2", "loss.queue_size=64"], "data.hard_negatives"),
    ],
)
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_short_training_run_on_mined_shards(mined_dir, micro_overrides):
    from mmalign.run.train import train

    out, _ = mined_dir
    overrides = [o for o in micro_overrides if not o.startswith("data.train=")]
    cfg = load_config(
        None,
        overrides
        + [
            f"data.train={out}/{{00000..00001}}.tar",
            "data.hard_negatives=2",
            "train.steps=8",
            "train.grad_cache_chunk_size=12",
        ],
    )
    run = train(cfg, show_progress=False)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:
        assert r["mined_neg_valid"] == 1.0 and 0.0 < r["mined_neg_prob"] < 1.0 and math.isfinite(r["loss"])
    assert (run / "final" / "model.safetensors").is_file()


def test_the_miner_and_the_loss_share_one_caption_rule():
    """A caption counts as a sample's own (never mined as its negative) by the rule that makes
    the loss's ``caption`` positives: one definition, in mmalign.losses.positives."""
    import data_pipelines.mine as miner
    from mmalign.losses.positives import caption_ids, normalise_caption

    assert miner.normalise_caption is normalise_caption
    variants = ["A  red\tcircle.", "a red circle.", " A RED CIRCLE. "]
    assert {normalise_caption(v) for v in variants} == {"a red circle."}  # case and whitespace only
    assert len(set(caption_ids(variants).tolist())) == 1
