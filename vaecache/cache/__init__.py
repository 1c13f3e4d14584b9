"""The on-disk contract of a latent cache: layout names and version (layout), durable writes and strict JSON
(io), the Parquet clip and failure tables (table), the shard writer that completes clip records (writer), the
per-rank progress logs and their one parser (progress), repair after a crash (repair), failure records
(failures), the streaming merge into the clip table (finalize), the manifest (manifest), ownership of OUT
(outdir), the sources' identity (provenance), the one reader (reader), and format version 1 (v1). Under all of
them one storage interface for OUT (store: a folder or a URL, chosen once by `open_store`), the lock (lock), and
the commit protocol of each store (commits: outdir.DiskOut's progress logs, objects.ObjectOut's commit records).
Verify is vaecache.verify; the training-side reader is vaecache.training."""
