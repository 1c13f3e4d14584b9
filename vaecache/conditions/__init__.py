"""Image-to-video conditions cached with the clips: the pipeline arithmetic (kinds), the sets
of a cache (sets: embed) and their reader (reader)."""
