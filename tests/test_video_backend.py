"""Without a loadable torchcodec (no system FFmpeg) the video decoder is picked once, said in
one line, and loading a video dataset prints no torchcodec failure (a real subprocess whose
torchcodec import fails as it does without FFmpeg; a real LeRobot video dataset)."""

import subprocess
import sys

import pytest

from tandem_testutil import ROOT

SCRIPT = r'''
import importlib.abc, importlib.util, logging, sys
class _Fail(importlib.abc.Loader):
    def create_module(self, spec): return None
    def exec_module(self, module):
        raise RuntimeError("Could not load libtorchcodec. Likely causes: FFmpeg is not installed."
                           + "\n[start of libtorchcodec loading traceback]\nOSError: libavutil.so.59" * 5)
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchcodec" or name.startswith("torchcodec."):
            return importlib.util.spec_from_loader(name, _Fail())
        return None
sys.meta_path.insert(0, _Finder())
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
sys.path[:0] = [{root!r}, {tests!r}]
from test_episode_store import write_episodes
from lerobot.datasets.lerobot_dataset import LeRobotDataset
root = sys.argv[1]
write_episodes(root, 2, video=True)
for _ in range(2):  # every load, as lerobot's tools do it: no video_backend given
    ds = LeRobotDataset("tandem/replay", root=root)
    item = ds[3]
    assert tuple(item["observation.images.front"].shape) == (3, 32, 32), item["observation.images.front"].shape
print("LOADED", ds.video_backend if hasattr(ds, "video_backend") else ds._video_backend)
'''


@pytest.mark.slow
def test_without_torchcodec_the_decoder_is_picked_once_and_loads_are_quiet(tmp_path):
    code = SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests"))
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ds")], capture_output=True,
                       text=True, timeout=240, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "LOADED pyav" in out
    said = [line for line in out.splitlines() if "video decoder:" in line]
    # one line at start-up (Tandem's own reads), one when lerobot first needed a default
    assert len(said) == 2 and all("pyav" in line for line in said), said
    assert "torchcodec does not load here" in said[1]
    assert "cannot be loaded" not in out and "start of libtorchcodec loading traceback" not in out


def test_torchcodec_failure_names_the_missing_ffmpeg_in_one_line():
    from data.store.compat import torchcodec_failure

    # torchcodec 0.11's message without system FFmpeg: one traceback per FFmpeg version
    msg = "Could not load libtorchcodec. Likely causes:\n[start of libtorchcodec loading traceback]\n" + "".join(
        f"FFmpeg version {v}:\nOSError: libavutil.so.{v + 52}: cannot open shared object file: No such file "
        f"or directory\nOSError: Could not load this library: /x/libtorchcodec_core{v}.so\n" for v in (8, 7, 6, 5, 4))
    why = torchcodec_failure(RuntimeError(msg))
    assert why == ("no system FFmpeg, libavutil.so.60, libavutil.so.59, libavutil.so.58, libavutil.so.57, "
                   "libavutil.so.56 not found"), why
    assert "\n" not in why
    assert torchcodec_failure(ImportError("No module named 'torchcodec'")) == "No module named 'torchcodec'"
    assert torchcodec_failure(OSError("")) == "OSError"
