"""DataComp's evaluation tasks and main metrics, as data, and the main metrics that need predictions.

The list follows DataComp's ``tasklist.yml`` (github.com/mlfoundations/datacomp): each task's
key, display name and ``main_metric`` (``acc1`` where the file names none).  DataComp's
average is the plain mean of the main metric over the tasks that have one (``evaluate.py``
skips a ``None``): FairFace and UTKFace report only group accuracies, so 38 tasks count.

Where each task's data comes from here, and what that changes:

- Classification tasks read clip_benchmark's WebDataset copy, the one DataComp's
  ``download_evalsets.py`` fetches (``wds_<key, / as ->_test``, the ``fairness/`` prefix
  dropped), as folder ``wds_<name>``, ``wds_<name>_test`` or ``<name>`` under ``--root``.
- ``retrieval/flickr30k`` and ``retrieval/mscoco_2014_5k_test_image_text_retrieval``:
  DataComp reads Hugging Face's ``nlphuji/...`` copies, which are not in clip_benchmark's
  layout; here they are clip_benchmark's ``wds_flickr30k`` and ``wds_mscoco_captions``,
  whose image sets may differ (nlphuji's Flickr "test" split holds all 31,014 images), so
  each row says so.  The main metric ``mean_recall@1`` is the mean of the two Recall@1.
- ``misc/winogavil`` (Jaccard scores over candidate sets, from ``nlphuji/winogavil``) has no
  clip_benchmark form: always listed as unsupported, so a DataComp average here is partial.
- Main metrics from predictions, as DataComp's WILDS / fairness evaluators compute them:
  ``F1-macro_all`` (iWildCam): sklearn's macro F1 over the labels present in the data;
  ``acc_worst_region`` (FMoW), ``acc_wg`` (GeoDE), ``acc_top5_wg`` (Dollar Street): the
  lowest top-1 (top-5) accuracy over the groups named by the first entry of each sample's
  ``.npy`` vector (region, region, income group), every group with a sample counting
  (DataComp's evaluators keep no group names, so none is dropped).  Without ``.npy`` the
  row reports ``acc1`` (``acc5``) and says so.
"""

from __future__ import annotations

import torch

from mmalign.extras import extra

# (DataComp task key, name, main metric); None: DataComp scores no main metric
TASKS = (
    ("vtab/caltech101", "Caltech-101", "mean_per_class_recall"),
    ("cifar10", "CIFAR-10", "acc1"),
    ("vtab/cifar100", "CIFAR-100", "acc1"),
    ("vtab/clevr_count_all", "CLEVR Counts", "acc1"),
    ("vtab/clevr_closest_object_distance", "CLEVR Distance", "acc1"),
    ("country211", "Country211", "acc1"),
    ("vtab/dtd", "Describable Textures", "acc1"),
    ("vtab/eurosat", "EuroSAT", "acc1"),
    ("fgvc_aircraft", "FGVC Aircraft", "mean_per_class_recall"),
    ("food101", "Food-101", "acc1"),
    ("gtsrb", "GTSRB", "acc1"),
    ("imagenet1k", "ImageNet 1k", "acc1"),
    ("imagenet_sketch", "ImageNet Sketch", "acc1"),
    ("imagenetv2", "ImageNet v2", "acc1"),
    ("imagenet-a", "ImageNet-A", "acc1"),
    ("imagenet-o", "ImageNet-O", "acc1"),
    ("imagenet-r", "ImageNet-R", "acc1"),
    ("vtab/kitti_closest_vehicle_distance", "KITTI Vehicle Distance", "acc1"),
    ("mnist", "MNIST", "acc1"),
    ("objectnet", "ObjectNet", "acc1"),
    ("vtab/flowers", "Oxford Flowers-102", "mean_per_class_recall"),
    ("vtab/pets", "Oxford-IIIT Pet", "mean_per_class_recall"),
    ("voc2007", "Pascal VOC 2007", "acc1"),
    ("vtab/pcam", "PatchCamelyon", "acc1"),
    ("renderedsst2", "Rendered SST2", "acc1"),
    ("vtab/resisc45", "RESISC45", "acc1"),
    ("cars", "Stanford Cars", "acc1"),
    ("stl10", "STL-10", "acc1"),
    ("sun397", "SUN397", "acc1"),
    ("vtab/svhn", "SVHN", "acc1"),
    ("retrieval/flickr30k", "Flickr", "mean_recall@1"),
    ("retrieval/mscoco_2014_5k_test_image_text_retrieval", "MSCOCO", "mean_recall@1"),
    ("misc/winogavil", "WinoGAViL", "jaccard_score_10-12"),
    ("wilds/iwildcam", "iWildCam", "F1-macro_all"),
    ("wilds/camelyon17", "Camelyon17", "acc1"),
    ("wilds/fmow", "FMoW", "acc_worst_region"),
    ("fairness/dollar_street", "Dollar Street", "acc_top5_wg"),
    ("fairness/geode", "GeoDE", "acc_wg"),
    ("fairness/fairface", "FairFace", None),
    ("fairness/utkface", "UTKFace", None),
)

# retrieval tasks: clip_benchmark's dataset standing in for DataComp's Hugging Face source
RETRIEVAL = {
    "retrieval/flickr30k": ("flickr30k", "nlphuji/flickr30k, all 31,014 images"),
    "retrieval/mscoco_2014_5k_test_image_text_retrieval": (
        "mscoco_captions",
        "nlphuji/mscoco_2014_5k_test_image_text_retrieval",
    ),
}
UNSUPPORTED = {"misc/winogavil": "read from Hugging Face (nlphuji/winogavil), no clip_benchmark dataset"}
NOT_SCORED = {"fairness/fairface", "fairness/utkface"}  # DataComp's average leaves them out

# main metrics computed from the logits, and what a row reports when the groups are missing
GROUP_METRICS = {"acc_worst_region": ("acc1", 1), "acc_wg": ("acc1", 1), "acc_top5_wg": ("acc5", 5)}
PREDICTION_METRICS = {"F1-macro_all", *GROUP_METRICS}


def cb_name(key: str) -> str:
    """The clip_benchmark dataset DataComp reads for ``key`` (without ``wds/``)."""
    if key in RETRIEVAL:
        return RETRIEVAL[key][0]
    return key[len("fairness/") :] if key.startswith("fairness/") else key


def folders(key: str) -> list[str]:
    """Folder names (relative to ``--root``) that may hold ``key``'s dataset, in the order tried."""
    name = cb_name(key)
    dashed = name.replace("/", "-")
    out = [f"wds_{dashed}", f"wds_{dashed}_test", dashed, name]
    return list(dict.fromkeys(out))


def source_note(key: str) -> str:
    if key in RETRIEVAL:
        return f"DataComp reads {RETRIEVAL[key][1]}; this is clip_benchmark's wds_{RETRIEVAL[key][0]}"
    return ""


def f1_macro(pred: torch.Tensor, labels: torch.Tensor) -> float:
    """WILDS's ``F1(average="macro")``: sklearn's macro F1 over the classes present in ``labels``."""
    import numpy as np

    with extra("report", "DataComp's macro F1"):
        from sklearn.metrics import f1_score

    y = labels.numpy()
    return float(f1_score(y, pred.numpy(), average="macro", labels=np.unique(y), zero_division=0))


def worst_group(hits: torch.Tensor, groups: torch.Tensor) -> float:
    """The lowest mean of ``hits`` (N,) over the values of ``groups`` (N,) that occur."""
    return min(hits[groups == g].float().mean().item() for g in groups.unique())


def prediction_metric(
    metric: str, logits: torch.Tensor, labels: torch.Tensor, metas: list[dict]
) -> tuple[str, float | None, str]:
    """(metric reported, value, note) for a main metric of :data:`PREDICTION_METRICS`.

    ``logits`` (N, C), ``labels`` (N,); the groups are ``metas[i]["npy"][0]``.  When a
    sample has no ``.npy`` the group metrics fall back to ``acc1`` / ``acc5`` (note says so).
    """
    if metric == "F1-macro_all":
        return metric, f1_macro(logits.argmax(dim=1), labels), ""
    fallback, k = GROUP_METRICS[metric]
    if k > logits.shape[1]:
        return metric, None, f"{metric} needs at least {k} classes"
    top = logits.topk(k, dim=1).indices  # (N, k)
    hits = (top == labels[:, None]).any(dim=1)  # (N,)
    if not metas or any(not m.get("npy") for m in metas):
        return (
            fallback,
            hits.float().mean().item(),
            f"DataComp's {metric} needs each sample's .npy group ids, which this data lacks: {fallback} instead",
        )
    groups = torch.tensor([int(m["npy"][0]) for m in metas])  # (N,)
    return metric, worst_group(hits, groups), ""
