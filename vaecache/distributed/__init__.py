"""Distributed state, in one place: who am I (launch.py: the rank rule, torch-free), the DP x SP mesh (mesh.py,
pure), set-up, teardown and collectives (context.py), heartbeats that name a stopped rank (liveness.py).
Everything else receives a :class:`~vaecache.distributed.context.DistContext` from
:func:`~vaecache.distributed.context.distributed`::

    with distributed(sp_size=2, timeout_s=600) as ctx:
        work = job.rank_work(ctx.info.rank)
        latents = sp_encode(x, vae.encode, ctx.sp_group)
        if ctx.mesh.is_writer:
            ...

This package imports nothing itself: the CLI reads the rank rule (launch.py) before torch is imported.
"""
