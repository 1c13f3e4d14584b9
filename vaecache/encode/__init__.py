"""The encode run: start-up shared by encode and plan (startup), what identifies a run's latents (fingerprint,
numerics), the batch loop (loop), the run from start-up to manifest (run), host-to-device copies (transfer), the
plan dry run (dry_run), and verify's checks against the source (recheck)."""
