"""Names in OUT: which scene ids can name files and tensors, and the reason given for one that cannot."""

from __future__ import annotations

import pytest

from vaecache.cache.layout import id_problem
from vaecache.errors import DatasetError
from vaecache.sources.scene import Scene


@pytest.mark.parametrize("name, named", [("a\\b", "'\\'"), ("a/b", "'/'"), ("a\x01b", "a control character ('\\x01')"),
                                         (".hidden", "starting with '.'"), ("", "an empty name")])
def test_an_unusable_id_is_refused_naming_what_is_wrong_with_it(name: str, named: str) -> None:
    assert named in id_problem(name)
    with pytest.raises(DatasetError, match="is not usable: ") as refused:
        Scene(name, ("cam",), ("/x.mp4",))
    assert named in str(refused.value)


def test_ordinary_names_are_ids() -> None:
    assert id_problem("scene_000") is None and id_problem("drive 2024-01-01 (front)") is None
