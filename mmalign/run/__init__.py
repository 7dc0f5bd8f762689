"""A training run: the loop, the engine (DeepSpeed), the cached step, checkpoints, resume, the run
directory, what a run logs and monitors.
"""
