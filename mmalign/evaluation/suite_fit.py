"""Whether a suite's tasks can read the shards it is pointed at, checked on a probe of a few
samples before any training or embedding (issue 39: a run trained to the end and then
failed on its suite's missing label field).

Each task needs fields of the samples: a ``zeroshot`` or ``probe`` task its ``label_field``
in ``.json`` with values among its ``classnames`` (class indices with ``label_index``), a
``retrieval`` or ``diagnostics`` task the samples' captions.  The probe reads the ``.json``
and captions of the first :data:`PROBE_SAMPLES` samples of the first shard, decoding no image
(a remote one for at most :data:`REMOTE_PROBE_S` seconds).  A mismatch is one line naming the
suite, the task, the field, and the shipped suites that fit the probed samples (else ``none``).
"""

from __future__ import annotations

from mmalign import resources
from mmalign.config import ConfigError
from mmalign.data.remote import kind_of
from mmalign.data.shards import (
    BadSample,
    CorruptTar,
    TruncatedTar,
    expand_urls,
    iter_tar_groups,
    parse_captions,
    parse_meta,
)
from mmalign.evaluation.tasks import task_of

PROBE_SAMPLES = 32  # enough to see a field's absence and a foreign class name; costs no image decode
REMOTE_PROBE_S = (
    15.0  # a remote shard's probe: what arrived by then is the probe (a slow server never blocks)
)


def probe_samples(
    urls: str | list[str], n: int = PROBE_SAMPLES, remote_s: float = REMOTE_PROBE_S
) -> list[dict]:
    """``{"json": dict, "captions": bool}`` of the first ``n`` samples of the first shard. A
    remote shard (HTTP, fsspec, ``pipe:``) is read in a thread for at most ``remote_s`` seconds,
    with a line first: the samples that arrived by then are the probe (none: nothing to check)."""
    expanded = expand_urls(urls) if urls else []
    if not expanded:
        return []
    if kind_of(expanded[0]) == "local":
        return _probe(expanded[0], n)
    import os
    import threading

    if os.environ.get("RANK", "0") == "0":  # the other ranks probe the same shard quietly
        print(
            f"mmalign: probing the first {n} samples of {expanded[0]} for the suite's fields "
            f"(at most {remote_s:g} s) ...",
            flush=True,
        )
    found: list[dict] = []
    reader = threading.Thread(target=_probe_quietly, args=(expanded[0], n, found), daemon=True)
    reader.start()
    reader.join(remote_s)
    return list(found)  # a copy: a reader past the deadline may still append


def _probe_quietly(url: str, n: int, out: list[dict]) -> None:
    try:
        _probe(url, n, out)
    except Exception:  # noqa: BLE001  (an unreachable server: the probe is empty, the loader's own checks speak)
        pass


def _probe(url: str, n: int, out: list[dict] | None = None) -> list[dict]:
    out = [] if out is None else out
    try:
        for raw in iter_tar_groups(url):
            try:
                meta = parse_meta(raw)
            except BadSample:
                continue  # counted and skipped where the samples are read
            try:
                has_captions = bool(parse_captions(raw, meta))
            except BadSample:
                has_captions = False
            out.append({"json": meta, "captions": has_captions})
            if len(out) >= n:
                break
    except (TruncatedTar, CorruptTar, OSError, ValueError):
        pass  # what was read is the probe; the sample pass logs the shard
    return out


def task_mismatch(task: dict, probed: list[dict]) -> str | None:
    """Why ``task`` cannot read the probed samples (None: it can)."""
    if not probed:
        return None
    needs = task_of(task).needs()  # "labels": its label_field; "captions": the samples' captions
    if "labels" in needs:
        field, names = task["label_field"], task["classnames"]
        values = [p["json"].get(field) for p in probed]
        if all(v is None for v in values):
            have = sorted({k for p in probed for k in p["json"]})
            return (
                f"needs the .json field {field!r}, which the samples lack "
                f"(their .json has: {', '.join(have) if have else 'nothing'})"
            )
        if task.get("label_index"):
            bad = [v for v in values if not isinstance(v, int) or not 0 <= v < len(names)]
            if bad:
                return f"needs {field!r} to be a class index 0..{len(names) - 1}, the samples have {bad[0]!r}"
            return None
        foreign = sorted({str(v) for v in values if v not in names})
        if foreign:
            return f"{field!r} values {foreign[:3]} are not among its classnames {names[:4]}{'...' if len(names) > 4 else ''}"
    elif "captions" in needs and not any(p["captions"] for p in probed):
        return "needs captions (.txt, or captions in .json), which the samples lack"
    return None


def suite_mismatch(suite: dict, probed: list[dict]) -> tuple[str, str] | None:
    """(task name, why) of the first task of ``suite`` that cannot read the probed samples."""
    for task in suite.get("tasks", []):
        why = task_mismatch(task, probed)
        if why is not None:
            return task["name"], why
    return None


def fitting_suites(probed: list[dict], exclude: str | None = None) -> list[str]:
    """The shipped shards suites whose every task reads the probed samples: those with a
    labelled task first (a caption-only suite fits any captioned shards)."""
    from mmalign.evaluation.datasets import dataset_spec
    from mmalign.evaluation.suite import load_suite

    labelled: list[str] = []
    captions_only: list[str] = []
    for name in resources.names(resources.SUITES):
        if name == exclude:
            continue
        try:
            suite = load_suite(name)
            if dataset_spec(suite, "probe")["type"] != "shards":
                continue  # reads its own files, not the run's shards
        except Exception:  # noqa: BLE001  (a suggestion is best effort; the suite's own checks speak when used)
            continue
        if suite_mismatch(suite, probed) is None:
            has_labels = any("labels" in task_of(t).needs() for t in suite["tasks"])
            (labelled if has_labels else captions_only).append(name)
    return labelled + captions_only


def check_suite_fields(
    suite: dict,
    spec: dict,
    where: str,
    key: str = "eval.suite",
    flag: str | None = None,
    nothing: str | None = None,
) -> None:
    """A one-line ConfigError when a task of ``suite`` cannot read ``spec``'s shards (probed).
    ``where`` names the data (``data.val``); ``flag`` is how a fitting suite is given (default
    ``--set KEY=``), ``nothing`` how to evaluate nothing (default that flag with ``none``)."""
    if spec.get("type") != "shards":
        return
    probed = probe_samples(spec.get("urls") or [])
    found = suite_mismatch(suite, probed)
    if found is None:
        return
    task, why = found
    flag = flag or f"--set {key}="
    nothing = nothing or f"{flag}none evaluates nothing"
    fits = fitting_suites(probed, exclude=suite.get("name"))
    if fits:
        hint = (
            f"{flag}{fits[0]} fits the data"
            + (f" (as do {', '.join(fits[1:3])})" if fits[1:] else "")
            + f"; {nothing}"
        )
    else:
        hint = (
            f"no shipped suite fits the data ({nothing}, or write a suite YAML whose fields the samples have)"
        )
    named = f"{key}: " if key.startswith("--") else f"config key '{key}': "
    raise ConfigError(f"{named}suite {suite.get('name')!r} does not fit {where}: task {task!r} {why}; {hint}")
