"""Numbers that mean nothing are marked (issue 39, point 4): Recall@k over captions that are
class templates ("a photo of a cat.") measures class separation, not caption matching, since
each caption matches every image of its class equally well.  :data:`TEMPLATE_CAVEAT` is the
one wording of that caveat: the HTML report, ``mmalign eval``'s table, the end of a run's
headline and :func:`mmalign.search.recall.index_recall` all print it.

Captions are templates when the suite says so (``template_captions``, a class dataset) or,
where no suite is known, when they repeat: :func:`looks_templated`.
"""

from __future__ import annotations

TEMPLATE_CAVEAT = (
    "retrieval not meaningful: the captions are class templates, so each caption matches every "
    "image of its class equally well; Recall@k measures class separation, not caption matching"
)
# CIFAR-10 with 18 templates: 180 distinct captions over 10,000 images; real or generated
# captions (the shapes val split: 1,177 distinct over 1,000 images) repeat far less
DISTINCT_PER_IMAGE = 0.25
MIN_IMAGES = 50  # too few images to tell


def captions_are_templates(suite: dict) -> bool:
    """Whether the suite says its dataset captions are class-name templates: ``template_captions``,
    or a dataset captioned from templates by construction (digits, an image folder)."""
    dataset = suite.get("dataset")
    kind = dataset.get("type") if isinstance(dataset, dict) else "shards"
    return bool(suite.get("template_captions")) or kind in ("digits", "imagefolder")


def looks_templated(captions: list[str], n_images: int) -> bool:
    """Whether ``captions`` of ``n_images`` images repeat like class templates: fewer distinct
    captions than :data:`DISTINCT_PER_IMAGE` per image, over at least :data:`MIN_IMAGES` images."""
    return n_images >= MIN_IMAGES and len(set(captions)) < DISTINCT_PER_IMAGE * n_images


def note_lines(records: list[dict]) -> list[str]:
    """``note: TASK: caveat`` for each retrieval record marked ``template_captions``."""
    return [
        f"note: {r.get('dataset', '?')}: {TEMPLATE_CAVEAT}"
        for r in records
        if r.get("task") == "zeroshot_retrieval" and r.get("template_captions")
    ]
