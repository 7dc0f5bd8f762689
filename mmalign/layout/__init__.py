"""Layouts that several layers agree on and that import nothing else of mmalign: the names in
a run directory (:mod:`mmalign.layout.run_dir`) and DeepSpeed's private layout
(:mod:`mmalign.layout.ds_adapter`).

They sit below ``models``: :func:`mmalign.models.load.load` reads a step checkpoint (its
names, DeepSpeed's consolidation) without importing the training run that wrote it.
"""
