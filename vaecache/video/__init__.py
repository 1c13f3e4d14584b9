"""Video frames: frame-exact reading with PyAV (reader), the decoder backends and opening a video with one
(backends), resizing to a clip's size and value range (resize), and the DataLoader dataset of a batch's views
(dataset)."""
