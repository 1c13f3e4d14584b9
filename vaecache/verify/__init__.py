"""`vaecache verify`: a cache proven complete and intact, in a folder or at a URL (integrity), and held against its
source (recheck: --dataset, --reencode)."""
