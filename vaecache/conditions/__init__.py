"""Image-to-video conditions cached with the clips: the pipeline arithmetic (kinds) and the sets of a cache (sets)."""
