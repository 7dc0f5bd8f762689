"""Processes: the process group and its collectives (the only torch.distributed import), cluster
environments, the local launcher and the supervisor around torchrun.
"""
