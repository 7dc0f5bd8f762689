"""Run an evaluation suite from ``eval/`` on a model and write clip_benchmark-style JSON.

A suite YAML names a dataset (WebDataset shards whose ``.json`` carries the label
fields) and a list of tasks (``zeroshot`` with class names and templates, or
``retrieval`` with ks).  Embeddings are computed once per suite and shared by its
tasks.  All features are the L2-normalised joint-space embeddings, i.e. after the
projection heads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import yaml

from mmalign.config import ConfigError
from mmalign.data.shards import check_urls, expand_urls, read_samples
from mmalign.evaluation.retrieval import recall_at_k
from mmalign.evaluation.zeroshot import build_classifier, zero_shot_metrics

EVAL_DIR = Path(__file__).resolve().parents[2] / "eval"


def load_suite(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if not path.is_file():
        path = EVAL_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in EVAL_DIR.glob("*.yaml"))
        raise ConfigError(f"config key 'eval.suite': unknown suite {name_or_path!r} (known: {', '.join(known)})")
    suite = yaml.safe_load(path.read_text())
    for task in suite.get("tasks", []):
        if task.get("type") not in ("zeroshot", "retrieval"):
            raise ConfigError(f"suite {path}: task {task.get('name')!r} has unknown type {task.get('type')!r}")
    return suite


@torch.no_grad()
def embed_dataset(model, preprocess, tokenizer, urls: list[str], batch_size: int = 256, device: str = "cpu") -> dict:
    """Images and every caption of the shards -> normalised embeddings and metadata."""
    images, captions, text_to_image, metas, keys = [], [], [], [], []
    image_feats = []
    for i, sample in enumerate(read_samples(urls)):
        images.append(preprocess(sample["image"]))
        keys.append(sample["key"])
        metas.append(sample["json"])
        for caption in sample["captions"]:
            captions.append(caption)
            text_to_image.append(i)
        if len(images) == batch_size:
            image_feats.append(model.encode_image(torch.stack(images).to(device)).float().cpu())
            images = []
    if images:
        image_feats.append(model.encode_image(torch.stack(images).to(device)).float().cpu())
    if not image_feats:
        raise ConfigError(f"evaluation data {urls[0]} holds no readable samples")
    text_feats = [
        model.encode_text(tokenizer(captions[s : s + batch_size]).to(device)).float().cpu()
        for s in range(0, len(captions), batch_size)
    ]
    return {
        "image_features": torch.cat(image_feats),  # (N, D)
        "text_features": torch.cat(text_feats),  # (M, D)
        "text_to_image": torch.tensor(text_to_image),  # (M,)
        "metas": metas,
        "keys": keys,
    }


def run_suite(model, preprocess, tokenizer, suite: dict, data: str | None = None, *, batch_size: int = 256,
              device: str = "cpu", model_name: str = "mmalign") -> list[dict]:
    """Evaluate every task of ``suite``; one clip_benchmark-style record per task."""
    spec = data or suite["dataset"]
    urls = expand_urls(spec)
    check_urls(urls, "data.val")
    was_training = model.training
    model.eval()
    try:
        emb = embed_dataset(model, preprocess, tokenizer, urls, batch_size, device)
        records = []
        for task in suite["tasks"]:
            if task["type"] == "zeroshot":
                field = task["label_field"]
                names = task["classnames"]
                index = {n: i for i, n in enumerate(names)}
                labels = torch.tensor([index[m[field]] for m in emb["metas"]])
                encode = lambda tokens: model.encode_text(tokens.to(device)).float().cpu()  # noqa: E731
                classifier = build_classifier(encode, tokenizer, names, task["templates"])
                metrics = zero_shot_metrics(emb["image_features"], classifier, labels)
                metrics["chance_acc1"] = 1.0 / len(names)
                kind = "zeroshot_classification"
            else:
                metrics = recall_at_k(emb["image_features"], emb["text_features"], emb["text_to_image"],
                                      ks=task.get("ks", [1, 5, 10]))
                kind = "zeroshot_retrieval"
            records.append({
                "dataset": f"{suite['name']}/{task['name']}",
                "model": model_name,
                "pretrained": None,
                "task": kind,
                "metrics": {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()},
                "language": "en",
                "n_images": len(emb["keys"]),
                "n_captions": len(emb["text_to_image"]),
            })
        return records
    finally:
        model.train(was_training)


def write_results(records: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2))
    return path


def summary_rows(records: list[dict]) -> list[tuple[str, str, float]]:
    """(task, metric, value) rows for the headline numbers."""
    rows = []
    for r in records:
        m = r["metrics"]
        if r["task"] == "zeroshot_classification":
            rows.append((r["dataset"], "acc1", m["acc1"]))
            rows.append((r["dataset"], "chance", m["chance_acc1"]))
        else:
            for k in (1, 5):
                rows.append((r["dataset"], f"text->image R@{k}", m.get(f"image_retrieval_recall@{k}")))
                rows.append((r["dataset"], f"image->text R@{k}", m.get(f"text_retrieval_recall@{k}")))
            rows.append((r["dataset"], "chance R@5", 5 / r["n_images"]))
    return rows
