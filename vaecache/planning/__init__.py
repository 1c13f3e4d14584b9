"""Planning, pure (no I/O, no processes; the same inputs give the same plan on every rank): the clips a dataset
yields and the resume masks over them (clips), which of them each rank encodes in what batches (jobs), and the
`plan` dry-run report (report)."""
