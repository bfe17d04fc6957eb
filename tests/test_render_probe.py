"""tools/render_probe.py's comparison of two machines' camera images (the rendering itself
needs LIBERO and is exercised by the GPU box's kit check)."""

import numpy as np
import pytest

from tools.render_probe import compare, main


def test_compare_reports_mean_max_and_share_per_camera():
    a = {"observation.images.image": np.zeros((2, 4, 4, 3), np.uint8)}
    b = {"observation.images.image": a["observation.images.image"].copy()}
    b["observation.images.image"][0, 0, 0, 0] = 200       # one value, far off
    b["observation.images.image"][1] = 1                   # a whole frame one level off
    out = compare(a, b)["observation.images.image"]
    n = a["observation.images.image"].size
    assert out["max_abs"] == 200
    assert out["mean_abs"] == pytest.approx((200 + 48) / n)
    assert out["share_differing"] == pytest.approx(49 / n)


def test_compare_refuses_images_of_other_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        compare({"c": np.zeros((1, 4, 4, 3), np.uint8)}, {"c": np.zeros((1, 8, 8, 3), np.uint8)})


def test_main_writes_and_compares(tmp_path, monkeypatch):
    import tools.render_probe as probe

    frames = {"observation.images.image": np.full((2, 4, 4, 3), 7, np.uint8)}
    monkeypatch.setattr(probe, "render", lambda *a, **k: frames)  # no LIBERO here: the file round trip
    other = tmp_path / "other.npz"
    np.savez_compressed(other, **{"observation.images.image": np.full((2, 4, 4, 3), 9, np.uint8)})
    report = main(["--out", str(tmp_path / "mine.npz"), "--compare", str(other)])
    assert report["difference"]["observation.images.image"]["mean_abs"] == 2.0
    with np.load(tmp_path / "mine.npz") as back:
        assert (back["observation.images.image"] == 7).all()
