"""Input layouts behind one interface (scene.Layout): a folder of scene folders or of videos (folders), a
JSONL index (jsonl); finding the scenes of DATA (discover); probing them, once, with a cache, across ranks
(probing); and the `vaecache index` command's job (indexing)."""
