"""Settings, frozen and validated: sizes and buckets (buckets), dtypes (dtypes), what changes the stored latents
(clip), each command's configuration (commands), the flags and TOML keys of encode and plan declared once
(options), and the one loader of flags over a TOML file (loader)."""
