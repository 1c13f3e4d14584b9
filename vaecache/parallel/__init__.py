"""Sequence parallelism: views.py splits the views of one sample over an SP group (pad, local encode,
all_gather, trim). ``from vaecache.parallel import sp_encode`` is the public entry point."""

from vaecache.parallel.views import SPPlan, gather_views, pad_views, plan_sp, sp_encode

__all__ = ["SPPlan", "gather_views", "pad_views", "plan_sp", "sp_encode"]
