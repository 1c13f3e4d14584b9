"""Distributed state: who am I (launch.py), the DP x SP mesh (mesh.py), init, teardown and collectives
(context.py). Everything else receives a :class:`DistContext` from :func:`distributed`::

    with distributed(sp_size=2, timeout_s=600) as ctx:
        work = job.rank_work(ctx.info.rank)
        latents = sp_encode(x, vae.encode, ctx.sp_group)
        if ctx.mesh.is_writer:
            ...

Parsing the environment (:meth:`RankInfo.from_env`, :func:`first_host`) and building the mesh
(:func:`make_mesh`) are pure and tested without processes.
"""

from vaecache.distributed.context import DistContext, collective_errors, describe_group, distributed, group_timeout_s, resolve_device
from vaecache.distributed.launch import DEFAULT_MASTER_PORT, RankInfo, expand_hostlist, first_host, slurm_master_port
from vaecache.distributed.mesh import Mesh, make_mesh

__all__ = [
    "DEFAULT_MASTER_PORT", "DistContext", "Mesh", "RankInfo", "collective_errors", "describe_group", "distributed",
    "expand_hostlist", "first_host", "group_timeout_s", "make_mesh", "resolve_device", "slurm_master_port",
]
