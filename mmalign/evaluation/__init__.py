"""Evaluation: zero-shot classification, retrieval, probes, diagnostics, counterfactuals, suites, reports,
clip_benchmark's WebDataset datasets (``cb:DIR``) and benchmarks of many suites."""

from mmalign.evaluation.cb_wds import cb_record, cb_suite
from mmalign.evaluation.retrieval import recall_at_k
from mmalign.evaluation.suite import load_suite, run_suite, summary_rows, write_results
from mmalign.evaluation.zeroshot import build_classifier, zero_shot_metrics

__all__ = [
    "build_classifier",
    "cb_record",
    "cb_suite",
    "load_suite",
    "recall_at_k",
    "run_suite",
    "summary_rows",
    "write_results",
    "zero_shot_metrics",
]
