"""Models by name (:mod:`mmalign.models.hub`), offline, against a Hugging Face cache this file
fabricates: small random models saved in open_clip's hub layout, under an open_clip
``ARCH/TAG`` (a tiny architecture and tag registered in open_clip's own registries) and as a
transformers ``CLIPModel``. Each loads by its name (``--model`` through ``load()`` and
``model.pretrained`` through ``build_model``), and its image and text embeddings equal those of
the source library's own model loaded from the same cached files (open_clip's
``create_model_and_transforms(..., cache_dir=)``, transformers' ``CLIPModel.from_pretrained(...,
local_files_only=True)``) to 1e-5 relative. The mistakes are one line each."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mmalign.config import Config, ConfigError, ModelConfig, resolve, validate
from mmalign.errors import UsageError
from mmalign.models import build_model, check_buildable
from mmalign.models import hub as hub_mod
from mmalign.models.hub import parse
from mmalign.models.load import load
from tests.harness.hubcache import fabricate, offline_env

OC_CFG = {  # a tiny open_clip CLIP: the default BPE tokenizer, 77 tokens
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
CAPTIONS = ["a photo of a cat", "two dogs on a red sofa", "x"]
ARCH, TAG, TAG_REPO = "mmtest-ViT-tiny", "mmtest_s1", "test-org/tiny-tag"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _random_open_clip(seed: int):
    import open_clip

    torch.manual_seed(seed)
    model = open_clip.model.CLIP(**OC_CFG).eval()
    with torch.no_grad():  # off its init: a scale and embeddings that differ from a fresh model's
        model.logit_scale.fill_(2.7)
        model.positional_embedding.normal_(std=0.1)
    return model


def _save_open_clip(model, folder, weights: str = "open_clip_model.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if weights.endswith(".safetensors"):
        save_file(state, str(folder / weights))
    else:
        torch.save(state, folder / weights)
    return folder


def _tiny_clip_hf(seed: int, folder):
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config={
            "vocab_size": 49408,
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": 77,
            "eos_token_id": 49407,
        },
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=32,
    )
    CLIPModel(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The repositories' files: open_clip hub layout, a tag's weights file (.bin only), a
    CLIPModel, and one repository holding both layouts (different weights), as laion's do."""
    src = tmp_path_factory.mktemp("src")
    folder = _save_open_clip(_random_open_clip(1), src / "oc")
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": OC_CFG, "preprocess_cfg": {}}))
    _save_open_clip(_random_open_clip(2), src / "tag", "open_clip_pytorch_model.bin")
    _tiny_clip_hf(3, src / "hf")
    both = _tiny_clip_hf(4, src / "both")
    _save_open_clip(_random_open_clip(5), both)
    (both / "open_clip_config.json").write_text(json.dumps({"model_cfg": OC_CFG}))
    return {
        "test-org/tiny-oc": src / "oc",
        TAG_REPO: src / "tag",
        "test-org/tiny-clip": src / "hf",
        "test-org/both": both,
    }


@pytest.fixture(scope="module")
def hub(tmp_path_factory, sources):
    """HF_HOME holding the four repositories, as huggingface_hub caches them."""
    home = tmp_path_factory.mktemp("hf_home")
    for repo, folder in sources.items():
        fabricate(home, repo, folder)
    return home


@pytest.fixture
def offline(hub, monkeypatch, tmp_path):
    """The fabricated cache, offline for our resolver (environment, read at call time) and for
    the reference libraries (huggingface_hub read the environment at its import)."""
    import huggingface_hub.constants

    offline_env(monkeypatch, hub)
    monkeypatch.setenv("MMALIGN_CACHE", str(tmp_path / "views"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub / "hub"


@pytest.fixture
def tag_registered(monkeypatch):
    """ARCH/TAG in open_clip's own registries (the reference reads them), and in the ones our
    resolver reads (they are open_clip's files, which a test cannot add to)."""
    import copy

    import open_clip
    from open_clip import factory, pretrained

    monkeypatch.setitem(factory._MODEL_CONFIGS, ARCH, copy.deepcopy(OC_CFG))
    monkeypatch.setitem(pretrained._PRETRAINED, ARCH, {TAG: pretrained._pcfg(hf_hub=TAG_REPO + "/")})
    monkeypatch.setattr(hub_mod, "registry", lambda: pretrained._PRETRAINED)
    monkeypatch.setattr(hub_mod, "architectures", open_clip.list_models)
    monkeypatch.setattr(hub_mod, "model_config", lambda a: copy.deepcopy(factory._MODEL_CONFIGS.get(a)))


def _inputs():
    import open_clip

    g = torch.Generator().manual_seed(0)
    images = torch.randn(3, 3, 32, 32, generator=g)  # (B, 3, S, S)
    return images, open_clip.get_tokenizer("ViT-B-32")(CAPTIONS)  # (B, 77): the default BPE


def _ours(model_or_loaded, images, tokens):
    with torch.no_grad():
        return model_or_loaded.encode_image(images), model_or_loaded.encode_text(tokens)


def _theirs_open_clip(model, images, tokens):
    with torch.no_grad():
        return model.encode_image(images, normalize=True), model.encode_text(tokens, normalize=True)


def _theirs_hf(model, images, tokens):
    def features(out):  # transformers 5 returns a model output, 4 a tensor
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    with torch.no_grad():
        img = features(model.get_image_features(pixel_values=images))
        txt = features(model.get_text_features(input_ids=tokens))
    return torch.nn.functional.normalize(img, dim=-1), torch.nn.functional.normalize(txt, dim=-1)


def _assert_same(ours, theirs, scale_ours=None, scale_theirs=None):
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        assert rel(a, b) <= 1e-5
    if scale_ours is not None:
        assert abs(scale_ours - scale_theirs) <= 1e-5 * scale_theirs


def _pretrained(name: str):
    cfg = Config(model=ModelConfig(pretrained=name))
    resolve(cfg)  # no preset: the name carries the architecture
    validate(cfg)
    assert cfg.model.preset is None
    check_buildable(cfg.model)  # what training checks first: names and shapes on the meta device
    return build_model(cfg.model).eval()


# ---------------------------------------------------------------- the three forms load by name


def test_open_clip_hub_layout_by_name(offline):
    import open_clip

    images, tokens = _inputs()
    ref, _, _ = open_clip.create_model_and_transforms("hf-hub:test-org/tiny-oc", cache_dir=str(offline))
    theirs = _theirs_open_clip(ref.eval(), images, tokens)
    loaded = load("hf-hub:test-org/tiny-oc")
    _assert_same(
        _ours(loaded, images, tokens), theirs, loaded.logit_scale, float(ref.logit_scale.detach().exp())
    )
    assert torch.equal(loaded.tokenizer(CAPTIONS), tokens)  # open_clip's tokenizer for open_clip's model
    _assert_same(_ours(_pretrained("hf-hub:test-org/tiny-oc"), images, tokens), theirs)


def test_open_clip_arch_tag_by_name(offline, tag_registered):
    import open_clip

    images, tokens = _inputs()
    ref, _, _ = open_clip.create_model_and_transforms(ARCH, pretrained=TAG, cache_dir=str(offline))
    theirs = _theirs_open_clip(ref.eval(), images, tokens)
    name = f"{ARCH}/{TAG}"
    loaded = load(name)
    assert loaded.path.name == f"{ARCH}--{TAG}"  # a view: open_clip's config for ARCH, a link to the weights
    _assert_same(
        _ours(loaded, images, tokens), theirs, loaded.logit_scale, float(ref.logit_scale.detach().exp())
    )
    _assert_same(_ours(_pretrained(name), images, tokens), theirs)
    # open_clip's tag spelling rule: case and -/_ do not matter
    _assert_same(_ours(load(f"{ARCH}/MMTEST-s1"), images, tokens), theirs)


def test_transformers_clip_by_name(offline):
    from transformers import CLIPModel

    images, tokens = _inputs()
    ref = CLIPModel.from_pretrained(
        "test-org/tiny-clip", cache_dir=str(offline), local_files_only=True
    ).eval()
    theirs = _theirs_hf(ref, images, tokens)
    loaded = load("test-org/tiny-clip")
    _assert_same(
        _ours(loaded, images, tokens), theirs, loaded.logit_scale, float(ref.logit_scale.detach().exp())
    )
    _assert_same(_ours(_pretrained("test-org/tiny-clip"), images, tokens), theirs)


def test_a_repository_with_both_layouts_reads_the_one_its_name_means(offline):
    """laion's repositories ship open_clip's files and transformers' side by side: ORG/NAME is the
    transformers model, hf-hub:ORG/NAME the open_clip one (here their weights differ)."""
    import open_clip
    from transformers import CLIPModel

    images, tokens = _inputs()
    hf = CLIPModel.from_pretrained("test-org/both", cache_dir=str(offline), local_files_only=True).eval()
    oc, _, _ = open_clip.create_model_and_transforms("hf-hub:test-org/both", cache_dir=str(offline))
    _assert_same(_ours(load("test-org/both"), images, tokens), _theirs_hf(hf, images, tokens))
    _assert_same(
        _ours(load("hf-hub:test-org/both"), images, tokens), _theirs_open_clip(oc.eval(), images, tokens)
    )


def test_pretrained_image_and_text_take_one_tower_by_name(offline):
    from transformers import CLIPModel

    images, tokens = _inputs()
    ref = CLIPModel.from_pretrained(
        "test-org/tiny-clip", cache_dir=str(offline), local_files_only=True
    ).eval()
    theirs = _theirs_hf(ref, images, tokens)
    arch_src = load("test-org/tiny-clip").model.arch
    for key, index in (("pretrained_image", 0), ("pretrained_text", 1)):
        cfg = Config(model=ModelConfig(**{key: "test-org/tiny-clip"}))
        cfg.model.vision, cfg.model.text = dict(arch_src["vision_cfg"]), dict(arch_src["text_cfg"])
        cfg.model.embed_dim, cfg.model.quick_gelu = arch_src["embed_dim"], arch_src["quick_gelu"]
        resolve(cfg)
        validate(cfg)
        model = build_model(cfg.model).eval()
        assert rel(_ours(model, images, tokens)[index], theirs[index]) <= 1e-5


def test_ranks_resolving_one_name_at_once_agree(offline, monkeypatch, tmp_path):
    """A view is written on first resolution: ranks (here threads, released together) resolving a
    name at once into a fresh view folder all get the same complete view, none an error."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    for round_ in range(12):
        monkeypatch.setenv("MMALIGN_CACHE", str(tmp_path / f"views{round_}"))
        gate = threading.Barrier(6)

        def resolve(_):
            gate.wait()
            return hub_mod.resolve("test-org/both", "--model")

        with ThreadPoolExecutor(6) as pool:
            folders = list(pool.map(resolve, range(6)))
        assert len(set(folders)) == 1
        assert sorted(p.name for p in folders[0].iterdir()) == ["config.json", "model.safetensors"]


def test_a_local_path_wins_over_a_name(offline, tmp_path, monkeypatch):
    """A folder that happens to be spelled like ORG/NAME is read as the folder."""
    (tmp_path / "test-org").mkdir()
    monkeypatch.chdir(tmp_path)
    assert parse("test-org/tiny-clip") is None  # its first part is a folder here: a path
    assert hub_mod.resolve("test-org/tiny-clip", "--model").as_posix() == "test-org/tiny-clip"


def test_names_parse_to_their_forms():
    assert parse("ViT-B-32/laion2b_s34b_b79k").form == hub_mod.TAG
    assert (
        parse("hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K").repo == "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
    )
    assert parse("google/siglip-base-patch16-224").form == hub_mod.TRANSFORMERS
    for path in ("/abs/model", "./a/b", "a/b/c", "run", "a--b/c", "~/x/y", "C:\\x\\y"):
        assert parse(path) is None, path


# ---------------------------------------------------------------- one line for each mistake


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_an_unknown_tag_lists_the_architectures_tags(offline):
    with pytest.raises(UsageError) as e:
        load("ViT-B-32/no_such_tag")
    assert "no pretrained tag 'no_such_tag' for ViT-B-32" in _one_line(e) and "laion2b_s34b_b79k" in str(
        e.value
    )


def test_an_unknown_arch_reads_as_a_hub_id_and_names_the_close_architectures(offline):
    for typed, close in (("ViT-B-99", "ViT-B-32"), ("vit-b-32", "ViT-B-32")):
        with pytest.raises(UsageError) as e:
            load(f"{typed}/laion2b_s34b_b79k")
        assert f"no open_clip architecture is named {typed} (close: {close}" in _one_line(e)


def test_a_real_tag_not_cached_names_repo_cache_and_fetch_command(offline):
    with pytest.raises(ConfigError) as e:
        hub_mod.resolve("ViT-B-32/laion2b_s34b_b79k", "model.pretrained")
    line = _one_line(e)
    assert line.startswith("config key 'model.pretrained': ViT-B-32/laion2b_s34b_b79k")
    assert "laion/CLIP-ViT-B-32-laion2B-s34B-b79K" in line and str(offline) in line
    assert "mmalign models --fetch ViT-B-32/laion2b_s34b_b79k" in line


def test_an_id_not_cached_names_the_cache_and_says_it_is_no_path(offline):
    with pytest.raises(UsageError) as e:
        load("test-org/absent")
    line = _one_line(e)
    assert "no such local path" in line and str(offline) in line and "hf download test-org/absent" in line


def test_a_hub_id_of_another_class_names_it_and_the_supported_ones(offline, tmp_path):
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    (folder / "model.safetensors").write_bytes(b"")
    fabricate(offline.parent, "test-org/a-bert", folder)
    with pytest.raises(UsageError) as e:
        load("test-org/a-bert")
    line = _one_line(e)
    assert "is a BertModel" in line and all(c in line for c in ("CLIPModel", "SiglipModel", "Siglip2Model"))


@pytest.mark.parametrize("form", ["transformers", "open_clip"])
def test_a_cache_entry_without_weights(offline, tmp_path, form):
    folder = tmp_path / form
    folder.mkdir()
    if form == "transformers":
        (folder / "config.json").write_text(
            json.dumps({"model_type": "clip", "architectures": ["CLIPModel"]})
        )
        name = "test-org/no-weights"
    else:
        (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": OC_CFG}))
        name = "hf-hub:test-org/no-weights-oc"
    fabricate(offline.parent, name.removeprefix("hf-hub:"), folder)
    with pytest.raises(UsageError) as e:
        load(name)
    assert "holds no weights" in _one_line(e) and "--fetch" in str(e.value)


def test_names_are_accepted_by_the_config_and_refused_at_start_up_in_one_line(offline):
    cfg = Config(model=ModelConfig(pretrained="test-org/absent"))
    resolve(cfg)
    validate(cfg)  # spelled as a name: its existence is the resolver's
    with pytest.raises(ConfigError) as e:
        build_model(cfg.model)
    assert _one_line(e).startswith("config key 'model.pretrained': test-org/absent: no such local path")


# ---------------------------------------------------------------- online: downloaded once


def test_names_download_once_then_load_from_the_cache(sources, tag_registered, monkeypatch, tmp_path):
    """Online (a hub on 127.0.0.1), each form downloads its files once; a second resolution makes
    no request; the downloaded models equal open_clip's / transformers' models of the source files."""
    import huggingface_hub.constants
    import open_clip
    from transformers import CLIPModel

    from tests.harness.fake_hub import serve

    images, tokens = _inputs()
    with serve(sources) as server:
        offline_env(monkeypatch, tmp_path / "home")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(var)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("MMALIGN_CACHE", str(tmp_path / "views"))
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        names = ("test-org/tiny-clip", "hf-hub:test-org/tiny-oc", f"{ARCH}/{TAG}")
        folders = [hub_mod.resolve(n, "--model") for n in names]
        fetched = [path for method, path in server.requests if method == "GET"]
        assert sorted(fetched) == sorted(
            [
                "/test-org/tiny-clip/resolve/main/config.json",
                "/test-org/tiny-clip/resolve/main/model.safetensors",
                "/test-org/tiny-oc/resolve/main/open_clip_config.json",
                "/test-org/tiny-oc/resolve/main/open_clip_model.safetensors",
                f"/{TAG_REPO}/resolve/main/open_clip_pytorch_model.bin",  # after its .safetensors twin: absent
            ]
        )
        seen = len(server.requests)
        loaded = [load(n) for n in names]
        assert len(server.requests) == seen  # from the cache: not one request more
        assert [x.path for x in loaded] == folders
    hf = CLIPModel.from_pretrained(sources["test-org/tiny-clip"]).eval()
    oc, _, _ = open_clip.create_model_and_transforms(f"local-dir:{sources['test-org/tiny-oc']}")
    tag, _, _ = open_clip.create_model_and_transforms(
        ARCH, pretrained=str(sources[TAG_REPO] / "open_clip_pytorch_model.bin")
    )
    _assert_same(_ours(loaded[0], images, tokens), _theirs_hf(hf, images, tokens))
    _assert_same(_ours(loaded[1], images, tokens), _theirs_open_clip(oc.eval(), images, tokens))
    _assert_same(_ours(loaded[2], images, tokens), _theirs_open_clip(tag.eval(), images, tokens))


def test_an_unknown_repository_online_is_one_line(monkeypatch, tmp_path):
    import huggingface_hub.constants

    from tests.harness.fake_hub import serve

    with serve({}) as server:
        offline_env(monkeypatch, tmp_path / "home")
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.delenv("TRANSFORMERS_OFFLINE")
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        with pytest.raises(UsageError) as e:
            load("test-org/nope")
    assert "the hub has no repository test-org/nope" in _one_line(e)


# ---------------------------------------------------------------- a hub-named HF text tower


BERT_ARCH, BERT_TAG, BERT_REPO, BERT_TAG_REPO = (
    "mmtest-bert-ViT",
    "mmtest_b1",
    "test-org/tiny-bert",
    "test-org/bert-tag",
)


def test_an_arch_tag_with_a_hub_named_text_tower(monkeypatch, tmp_path):
    """open_clip's roberta / xlm-roberta / nllb architectures name their text model by hub id: it
    is read from the cache (here downloaded from a hub on 127.0.0.1 with the tag, then used
    offline), its weights coming from the tag's checkpoint; the embeddings equal open_clip's
    CustomTextCLIP built on the same files with that checkpoint."""
    import copy

    import huggingface_hub.constants
    import open_clip
    from open_clip import factory, pretrained

    from tests.harness.fake_hub import serve
    from tests.models.test_hf_text_tower import make_bert_folder

    bert = make_bert_folder(tmp_path / "bert", weights=True, seed=7)
    text_cfg = {"hf_model_name": BERT_REPO, "hf_tokenizer_name": BERT_REPO, "hf_pooler_type": "mean_pooler"}
    text_cfg["context_length"] = 12
    arch_cfg = {"embed_dim": 32, "vision_cfg": OC_CFG["vision_cfg"], "text_cfg": text_cfg}
    torch.manual_seed(8)
    source = open_clip.model.CustomTextCLIP(
        32,
        OC_CFG["vision_cfg"],
        {
            **text_cfg,
            "hf_model_name": str(bert),
            "hf_tokenizer_name": str(bert),
            "hf_model_pretrained": False,
        },
    )
    with torch.no_grad():
        for p in source.text.parameters():  # not BERT's own weights: the checkpoint's must be the ones read
            p.add_(torch.randn_like(p) * 0.05)
    ckpt = _save_open_clip(source, tmp_path / "tag", "open_clip_pytorch_model.bin")
    monkeypatch.setitem(factory._MODEL_CONFIGS, BERT_ARCH, copy.deepcopy(arch_cfg))
    monkeypatch.setitem(
        pretrained._PRETRAINED, BERT_ARCH, {BERT_TAG: pretrained._pcfg(hf_hub=BERT_TAG_REPO + "/")}
    )
    monkeypatch.setattr(hub_mod, "registry", lambda: pretrained._PRETRAINED)
    monkeypatch.setattr(hub_mod, "architectures", open_clip.list_models)
    monkeypatch.setattr(hub_mod, "model_config", lambda a: copy.deepcopy(factory._MODEL_CONFIGS.get(a)))
    name = f"{BERT_ARCH}/{BERT_TAG}"
    with serve({BERT_REPO: bert, BERT_TAG_REPO: ckpt}) as server:
        offline_env(monkeypatch, tmp_path / "home")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(var)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("MMALIGN_CACHE", str(tmp_path / "views"))
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        hub_mod.resolve(name, "--model")  # the tag's weights, and the text model's config and tokenizer
        got = {path for method, path in server.requests if method == "GET"}
    assert (
        f"/{BERT_REPO}/resolve/main/config.json" in got and f"/{BERT_REPO}/resolve/main/tokenizer.json" in got
    )
    assert (
        f"/{BERT_REPO}/resolve/main/model.safetensors" not in got
    )  # the checkpoint holds the tower's weights
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # from here on the cache alone
    loaded = load(name)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    captions = ["a red circle", "two blue squares on the left"]
    tokens = open_clip.tokenizer.HFTokenizer(str(bert), context_length=12)(captions)  # (B, 12)
    assert torch.equal(loaded.tokenizer(captions), tokens)
    _assert_same(_ours(loaded, images, tokens), _theirs_open_clip(source.eval(), images, tokens))
