"""Sound: a clip's audio cut exactly to its frames (track.py)."""
