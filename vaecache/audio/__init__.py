"""Sound: a clip's audio cut exactly to its frames (track.py) and turned into what an audio VAE takes: folded to its
channels, resampled to its rate, a log-mel spectrogram every parameter of which is recorded (mel.py)."""
