"""The on-disk contract of a latent cache in one place: layout names and version (layout), durable writes
(io), the shard writer that completes clip records (writer), the sources' identity (provenance), the clip
and failure tables as Parquet (table), progress logs, their streaming merge and the manifest (index),
ownership of OUT (outdir) and the readers of finished caches (reader: CacheReader for verify, LatentCache,
LatentDataset and ShapeBatchSampler for training)."""
